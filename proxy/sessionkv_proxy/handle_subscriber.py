"""Session handles from the decode engines' handle channel, without Redis.

A streamed answer carries no ``kv_transfer_params`` in vLLM 0.32, so the proxy
relaying it never sees D's end-of-turn handle.  A D with ``handle_channel_port``
sends each handle on a ZMQ PUB socket (``vllm_sessionkv.handle_channel``); this
module subscribes to every D configured with ``handles=tcp://HOST:PORT`` and keeps
each handle in the index's in-process table (``PublishedHandles.put_handle``) under
the session's store key, where the routing read (``route_read``) finds it as it finds
a handle the engines published to Redis: single use, given back when unused.

What arrives is a hint like any routing input.  A handle lost (the sequence numbers
show the gap), late (the next turn was already routed) or stale costs that turn's
reuse only: P verifies every block it pulls against the prompt and claims it under
the pull guard.  The table is bounded (``index.max_published_handles``) and handles
expire with D's lease.

D also sends a withdrawal when a hold ends before its lease
(``protocol.HandleWithdrawal``): the kept handle is dropped, and the hold's token is
kept so that no copy of the handle (a session record) is attached either.  Every
message carries the engine's start-up epoch; the latest per engine URL is kept, so a
handle of a process that has since restarted is not attached (``route_read``'s
``epochs``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily

from vllm_sessionkv.wire.handle_channel import (
    HANDLE_TOPIC,
    WITHDRAW_TOPIC,
    Unauthenticated,
    decode_frames,
)
from vllm_sessionkv.wire.protocol import (
    PayloadError,
    decode_handle,
    decode_withdrawal,
    session_store_key,
)

from sessionkv_proxy.index.base import PublishedHandles
from sessionkv_proxy.tasks import EngineTasks
from sessionkv_proxy.zmq_inbox import Inbox

__all__ = ["CHANNEL_OUTCOMES", "HandleChannelStats", "HandleSubscriber", "HandleSubscribers"]

logger = logging.getLogger("sessionkv_proxy.handle_subscriber")

# What became of the handles an engine sent (``sessionkv_proxy_channel_handles``).
CHANNEL_OUTCOMES = ("stored", "withdrawn", "lost", "undecodable", "unsupported_version",
                    "no_session", "expired", "evicted", "store_error", "unauthenticated")
# Messages buffered per engine before ZMQ drops new ones (then counted as lost).
_RECEIVE_HWM = 10_000


class HandleChannelStats(msgspec.Struct, kw_only=True):
    """One engine's channel, as this proxy saw it."""

    received: int = 0
    # By outcome (CHANNEL_OUTCOMES); "lost": sequence numbers never received.
    outcomes: dict[str, int] = msgspec.field(default_factory=dict)
    # The engine started counting again (it restarted).
    publisher_restarts: int = 0
    last_received_unix_s: float = 0.0

    def count(self, outcome: str, n: int = 1) -> None:
        if n:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n


class HandleSubscriber:
    """One D's channel: receive, check, keep."""

    def __init__(self, engine: str, endpoint: str, handles: PublishedHandles,
                 clock: Callable[[], float] = time.time, secret: str | None = None) -> None:
        self.engine = engine
        self._secret = secret.encode() if secret else None
        self.endpoint = endpoint
        self.stats = HandleChannelStats()
        self._handles = handles
        self._clock = clock
        self._last_seq: int | None = None

    async def run(self, context: zmq.asyncio.Context) -> None:
        """Receive until cancelled.  ZMQ reconnects by itself after the engine
        restarts."""
        sub = context.socket(zmq.SUB, socket_class=zmq.Socket)   # read by an Inbox
        sub.setsockopt(zmq.SUBSCRIBE, HANDLE_TOPIC)
        sub.setsockopt(zmq.RCVHWM, _RECEIVE_HWM)
        sub.connect(self.endpoint)
        inbox = Inbox(sub)
        try:
            while True:
                self.receive(await inbox.recv_multipart())
        finally:
            inbox.close()

    def receive(self, frames: list[bytes]) -> str:
        """Handle one message; returns its outcome."""
        now = self._clock()
        self.stats.received += 1
        self.stats.last_received_unix_s = now
        try:
            decoded = decode_frames(frames, self._secret)
        except Unauthenticated:
            return self._outcome("unauthenticated")
        if decoded is None:
            return self._outcome("undecodable")
        topic, seq, raw = decoded
        if self._last_seq is not None:
            if seq > self._last_seq + 1:
                self.stats.count("lost", seq - self._last_seq - 1)
            elif seq <= self._last_seq:
                self.stats.publisher_restarts += 1
        self._last_seq = seq
        if topic == WITHDRAW_TOPIC:
            return self._withdrawn(raw)
        try:
            handle = decode_handle(raw)
        except PayloadError:   # UnsupportedVersion
            return self._outcome("unsupported_version")
        except msgspec.DecodeError:
            return self._outcome("undecodable")
        if not handle.session_id:
            return self._outcome("no_session")
        ttl_ms = -1
        if handle.expires_at_unix_s:
            ttl_ms = int((handle.expires_at_unix_s - now) * 1000)
            if ttl_ms <= 0:
                return self._outcome("expired")
        key = session_store_key(handle.session_id, handle.tenant)
        try:
            self._note_epoch(handle.engine_url, handle.payload.engine_epoch)
            self.stats.count("evicted", self._handles.put_handle(key, raw, ttl_ms))
        except Exception:   # a bug; the channel keeps going, the turn loses reuse only
            logger.exception("keeping a channel handle failed", extra={"pod": self.engine})
            return self._outcome("store_error")
        return self._outcome("stored")

    def _withdrawn(self, raw: bytes) -> str:
        try:
            withdrawal = decode_withdrawal(raw)
        except PayloadError:   # UnsupportedVersion
            return self._outcome("unsupported_version")
        except msgspec.DecodeError:
            return self._outcome("undecodable")
        key = session_store_key(withdrawal.session_id, withdrawal.tenant)
        try:
            self._note_epoch(withdrawal.engine_url, withdrawal.engine_epoch)
            self._handles.withdraw_handle(key, withdrawal.hold_token,
                                          max(1, int(withdrawal.ttl_s * 1000))
                                          if withdrawal.ttl_s else -1)
        except Exception:   # a bug, as above
            logger.exception("a channel withdrawal failed", extra={"pod": self.engine})
            return self._outcome("store_error")
        return self._outcome("withdrawn")

    def _note_epoch(self, engine_url: str | None, epoch: int) -> None:
        if engine_url and epoch:
            self._handles.note_epoch(engine_url, epoch)

    def _outcome(self, outcome: str) -> str:
        self.stats.count(outcome)
        if outcome not in ("stored", "withdrawn"):
            logger.debug("channel handle %s", outcome, extra={"pod": self.engine})
        return outcome


