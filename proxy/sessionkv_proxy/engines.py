"""The prefill and decode pools: per-engine load as the proxy sees it.

Two load signals: the proxy's own in-flight accounting (exact, immediate, but blind
to traffic that bypasses this replica) and a periodic scrape of each engine's
``/metrics`` (queue depth, KV usage; shared truth, but seconds old).  Of the KV usage,
the share only session holds keep (``sessionkv_session_hold_blocks`` over vLLM's
``num_gpu_blocks``) is read too: D frees it on demand (``policy.net_kv_usage``).

Two health signals.  Refused or broken connections mark an engine unhealthy (two in
a row).  An engine that accepts connections but stops answering (a hung or stopped
process) is caught by behaviour: every answer from it (a scrape, a response's
headers, a streamed chunk) is a sign of life, and an engine with no sign of life for
``stall_s`` while the proxy keeps asking (the scraper always does) is *stalled* and
gets no new requests until it answers again.  Requests already sent keep their own
timeout.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

import aiohttp

from sessionkv_proxy.config import EngineConfig
from sessionkv_proxy.route_types import Role

__all__ = ["Engine", "EnginePool", "parse_num_gpu_blocks", "parse_vllm_metrics",
           "reclaimable_share"]

logger = logging.getLogger("sessionkv_proxy.engines")

_METRIC_RE = re.compile(
    r"^(vllm:num_requests_waiting|vllm:num_requests_running|vllm:kv_cache_usage_perc"
    r"|sessionkv_session_hold_blocks|sessionkv_recompute_seconds_per_token)"
    r"(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.M)
# vLLM's cache config as an info gauge; its num_gpu_blocks label is the engine's KV
# blocks (summed over data-parallel ranks, the same on each rank's series).  Other
# labels' values may hold braces (a config value's repr): any text up to it.
_NUM_GPU_BLOCKS_RE = re.compile(r'^vllm:cache_config_info\{.*?\bnum_gpu_blocks="(\d+)"',
                                re.M)


# Gauges each label set (a data-parallel rank) reports of itself, a share of its own
# KV or its own price: their mean over the label sets is the engine's (equal ranks),
# where counts add up.
_MEAN_GAUGES = frozenset({"vllm:kv_cache_usage_perc", "sessionkv_recompute_seconds_per_token"})


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The load gauges we use, over the label sets one engine exports (a data-parallel
    engine, one per rank): counts summed, shares and prices (``_MEAN_GAUGES``) averaged."""
    values: dict[str, list[float]] = {}
    for name, value in _METRIC_RE.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        if number != number:  # NaN
            continue
        values.setdefault(name, []).append(number)
    return {name: sum(v) / len(v) if name in _MEAN_GAUGES else sum(v)
            for name, v in values.items()}


def parse_num_gpu_blocks(text: str) -> int | None:
    """The engine's KV blocks, from ``vllm:cache_config_info``; None when absent."""
    found = _NUM_GPU_BLOCKS_RE.search(text)
    return int(found.group(1)) if found else None


def reclaimable_share(hold_blocks: float | None, num_gpu_blocks: int | None) -> float:
    """The share of the KV, as ``vllm:kv_cache_usage_perc`` counts it, that only
    session holds keep: ``hold_blocks`` over the blocks vLLM's usage divides by
    (``num_gpu_blocks`` less its null block), at most 1.  0 when either is unknown
    (stock vLLM, an older connector): the usage is then read as it is."""
    if not hold_blocks or not num_gpu_blocks or num_gpu_blocks < 2:
        return 0.0
    return min(1.0, max(0.0, hold_blocks) / (num_gpu_blocks - 1))


