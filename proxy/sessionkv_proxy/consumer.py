"""KV-event ingestion: one ordered ZMQ subscriber per engine, feeding a ``KVIndex``.

Two parts, kept apart so each can be tested alone:

* ``EventApplier`` maps decoded events to index calls (no transport, no sequence
  numbers).  ``BlockStored`` carries token ids, so it computes the router's request
  keys; a run that continues an earlier one is chained from its parent's request key,
  which the index maps back from the parent's engine hash (llm-d's dual-key design).
* ``EngineSubscriber`` owns the sockets and the sequence numbers of one engine's
  publisher (vLLM 0.32 ``ZmqEventPublisher``: PUB frames ``[topic, seq u64 BE,
  payload]``; a ROUTER replay endpoint answering ``[b"", start u64 BE]`` with
  ``[b"", topic, seq, payload]`` frames and an end marker ``seq == -1``).  It applies
  batches strictly in sequence order, one at a time:

  - on start it drops the engine's entries (they may be stale, e.g. in a Redis index
    that outlived a proxy) and rebuilds them from the publisher's replay buffer;
  - a live batch past the next expected one is a gap: replay from the expected one;
  - the publisher restarted (it counts from 0 again, and vLLM 0.32 sends no publisher
    id) when a live sequence number is not above the previous live one, or when a
    batch arrives under a sequence number already applied but with other bytes (each
    batch carries its publish time, so two publishers never send equal bytes).  A
    replay after a gap starts one batch early to make that byte check, so a restart
    is caught even when the new publisher has passed the old sequence number.  The
    engine's entries are then dropped and rebuilt from the new publisher's replay
    buffer;
  - batches that no replay can supply any more are lost: the engine's entries are
    dropped, because missed removals would leave them wrong, and rebuilt from what
    follows.

Index operations are idempotent (set semantics), so a batch re-applied after an index
error, or applied by several proxy replicas sharing one Redis index, converges to the
same state once everyone has caught up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec
import zmq
import zmq.asyncio

from .block_size import BlockSize
from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEvent,
    KVEventBatch,
    cache_salt_of,
    decode_batch_lenient,
)
from .index.base import TIER_DEVICE, KVIndex
from .keys import chain_request_keys
from .tasks import EngineTasks
from .zmq_inbox import Inbox

__all__ = [
    "ConsumerStats",
    "EngineSource",
    "EngineSubscriber",
    "EventApplier",
    "KVEventConsumer",
]

logger = logging.getLogger(__name__)

# Replay server's end-of-replay sequence number (vLLM's ZmqEventPublisher.END_SEQ).
_END_SEQ = -1


class EngineSource(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where one engine publishes its KV events, and how to read them."""

    engine: str  # the engine's id in the index and in routing decisions
    endpoint: str  # the engine's PUB socket, e.g. "tcp://10.0.0.5:5557"
    replay_endpoint: str | None = None  # its ROUTER replay socket; None: no recovery
    topic: str = ""
    # KV-cache group to index (hybrid models publish one run per group).
    group_idx: int = 0


class ConsumerStats(msgspec.Struct, kw_only=True):
    """Counters for one engine's event stream (exported as metrics by the app)."""

    batches_applied: int = 0
    batches_duplicate: int = 0  # already applied through a replay
    batches_undecodable: int = 0
    batches_lost: int = 0  # needed but no longer in the publisher's replay buffer
    events_applied: int = 0
    events_undecodable: int = 0
    events_dropped: int = 0  # decoded but not indexable; see dropped_by_reason
    dropped_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    resets: int = 0
    index_errors: int = 0
    last_seq: int = -1
    last_lag_s: float = 0.0  # receive time minus the batch's publish time
    max_lag_s: float = 0.0


