"""Engines added and removed while the proxy runs.

The engine list comes from the config at start-up; after that it changes through
``PUT /admin/engines`` (the whole new list, :mod:`sessionkv_proxy.ops`) or, with
``engines_file`` set, whenever that file's content changes (polled every
``engines_file_poll_s``; a Kubernetes ConfigMap mounted as a file, for example).  A
new list is checked as the config's is (:func:`~sessionkv_proxy.config.check_engines`);
a bad one changes nothing and is counted, ``sessionkv_proxy_engine_set_changes
{outcome="invalid"}``.

An engine whose URL is new, or whose entry changed, is *added*: from the next routing
decision it takes requests; its load is scraped, its KV events read (its index
entries rebuilt from its replay buffer), its early-decode socket connected and its
handle channel read.  An engine no longer listed is *removed*: it gets no new request
(nor a session's affinity, nor a retry), its scrapes, events and handle channel stop,
its index entries are dropped (a shared Redis index too: every replica should get the
same list), and handles naming it are not used; requests already sent to it finish
(it is listed as draining in ``/health`` until they have).  A changed entry is a
removal then an addition.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from sessionkv_proxy.config import ConfigError, EngineConfig, ProxyConfig, check_engines, \
    read_engines_file
from sessionkv_proxy.consumer import EngineSource, KVEventConsumer
from sessionkv_proxy.engines import EnginePool
from sessionkv_proxy.handle_subscriber import HandleSubscribers
from sessionkv_proxy.index.base import KVIndex
from sessionkv_proxy.metrics import ProxyMetrics
from sessionkv_proxy.route_types import Role
from sessionkv_proxy.startup_checks import ModelCatalog

from vllm_sessionkv.wire.early_decode import EarlyDecodeSender

__all__ = ["EngineSet"]

logger = logging.getLogger("sessionkv_proxy.engine_set")


class EngineSet:
    """Applies a new engine list to the running proxy's parts."""

    def __init__(self, *, config: ProxyConfig, pool: EnginePool, index: KVIndex,
                 metrics: ProxyMetrics, consumer: KVEventConsumer,
                 handles: HandleSubscribers | None, early: EarlyDecodeSender,
                 models: ModelCatalog) -> None:
        self._config = config
        self._pool = pool
        self._index = index
        self._metrics = metrics
        self._consumer = consumer
        self._handles = handles
        self._early = early
        self._models = models
        self._lock = asyncio.Lock()
        self._file_bytes: bytes | None = None
        self.update_gauges()

    @property
    def configs(self) -> list[EngineConfig]:
        return [e.config for e in self._pool.engines]

    async def apply(self, configs: list[EngineConfig]) -> dict[str, Any]:
        """Make ``configs`` the engine list; what was added and removed.  A list that
        fails the config's checks raises ``ValueError`` and changes nothing."""
        try:
            check_engines(configs, self._config.tokenizer)
            if self._handles is None and any(c.handle_channel for c in configs):
                raise ValueError("handle_channel needs an index that keeps published "
                                 "handles")
        except ValueError:
            self._metrics.engine_set_changes.labels("invalid").inc()
            raise
        async with self._lock:
            current = {e.url: e.config for e in self._pool.engines}
            wanted = {c.url: c for c in configs}
            removed = [u for u, c in current.items() if wanted.get(u) != c]
            added = [c for u, c in wanted.items() if current.get(u) != c]
            for url in removed:
                await self._remove(url)
            for config in added:
                self._add(config)
            self._models.set_urls([e.url for e in self._pool.by_role(Role.DECODE)
                                   + self._pool.by_role(Role.PREFILL)])
            self.update_gauges()
        if added or removed:
            self._metrics.engine_set_changes.labels("applied").inc()
            logger.info("engine set changed: added %s, removed %s (draining %s)",
                        [c.url for c in added], removed, sorted(self._pool.draining))
        return {"added": [c.url for c in added], "removed": removed,
                "engines": [c.url for c in self.configs],
                "draining": sorted(self._pool.draining)}

    def _add(self, config: EngineConfig) -> None:
        self._pool.add(config)
        if config.kv_events:
            self._consumer.add(EngineSource(
                engine=config.url, endpoint=config.kv_events,
                replay_endpoint=config.kv_events_replay, topic=config.kv_events_topic))
        if config.early_decode:
            self._early.connect(config.early_decode)
        if config.handle_channel:
            self._handles.add(config.url, config.handle_channel)

    async def _remove(self, url: str) -> None:
        engine = self._pool.remove(url)
        await self._consumer.remove(url)
        if self._handles is not None:
            await self._handles.remove(url)
        try:
            await self._index.clear(url)
        except Exception:   # Redis down: its entries age out; routing skips it anyway
            logger.warning("index entries of removed engine %s not dropped", url,
                           exc_info=True)
        for gauge in (self._metrics.engine_available, self._metrics.event_lag_s,
                      self._metrics.events):
            try:
                gauge.remove(url)
            except KeyError:
                pass
        logger.info("engine %s removed (%d requests in flight finish there)", url,
                    engine.active_requests)

    def update_gauges(self) -> None:
        """``sessionkv_proxy_engines{role,state}``: the set as routing sees it."""
        self._pool.drained()
        gauge = self._metrics.engines
        for role in Role:
            gauge.labels(role.value, "serving").set(len(self._pool.by_role(role)))
            gauge.labels(role.value, "draining").set(
                sum(e.role is role for e in self._pool.draining.values()))

    async def watch_file(self, path: str, interval_s: float) -> None:
        """Apply ``path``'s engine list whenever its content changes (until
        cancelled); a file that does not read or check is logged and counted, and the
        current set kept."""
        self._file_bytes = _read_bytes(path)
        while True:
            await asyncio.sleep(interval_s)
            raw = _read_bytes(path)
            if raw is None or raw == self._file_bytes:
                continue
            self._file_bytes = raw
            try:
                configs = read_engines_file(path, raw)
            except ConfigError as exc:
                self._metrics.engine_set_changes.labels("invalid").inc()
                logger.error("engines_file not applied, engines unchanged: %s", exc)
                continue
            try:
                await self.apply(configs)
            except ValueError as exc:   # counted by apply
                logger.error("engines_file %s not applied, engines unchanged: %s", path, exc)


def _read_bytes(path: str) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        logger.warning("engines_file %s unreadable: %s", path, exc)
        return None