@dataclass
class Engine:
    config: EngineConfig
    active_requests: int = 0
    active_prefill_tokens: int = 0
    active_decode_tokens: int = 0
    # Work still queued on D for requests routed to it: the prompt tokens it prefills
    # itself plus the output tokens it may generate (``RoutePlan.decode_work_tokens``).
    # Unlike ``active_decode_tokens`` it leaves a request's cached prefix out.
    active_decode_work_tokens: int = 0
    # Prompt tokens this engine computes for the requests routed to it and not yet
    # answered (P: each prompt less the credit for what it holds or pulls,
    # ``RoutePlan.prefill_work_tokens``; D: the uncached prompt of each request it
    # serves alone).  Fractional: a pull counts at its price.
    active_prefill_work_tokens: float = 0.0
    waiting_requests: float = 0.0
    running_requests: float = 0.0
    kv_usage: float = 0.0
    kv_reclaimable: float = 0.0    # of kv_usage, what only session holds keep
    # The connector's calibrated recompute price (sessionkv_recompute_seconds_per_token)
    # when the engine exports it; None for stock vLLM or before it reports one.
    recompute_s_per_token: float | None = None
    healthy: bool = True
    # When connections to it were last refused (unix s): a process that comes back
    # on the same port is a new one, and its NIXL memory holds none of the old KV.
    lost_at_unix_s: float = 0.0
    stalled: bool = False
    # A host-tier restore on this D answered with a handle already inside the expiry
    # margin: its session lease is shorter than the margin, so every such restore
    # would be wasted.  No more are asked of it (until the proxy restarts).
    restore_handles_expire: bool = False
    last_alive_s: float = field(default_factory=time.monotonic)
    last_scrape_s: float = 0.0
    consecutive_failures: int = 0
    served_requests: int = 0
    # The config's, copied: routing reads them on every request, and a plain
    # attribute costs less than a property.
    url: str = field(init=False)
    role: Role = field(init=False)

    def __post_init__(self) -> None:
        self.url = self.config.url
        self.role = self.config.role

    @property
    def available(self) -> bool:
        """Takes new requests: connections succeed and it is not stalled."""
        return self.healthy and not self.stalled

    def alive(self, now_s: float) -> None:
        """A sign of life: an answer, a streamed chunk, a scrape."""
        self.last_alive_s = now_s
        if self.stalled:
            self.stalled = False
            logger.info("engine %s answers again; taking new requests", self.url)


