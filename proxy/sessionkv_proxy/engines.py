"""The prefill and decode pools: per-engine load as the proxy sees it.

Two load signals: the proxy's own in-flight accounting (exact, immediate, but blind
to traffic that bypasses this replica) and a periodic scrape of each engine's
``/metrics`` (queue depth, KV usage; shared truth, but seconds old).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

import aiohttp

from sessionkv_proxy.config import EngineConfig, Role

__all__ = ["Engine", "EnginePool", "parse_vllm_metrics"]

logger = logging.getLogger("sessionkv_proxy.engines")

_METRIC_RE = re.compile(
    r"^(vllm:num_requests_waiting|vllm:num_requests_running|vllm:kv_cache_usage_perc)"
    r"(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.M)


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum the load gauges we use across label sets (one engine may export several)."""
    out: dict[str, float] = {}
    for name, value in _METRIC_RE.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        if number != number:  # NaN
            continue
        out[name] = out.get(name, 0.0) + number
    return out


@dataclass
class Engine:
    config: EngineConfig
    active_requests: int = 0
    active_prefill_tokens: int = 0
    active_decode_tokens: int = 0
    waiting_requests: float = 0.0
    running_requests: float = 0.0
    kv_usage: float = 0.0
    healthy: bool = True
    last_scrape_s: float = 0.0
    consecutive_failures: int = 0
    served_requests: int = 0

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def role(self) -> Role:
        return self.config.role


@dataclass
class EnginePool:
    engines: list[Engine]
    _by_url: dict[str, Engine] = field(default_factory=dict)

    def __post_init__(self):
        self._by_url = {e.url: e for e in self.engines}
        # The pools are fixed at start-up; routing asks for them on every request.
        self._by_role = {role: tuple(e for e in self.engines if e.role is role)
                         for role in Role}

    @classmethod
    def from_configs(cls, configs: list[EngineConfig]) -> EnginePool:
        return cls([Engine(c) for c in configs])

    def get(self, url: str) -> Engine | None:
        return self._by_url.get(url)

    def by_role(self, role: Role) -> tuple[Engine, ...]:
        return self._by_role[role]

    def mark_failure(self, engine: Engine) -> None:
        engine.consecutive_failures += 1
        if engine.consecutive_failures >= 2 and engine.healthy:
            engine.healthy = False
            logger.warning("engine %s marked unhealthy", engine.url)

    def mark_success(self, engine: Engine) -> None:
        engine.consecutive_failures = 0
        if not engine.healthy:
            engine.healthy = True
            logger.info("engine %s healthy again", engine.url)

    async def scrape_forever(self, session: aiohttp.ClientSession, interval_s: float,
                             timeout_s: float = 5.0, on_slow=None) -> None:
        while True:
            await asyncio.gather(*(self._scrape(session, e, timeout_s, on_slow)
                                   for e in self.engines))
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
        engine.last_scrape_s = time.monotonic()
        self.mark_success(engine)