class EventApplier:
    """Applies one engine's decoded events to an index, in the order given."""

    def __init__(self, index: KVIndex, engine: str, block_size: BlockSize,
                 stats: ConsumerStats, group_idx: int = 0) -> None:
        self._index = index
        self._engine = engine
        # Shared with the router: request keys are chained in the engines' block
        # size, learned from the first event or configured (block_size.py).
        self._block_size = block_size
        self._group_idx = group_idx
        self._stats = stats

    async def apply_batch(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if await self.apply(event):
                self._stats.events_applied += 1

    async def apply(self, event: KVEvent) -> bool:
        """Apply one event; False if it was dropped (counted by reason)."""
        if isinstance(event, AllBlocksCleared):
            # vLLM emits it on a prefix-cache reset, which empties the device pool only.
            await self._index.clear(self._engine, TIER_DEVICE)
            return True
        if event.group_idx not in (None, self._group_idx):
            return self._drop("other_group")
        tier = event.medium or TIER_DEVICE
        if isinstance(event, BlockRemoved):
            await self._index.remove(self._engine, tier, event.block_hashes)
            return True
        return await self._stored(event, tier)

    async def _stored(self, event: BlockStored, tier: str) -> bool:
        if not event.token_ids:
            return await self._stored_tokenless(event, tier)
        num_blocks = len(event.block_hashes)
        if not self._block_size.accept(self._engine, event.block_size):
            return self._drop("block_size_mismatch")
        if len(event.token_ids) != num_blocks * event.block_size:
            # e.g. sliding-window groups skip null blocks: tokens no longer line up.
            return self._drop("tokens_not_aligned")
        parent = None
        if event.parent_block_hash is not None:
            parent = await self._index.request_key(self._engine, event.parent_block_hash)
            if parent is None:
                # The parent's store was lost or evicted: the chain cannot be continued.
                return self._drop("unknown_parent")
            keys = chain_request_keys(event.token_ids, event.block_size, parent=parent)
        else:
            keys = chain_request_keys(event.token_ids, event.block_size,
                                      salt=cache_salt_of(event), lora_name=event.lora_name)
        blocks = list(zip(event.block_hashes, keys, strict=True))
        await self._index.store(self._engine, tier, blocks)
        return True

    async def _stored_tokenless(self, event: BlockStored, tier: str) -> bool:
        # Offload tiers may announce blocks by hash only; place those whose request
        # key is known from another tier of the same engine.
        blocks = []
        for engine_hash in event.block_hashes:
            key = await self._index.request_key(self._engine, engine_hash)
            if key is not None:
                blocks.append((engine_hash, key))
        if not blocks:
            return self._drop("tokenless_unknown")
        await self._index.store(self._engine, tier, blocks)
        return True

    def _drop(self, reason: str) -> bool:
        self._stats.events_dropped += 1
        self._stats.dropped_by_reason[reason] = self._stats.dropped_by_reason.get(reason, 0) + 1
        logger.debug("dropped KV event", extra={"pod": self._engine, "reason": reason})
        return False


class EngineSubscriber:
    """One engine's event stream: subscribe, detect gaps and restarts, replay, apply."""

    def __init__(self, source: EngineSource, index: KVIndex, context: zmq.asyncio.Context,
                 *, block_size: BlockSize | None = None,
                 replay_timeout_s: float = 5.0, error_backoff_s: float = 0.5,
                 clock: Callable[[], float] = time.time,
                 digest_window: int = 10_000) -> None:
        self.source = source
        self.stats = ConsumerStats()
        self._index = index
        self._ctx = context
        self._replay_timeout_s = replay_timeout_s
        self._error_backoff_s = error_backoff_s
        self._clock = clock
        self._applier = EventApplier(index, source.engine,
                                     block_size if block_size is not None else BlockSize(None),
                                     self.stats, source.group_idx)
        self._next_seq = 0
        self._last_live_seq: int | None = None
        # seq -> hash of the applied payload, for the recent past: a live batch may
        # trail a replay that already applied it, and only the bytes tell that
        # duplicate from a restarted publisher's batch under the same number.
        self._applied_digests: OrderedDict[int, int] = OrderedDict()
        self._digest_window = digest_window

    async def run(self) -> None:
        """Consume until cancelled."""
        sub = self._ctx.socket(zmq.SUB, socket_class=zmq.Socket)   # read by an Inbox
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        inbox = Inbox(sub)
        try:
            # Whatever the index holds for this engine predates this subscriber and
            # cannot be checked against the stream: rebuild it from the replay buffer.
            await self._guarded(self._index.clear(self.source.engine))
            await self._guarded(self.catch_up())
            while True:
                frames = await inbox.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.stats.batches_undecodable += 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                await self._guarded(self.handle_live(seq, frames[2]))
        finally:
            inbox.close()

    async def _guarded(self, step) -> None:
        # A failed index write leaves _next_seq where it was: the next live batch then
        # shows a gap and the replay re-applies what failed (operations are idempotent).
        try:
            await step
        except Exception:
            self.stats.index_errors += 1
            logger.exception("applying KV events failed", extra={"pod": self.source.engine})
            await asyncio.sleep(self._error_backoff_s)

    async def catch_up(self) -> None:
        """Replay whatever the publisher still buffers from the next expected batch."""
        if self.source.replay_endpoint is not None:
            await self._replay_from(self._next_seq)

    async def handle_live(self, seq: int, payload: bytes) -> None:
        """Handle one batch received on the live stream."""
        if self._last_live_seq is not None and seq <= self._last_live_seq:
            await self._restarted(f"live seq {seq} after {self._last_live_seq}")
        elif seq < self._next_seq and self._applied_digests.get(seq) != hash(payload):
            await self._restarted(f"live seq {seq} differs from the batch applied as {seq}")
        self._last_live_seq = seq
        if seq < self._next_seq:
            self.stats.batches_duplicate += 1
            return
        if seq > self._next_seq:
            self.stats.gaps += 1
            logger.info("KV event gap: expected %d, got %d", self._next_seq, seq,
                        extra={"pod": self.source.engine})
            if self.source.replay_endpoint is not None:
                await self._replay_from(self._next_seq)
            if seq < self._next_seq:
                self.stats.batches_duplicate += 1
                return
            if seq > self._next_seq:
                await self._lost(seq)
        await self._apply(seq, payload)

    async def _restarted(self, why: str) -> None:
        self.stats.resets += 1
        logger.warning("KV event publisher restarted (%s): rebuilding", why,
                       extra={"pod": self.source.engine})
        await self._index.clear(self.source.engine)
        self._next_seq = 0
        self._applied_digests.clear()

    async def _lost(self, resume_seq: int) -> None:
        lost = resume_seq - self._next_seq
        self.stats.batches_lost += lost
        logger.warning("%d KV event batches lost: dropping the engine's entries", lost,
                       extra={"pod": self.source.engine})
        await self._index.clear(self.source.engine)
        self._next_seq = resume_seq

    async def _replay_from(self, start_seq: int) -> None:
        # One batch early, when we still know its bytes: if the publisher answers that
        # number with other bytes, it is a new publisher.
        check_seq = start_seq - 1 if start_seq - 1 in self._applied_digests else None
        if await self._replay_once(start_seq if check_seq is None else check_seq, check_seq):
            await self._replay_once(0, None)

    async def _replay_once(self, request_seq: int, check_seq: int | None) -> bool:
        """One replay request; True when it showed the publisher restarted."""
        assert self.source.replay_endpoint is not None
        self.stats.replays += 1
        # A fresh DEALER per replay: a timed-out replay's late frames cannot leak into
        # the next one.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.source.replay_endpoint)
        timeout_ms = int(self._replay_timeout_s * 1000)
        try:
            await dealer.send_multipart([b"", request_seq.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(timeout_ms):
                    self.stats.replay_failures += 1
                    logger.warning("KV event replay timed out",
                                   extra={"pod": self.source.engine})
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.stats.batches_undecodable += 1
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END_SEQ:
                    return False
                if seq == check_seq and self._applied_digests.get(seq) != hash(frames[3]):
                    await self._restarted(f"replayed seq {seq} differs from the one applied")
                    return True
                if seq < self._next_seq:
                    continue
                if seq > self._next_seq:
                    await self._lost(seq)  # the buffer no longer reaches back far enough
                await self._apply(seq, frames[3])
        finally:
            dealer.close(linger=0)

    async def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch, undecodable = decode_batch_lenient(payload)
        except EventDecodeError:
            self.stats.batches_undecodable += 1
            logger.warning("undecodable KV event batch %d", seq, extra={"pod": self.source.engine})
        else:
            self.stats.events_undecodable += undecodable
            lag_s = self._clock() - batch.ts
            self.stats.last_lag_s = lag_s
            self.stats.max_lag_s = max(self.stats.max_lag_s, lag_s)
            await self._applier.apply_batch(batch)
            self.stats.batches_applied += 1
        self._next_seq = seq + 1
        self.stats.last_seq = seq
        self._applied_digests[seq] = hash(payload)
        while len(self._applied_digests) > self._digest_window:
            self._applied_digests.popitem(last=False)


class KVEventConsumer:
    """Runs one ``EngineSubscriber`` task per engine; start and stop it with the app.
    Engines added or removed while it runs (``engine_set.py``) get or lose theirs."""

    def __init__(self, sources: Sequence[EngineSource], index: KVIndex,
                 **subscriber_kwargs) -> None:
        # subscriber_kwargs: EngineSubscriber's keywords, block_size (one BlockSize
        # shared by every engine and the router) among them.
        engines = [s.engine for s in sources]
        if len(set(engines)) != len(engines):
            raise ValueError(f"engine ids must be unique, got {engines}")
        self._ctx = zmq.asyncio.Context()
        self._index = index
        self._subscriber_kwargs = subscriber_kwargs
        self.subscribers = {s.engine: EngineSubscriber(s, index, self._ctx, **subscriber_kwargs)
                            for s in sources}
        self._tasks = EngineTasks("kv-events")

    def start(self) -> None:
        for engine in self.subscribers:
            self._start(engine)

    def _start(self, engine: str) -> None:
        self._tasks.start(engine, self.subscribers[engine].run())

    def add(self, source: EngineSource) -> None:
        """Subscribe to an engine added while the proxy runs (its entries are rebuilt
        from its replay buffer, as at start)."""
        if source.engine in self.subscribers:
            raise ValueError(f"engine {source.engine} already has a KV-event subscriber")
        self.subscribers[source.engine] = EngineSubscriber(
            source, self._index, self._ctx, **self._subscriber_kwargs)
        self._start(source.engine)

    async def remove(self, engine: str) -> None:
        """Stop reading a removed engine's events."""
        self.subscribers.pop(engine, None)
        await self._tasks.end(engine)

    async def stop(self) -> None:
        await self._tasks.end_all()
        self._ctx.term()

    def stats(self) -> dict[str, ConsumerStats]:
        return {engine: sub.stats for engine, sub in self.subscribers.items()}