@dataclass
class EnginePool:
    """The engines requests may go to.  The set changes while the proxy runs
    (``engine_set.py``): :meth:`add` and :meth:`remove`, each taking effect for the
    next routing decision.  A removed engine gets no new request; those in flight on
    it finish (it is *draining* until its count reaches zero)."""

    engines: list[Engine]
    _by_url: dict[str, Engine] = field(default_factory=dict)
    # Removed engines with requests still in flight, by URL.
    draining: dict[str, Engine] = field(default_factory=dict)
    # Every URL removed and not added back: handles naming one are not used.
    removed: set[str] = field(default_factory=set)

    def __post_init__(self):
        self._by_url = {e.url: e for e in self.engines}
        self._scraper: tuple | None = None     # scrape_forever's arguments, once running
        self._scrapes: dict[str, asyncio.Task[None]] = {}
        self._index_roles()

    def _index_roles(self) -> None:
        # Routing asks for the pools on every request: tuples, rebuilt on each change.
        self._by_role = {role: tuple(e for e in self.engines if e.role is role)
                         for role in Role}

    @classmethod
    def from_configs(cls, configs: list[EngineConfig]) -> EnginePool:
        return cls([Engine(c) for c in configs])

    def get(self, url: str) -> Engine | None:
        return self._by_url.get(url)

    def add(self, config: EngineConfig) -> Engine:
        """Take new requests on ``config``'s engine from the next routing decision."""
        if config.url in self._by_url:
            raise ValueError(f"engine {config.url} is already in the pool")
        engine = Engine(config)
        self.draining.pop(config.url, None)
        self.removed.discard(config.url)
        self.engines = [*self.engines, engine]
        self._by_url[engine.url] = engine
        self._index_roles()
        if self._scraper is not None:
            self._start_scrape(engine)
        return engine

    def remove(self, url: str) -> Engine:
        """Send ``url`` no new requests; it drains (``draining``) while requests sent
        to it finish."""
        engine = self._by_url.pop(url)
        self.removed.add(url)
        self.engines = [e for e in self.engines if e is not engine]
        self._index_roles()
        task = self._scrapes.pop(url, None)
        if task is not None:
            task.cancel()
        if engine.active_requests:
            self.draining[url] = engine
        return engine

    def drained(self) -> list[str]:
        """Forget the removed engines whose last request ended; their URLs."""
        done = [url for url, e in self.draining.items() if e.active_requests <= 0]
        for url in done:
            del self.draining[url]
        return done

    def by_role(self, role: Role) -> tuple[Engine, ...]:
        return self._by_role[role]

    def mark_failure(self, engine: Engine) -> None:
        engine.consecutive_failures += 1
        if engine.consecutive_failures >= 2 and engine.healthy:
            engine.healthy = False
            engine.lost_at_unix_s = time.time()
            logger.warning("engine %s marked unhealthy", engine.url)

    def mark_success(self, engine: Engine) -> None:
        engine.consecutive_failures = 0
        engine.alive(time.monotonic())
        if not engine.healthy:
            engine.healthy = True
            logger.info("engine %s healthy again", engine.url)

    def check_stall(self, engine: Engine, stall_s: float, now_s: float) -> bool:
        """Mark ``engine`` stalled when it has shown no sign of life for ``stall_s``
        (0: never); True when this call marked it."""
        if stall_s <= 0 or engine.stalled or now_s - engine.last_alive_s <= stall_s:
            return False
        engine.stalled = True
        logger.warning("engine %s stalled: no answer for %.1f s (%d requests in "
                       "flight); no new requests until it answers", engine.url,
                       now_s - engine.last_alive_s, engine.active_requests)
        return True

    async def scrape_forever(self, session: aiohttp.ClientSession, interval_s: float,
                             timeout_s: float = 5.0, on_slow=None, stall_s: float = 0.0,
                             on_stall=None) -> None:
        """One scrape loop per engine, so a hung engine's timeouts never delay the
        others' scrapes (or their signs of life); an engine added later gets its own
        loop, a removed one loses it.  Runs until cancelled."""
        self._scraper = (session, interval_s, timeout_s, on_slow, stall_s, on_stall)
        for engine in self.engines:
            self._start_scrape(engine)
        try:
            await asyncio.Event().wait()
        finally:
            self._scraper = None
            tasks = list(self._scrapes.values())
            self._scrapes.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _start_scrape(self, engine: Engine) -> None:
        session, interval_s, timeout_s, on_slow, stall_s, on_stall = self._scraper
        self._scrapes[engine.url] = asyncio.create_task(self._scrape_engine_forever(
            session, engine, interval_s, timeout_s, on_slow, stall_s, on_stall),
            name=f"scrape-{engine.url}")

    async def _scrape_engine_forever(self, session, engine: Engine, interval_s: float,
                                     timeout_s: float, on_slow, stall_s: float,
                                     on_stall) -> None:
        while True:
            await self._scrape(session, engine, timeout_s, on_slow)
            if self.check_stall(engine, stall_s, time.monotonic()) and on_stall:
                on_stall(engine)
            await asyncio.sleep(interval_s)

    async def _scrape(self, session: aiohttp.ClientSession, engine: Engine,
                      timeout_s: float = 5.0, on_slow=None) -> None:
        try:
            async with session.get(f"{engine.url}/metrics",
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                text = await resp.text()
        except asyncio.TimeoutError:
            # A busy engine answers /metrics late (its API server shares the CPU with
            # the model).  Slow is not down: keep the last load and the engine's
            # health, or a loaded engine drops out of routing and its sessions move
            # away from their KV.  Refused connections still count as failures.
            logger.info("metrics scrape of %s timed out after %.1fs; keeping last load",
                        engine.url, timeout_s)
            if on_slow is not None:
                on_slow(engine)
            return
        except (aiohttp.ClientError, OSError):
            self.mark_failure(engine)
            return
        gauges = parse_vllm_metrics(text)
        engine.waiting_requests = gauges.get("vllm:num_requests_waiting", 0.0)
        engine.running_requests = gauges.get("vllm:num_requests_running", 0.0)
        engine.kv_usage = gauges.get("vllm:kv_cache_usage_perc", 0.0)
        engine.kv_reclaimable = reclaimable_share(gauges.get("sessionkv_session_hold_blocks"),
                                                  parse_num_gpu_blocks(text))
        # None where the engine exports no price (stock vLLM); prices.recompute_price
        # also ignores one that is not positive.
        engine.recompute_s_per_token = gauges.get("sessionkv_recompute_seconds_per_token")
        engine.last_scrape_s = time.monotonic()
        self.mark_success(engine)
