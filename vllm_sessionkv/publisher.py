"""Out-of-band publication of session handles (Redis).

vLLM 0.32's streaming responses carry no ``kv_transfer_params``, so a router that
streams D's output never sees D's end-of-turn handle.  D therefore also writes the
handle to Redis under the session id (``redis_keys.RedisKeys.handle``, in the
proxy's hash tag, so the proxy's routing read takes it in the same script as the
index on a Redis Cluster too).  ``request_finished`` runs on the scheduler's
hot path, so writes happen on a background thread and never block a step.
Without Redis, D's handle channel (``handle_channel.py``) carries the handle.

When D ends a hold before its lease, it withdraws the handle: the hold's token joins
the session's withdrawn set (``RedisKeys.withdrawn``), which the proxy's routing read
checks, so no replica attaches it.  Every handle written also refreshes this engine's
start-up epoch under its URL (``RedisKeys.epochs``): a replica that reads a later
epoch than a handle's knows the handle names a dead process's blocks.  A write lost
(Redis down) costs a turn a refused claim and a recompute, never correctness.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from vllm_sessionkv.wire.protocol import (
    HandleWithdrawal,
    PayloadError,
    encode_handle,
    handle_from_params,
    session_store_key,
)
from vllm_sessionkv.wire.redis_keys import DEFAULT_NAMESPACE, RedisKeys, parse_redis_url

__all__ = ["HandlePublisher"]

logger = logging.getLogger("vllm.sessionkv.publisher")

# Bounded so a dead Redis cannot grow the engine's memory; overflow is counted.
_MAX_PENDING = 10_000


class HandlePublisher:
    def __init__(self, redis_url: str | None, namespace: str = DEFAULT_NAMESPACE):
        self.enabled = bool(redis_url)
        self.keys = RedisKeys(namespace)
        self._failures = 0
        self._lock = threading.Lock()
        # (handle key, handle, ttl s, engine URL, epoch) or (withdrawn key, token, ttl s)
        self._queue: queue.Queue[tuple | None] = queue.Queue(_MAX_PENDING)
        self._thread: threading.Thread | None = None
        if self.enabled:
            # imported only where configured: the engine may not need redis
            target = parse_redis_url(redis_url)
            if target.cluster:
                from redis.cluster import RedisCluster as client_type
            else:
                from redis import Redis as client_type
            self._client = client_type.from_url(target.url, socket_timeout=2.0,
                                                socket_connect_timeout=2.0)
            self._thread = threading.Thread(target=self._run, name="sessionkv-publisher",
                                            daemon=True)
            self._thread.start()

    def publish(self, session_id: str, params: dict[str, Any], ttl_s: float) -> bool:
        """Queue a handle for publication; False if disabled or the queue is full."""
        if not self.enabled:
            return False
        try:
            handle = handle_from_params(params)
            key = self.keys.handle(session_store_key(session_id, handle.tenant))
            self._queue.put_nowait((key, encode_handle(handle), ttl_s,
                                    handle.engine_url, handle.payload.engine_epoch))
            return True
        except (queue.Full, PayloadError) as exc:
            logger.warning("sessionkv: handle for session %s not published: %r",
                           session_id, exc)
            self._count_failure()
            return False

    def announce(self, engine_url: str, epoch: int) -> None:
        """Write this engine process's start-up epoch under its URL now (every
        handle written refreshes it), so replicas drop the previous process's handles
        before the first new one."""
        if self.enabled and engine_url and epoch:
            try:
                self._queue.put_nowait(("", b"", 0.0, engine_url, epoch))
            except queue.Full:
                self._count_failure()

    def withdraw(self, withdrawal: HandleWithdrawal) -> bool:
        """Queue a withdrawal; False if disabled or the queue is full."""
        if not self.enabled:
            return False
        key = self.keys.withdrawn(session_store_key(withdrawal.session_id,
                                                    withdrawal.tenant))
        try:
            self._queue.put_nowait((key, str(withdrawal.hold_token), withdrawal.ttl_s))
            return True
        except queue.Full:
            logger.warning("sessionkv: withdrawal for session %s not published (queue "
                           "full)", withdrawal.session_id)
            self._count_failure()
            return False

    def take_failures(self) -> int:
        with self._lock:
            failures, self._failures = self._failures, 0
        return failures

    def _count_failure(self) -> None:
        with self._lock:
            self._failures += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._write(item)
            except Exception as exc:  # any Redis/network error: count it, keep serving
                logger.warning("sessionkv: Redis write of %s failed: %r", key, exc)
                self._count_failure()

    def _write(self, item: tuple) -> None:
        ttl_ms = max(1, int(item[2] * 1000))
        pipe = self._client.pipeline(transaction=False)
        if len(item) == 3:              # a withdrawal
            # Scored by when the withdrawal stops mattering (every handle of the hold
            # has expired by then); those past it are trimmed here, so a long session
            # keeps about one lease's worth of tokens.
            key, token, _ = item
            now_ms = int(time.time() * 1000)
            pipe.zadd(key, {token: now_ms + ttl_ms})
            pipe.zremrangebyscore(key, "-inf", now_ms)
            pipe.pexpire(key, ttl_ms)
        else:
            key, payload, _, engine_url, epoch = item
            if key:                     # else only the epoch (``announce``)
                pipe.set(key, payload, px=ttl_ms)
            if engine_url and epoch:
                pipe.hset(self.keys.epochs, engine_url, str(epoch))
        pipe.execute()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=2.0)
            self._thread = None