class HandleSubscribers:
    """One ``HandleSubscriber`` task per decode engine; start and stop with the app."""

    def __init__(self, endpoints: dict[str, str], handles: PublishedHandles,
                 secret: str | None = None) -> None:
        if not isinstance(handles, PublishedHandles):
            raise TypeError(f"handle channels need an index that keeps published handles "
                            f"(PublishedHandles); {type(handles).__name__} does not")
        self._ctx = zmq.asyncio.Context()
        self._handles = handles
        self._secret = secret
        self.subscribers = {engine: HandleSubscriber(engine, endpoint, handles,
                                                     secret=secret)
                            for engine, endpoint in endpoints.items()}
        self._tasks = EngineTasks("handle-channel")

    def start(self) -> None:
        for engine in self.subscribers:
            self._start(engine)

    def _start(self, engine: str) -> None:
        self._tasks.start(engine, self.subscribers[engine].run(self._ctx))

    def add(self, engine: str, endpoint: str) -> None:
        """Subscribe to an engine added while the proxy runs."""
        self.subscribers[engine] = HandleSubscriber(engine, endpoint, self._handles,
                                                    secret=self._secret)
        self._start(engine)

    async def remove(self, engine: str) -> None:
        """Stop reading a removed engine's channel (its handles kept so far expire)."""
        self.subscribers.pop(engine, None)
        await self._tasks.end(engine)

    async def stop(self) -> None:
        await self._tasks.end_all()
        self._ctx.term()

    def health(self, now_unix_s: float | None = None) -> tuple[dict, list[str]]:
        """(per engine: what its channel delivered, problems for /health)."""
        now = time.time() if now_unix_s is None else now_unix_s
        report, problems = {}, []
        for engine, sub in self.subscribers.items():
            s = sub.stats
            report[engine] = {
                "endpoint": sub.endpoint, "received": s.received, **s.outcomes,
                "publisher_restarts": s.publisher_restarts,
                "last_received_s_ago": (round(now - s.last_received_unix_s, 1)
                                        if s.last_received_unix_s else None)}
            failure = self._tasks.failure(engine)
            if failure is not None:
                problems.append(f"handle channel of {engine} stopped: {failure!r}")
        return report, problems

    def collector(self) -> _ChannelCollector:
        """Exports ``sessionkv_proxy_channel_handles`` at scrape time."""
        return _ChannelCollector(self.subscribers)


_METRIC = ("sessionkv_proxy_channel_handles",
           "Session handles from the decode engines' handle channel, per engine, by "
           "outcome: stored (kept for the session's next turn), withdrawn (a "
           "withdrawal: D ended the hold before its lease), lost (sent by the "
           "engine and never received), undecodable, unsupported_version, no_session, "
           "expired (its lease had ended), evicted (an older kept handle dropped for "
           "index.max_published_handles), store_error, unauthenticated (no valid HMAC "
           "under side_port_secret).")


class _ChannelCollector:
    def __init__(self, subscribers: dict[str, HandleSubscriber]) -> None:
        self._subscribers = subscribers   # the live table: engines come and go

    def describe(self):
        yield CounterMetricFamily(*_METRIC, labels=("engine", "outcome"))

    def collect(self):
        family = CounterMetricFamily(*_METRIC, labels=("engine", "outcome"))
        for sub in list(self._subscribers.values()):
            for outcome in CHANNEL_OUTCOMES:
                family.add_metric((sub.engine, outcome),
                                  float(sub.stats.outcomes.get(outcome, 0)))
        yield family
