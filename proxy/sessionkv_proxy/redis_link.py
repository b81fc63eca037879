"""The proxy's one connection to Redis: a bounded blocking pool, a deadline on every
call, and a circuit breaker.

Redis is an accelerator here, never a dependency of a request: it shares the index,
the session records and the engines' published handles across proxy replicas.  Every
call on the request path goes through :meth:`RedisLink.call`, which

* gives the call ``timeout_s`` (connection wait, send and reply together), so a
  stopped Redis costs a request at most that, not redis-py's retries with backoff;
* counts failures and, after ``failures_to_open`` in a row, opens the breaker: calls
  then raise :class:`RedisUnavailable` at once, and the callers serve from the
  in-process view (``index/fallback.py``);
* while open, :meth:`probe` pings Redis every ``retry_interval_s`` (doubling up to
  ``max_retry_interval_s``); the owner re-publishes what Redis missed, then
  :meth:`close_breaker` lets calls through again.

The pool blocks for a free connection (up to the call's deadline) instead of failing
at ``max_connections``: load becomes waiting, never a ``MaxConnectionsError``.  A
pooled connection that died with a restarted Redis is retried once on a fresh one.

On a Redis Cluster (``redis+cluster://``, see ``vllm_sessionkv.wire.redis_keys``) the
client is redis-py's ``RedisCluster``: it routes each command by its keys' slot and,
after a connection error, reads the slot map again, so a promoted replica serves once
the cluster has failed over.  All of a deployment's keys share one slot, whose node
is the one that matters: the probe and the restart check (``server_id``) ask that
node (``home_key``), not every node.  Its pool (``max_connections`` per node) raises
when full instead of waiting, so the link lets at most that many calls in at once and
the rest wait for a turn, within their deadline, as on one Redis.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["LinkState", "RedisLink", "RedisUnavailable", "make_redis_client"]

logger = logging.getLogger("sessionkv_proxy.redis")

T = TypeVar("T")

# A call's deadline, kept in the caller's task (Python 3.11+).  asyncio.wait_for, the
# fallback, runs the call in a task of its own: 15-30 us more CPU per call, and a
# request makes four or so (the routing read, its session write, the index stores).
_timeout = getattr(asyncio, "timeout", None)


class RedisUnavailable(Exception):
    """Redis did not serve this call (breaker open, timeout or error)."""


class LinkState(str, enum.Enum):
    UP = "up"
    DOWN = "down"            # breaker open: nothing is sent
    RESYNCING = "resyncing"  # answering again; what it missed is being re-published


def make_redis_client(url: str, *, max_connections: int, timeout_s: float):
    """A redis-py asyncio client: on one Redis, a blocking pool sized for the proxy's
    concurrency; on a cluster (``redis+cluster://``), ``RedisCluster``."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    from vllm_sessionkv.wire.redis_keys import parse_redis_url

    target = parse_redis_url(url)
    if target.cluster:
        from redis.asyncio.cluster import RedisCluster

        # One retry, after the client re-read the slot map (a failed-over master);
        # the link's deadline bounds the rest.
        return RedisCluster.from_url(
            target.url, max_connections=max_connections, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1),
            health_check_interval=30)
    pool = aioredis.BlockingConnectionPool.from_url(
        target.url, max_connections=max_connections, timeout=timeout_s,
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        # One retry on a fresh connection: a pooled one may have died with a
        # restarted Redis.  Timeouts are not retried; the deadline covers them.
        retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError],
        health_check_interval=30)
    return aioredis.Redis(connection_pool=pool)


class RedisLink:
    def __init__(self, client: Any, *, timeout_s: float = 0.5, failures_to_open: int = 3,
                 retry_interval_s: float = 1.0, max_retry_interval_s: float = 10.0,
                 on_error: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 home_key: str | None = None) -> None:
        if timeout_s <= 0 or failures_to_open < 1 or retry_interval_s <= 0:
            raise ValueError("timeout_s and retry_interval_s must be > 0, "
                             "failures_to_open >= 1")
        self.client = client
        # On a cluster: a key in the slot all of the deployment's keys share.
        self.home_key = home_key
        self.timeout_s = timeout_s
        self.failures_to_open = failures_to_open
        self.retry_interval_s = retry_interval_s
        self.max_retry_interval_s = max(max_retry_interval_s, retry_interval_s)
        self._on_error = on_error or (lambda kind: None)
        self._clock = clock
        self.state = LinkState.UP
        self.consecutive_failures = 0
        self.last_error = ""
        self.down_since_s: float | None = None
        self.times_opened = 0
        self._interval_s = retry_interval_s
        self._next_probe_s = 0.0
        # Cluster: every call goes to one node; a full pool there would raise.
        self._turns = asyncio.Semaphore(
            client.get_connection_kwargs()["max_connections"]) if self.cluster else None

    @property
    def cluster(self) -> bool:
        return hasattr(self.client, "get_node_from_key")

    async def _ping(self) -> object:
        if self.cluster and self.home_key is not None:
            # A keyed read goes to the slot's node, and re-reads the slot map after
            # a connection error (PING would go to every node, a dead one included).
            return await self.client.exists(self.home_key)
        return await self.client.ping()

    async def server_id(self) -> str | None:
        """The ``run_id`` of the Redis that serves the deployment's keys: it changes
        when that Redis restarts (empty) or, on a cluster, when the slot moved to
        another node (a promoted replica, which may lack the last writes)."""
        if self.cluster:
            if self.home_key is None:
                return None

            async def ask_home_node() -> Any:
                await self.client.initialize()   # the slot map; a no-op once known
                node = self.client.get_node_from_key(self.home_key)
                info = await self.client.info("server", target_nodes=node)
                # {node name: info} or the node's info, by redis-py version
                return info.get(node.name, info) if isinstance(info, dict) else info

            info = await self.call("info", ask_home_node)
        else:
            info = await self.call("info", lambda: self.client.info("server"))
        run_id = info.get("run_id") if isinstance(info, dict) else None
        return None if run_id is None else str(run_id)

    @property
    def available(self) -> bool:
        """Calls are sent (the breaker is closed)."""
        return self.state is LinkState.UP

    async def call(self, op: str, make: Callable[[], Awaitable[T]],
                   force: bool = False) -> T:
        """Run ``make()`` against Redis within the deadline; ``op`` names it in the
        error counts.  ``force`` sends it even while resyncing (the resync itself)."""
        if not (self.available or (force and self.state is LinkState.RESYNCING)):
            raise RedisUnavailable(f"redis {self.state.value}")
        try:
            if _timeout is not None:
                async with _timeout(self.timeout_s * 2):
                    result = await self._in_turn(make)
            else:
                result = await asyncio.wait_for(self._in_turn(make), self.timeout_s * 2)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # timeouts, connection and protocol errors alike
            self._failed(op, exc)
            raise RedisUnavailable(f"{op}: {exc!r}") from exc
        self.consecutive_failures = 0
        return result

    async def call_long(self, op: str, make: Callable[[], Awaitable[T]],
                        timeout_s: float = 30.0) -> T:
        """An operator's call that may take long (a SCAN over every key): its own
        deadline, and its failure does not count towards opening the breaker."""
        if not self.available:
            raise RedisUnavailable(f"redis {self.state.value}")
        try:
            return await asyncio.wait_for(make(), timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise RedisUnavailable(f"{op}: {exc!r}") from exc

    async def _in_turn(self, make: Callable[[], Awaitable[T]]) -> T:
        if self._turns is None:
            return await make()
        async with self._turns:
            return await make()

    def _failed(self, op: str, exc: BaseException) -> None:
        kind = "timeout" if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) \
            or "Timeout" in type(exc).__name__ else "error"
        self._on_error(f"redis_{kind}")
        self.last_error = f"{op}: {type(exc).__name__}: {exc}"[:300]
        self.consecutive_failures += 1
        if self.state is not LinkState.DOWN and \
                self.consecutive_failures >= self.failures_to_open:
            self.open_breaker()

    def open_breaker(self) -> None:
        if self.state is not LinkState.DOWN:
            logger.warning("redis unavailable (%s); routing from the in-process view "
                           "until it answers", self.last_error)
            self.times_opened += 1
            if self.down_since_s is None:
                self.down_since_s = self._clock()
        self.state = LinkState.DOWN
        self._next_probe_s = self._clock() + self._interval_s

    def hold_for_resync(self) -> None:
        """Redis answers but missed writes: only forced calls go through until
        :meth:`close_breaker`."""
        if self.state is LinkState.UP:
            self.state = LinkState.RESYNCING

    def close_breaker(self) -> None:
        if self.state is not LinkState.UP:
            logger.info("redis available again after %.1f s",
                        self._clock() - (self.down_since_s or self._clock()))
        self.state = LinkState.UP
        self.consecutive_failures = 0
        self.down_since_s = None
        self._interval_s = self.retry_interval_s

    async def probe(self) -> bool:
        """While down and due, ping Redis; True when it answered (the state is then
        RESYNCING until the owner calls :meth:`close_breaker`)."""
        if self.state is not LinkState.DOWN or self._clock() < self._next_probe_s:
            return False
        try:
            await asyncio.wait_for(self._ping(), self.timeout_s * 2)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.last_error = f"ping: {type(exc).__name__}: {exc}"[:300]
            self._interval_s = min(self._interval_s * 2, self.max_retry_interval_s)
            self._next_probe_s = self._clock() + self._interval_s
            return False
        self.state = LinkState.RESYNCING
        return True

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state.value,
                               "mode": "cluster" if self.cluster else "single"}
        if self.down_since_s is not None:
            out["down_for_s"] = round(self._clock() - self.down_since_s, 1)
        if self.last_error:
            out["last_error"] = self.last_error
        out["times_unavailable"] = self.times_opened
        return out

    async def aclose(self) -> None:
        await self.client.aclose()
