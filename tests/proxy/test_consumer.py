"""The event consumer against vLLM's real ``ZmqEventPublisher`` (PUB + ROUTER replay).

Engine hashes are the low 64 bits of real vLLM 0.32 sha256 block hashes, as the engine
publishes them by default.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import pytest
import zmq
import zmq.asyncio

from sessionkv_proxy.consumer import EngineSource, EngineSubscriber, KVEventConsumer
from sessionkv_proxy.index import TIER_DEVICE, TIER_HOST, MemoryIndex
from sessionkv_proxy.index.redis import RedisIndex
from vllm_sessionkv.wire.hashing import engine_block_hashes, request_keys

kv_events = pytest.importorskip("vllm.distributed.kv_events")

BLOCK = 16
GPU, CPU = TIER_DEVICE, TIER_HOST
PROMPT_A = list(range(1000, 1000 + 6 * BLOCK))
PROMPT_B = list(range(5000, 5000 + 4 * BLOCK))
PROMPT_C = list(range(9000, 9000 + 3 * BLOCK))


def engine_hashes(tokens, salt=None):
    return [int.from_bytes(h[-8:], "big")
            for h in engine_block_hashes(tokens, BLOCK, cache_salt=salt)]


def stored(tokens, first_block, num_blocks, medium="GPU", salt=None, block_size=BLOCK):
    """BlockStored for blocks [first, first+n) of ``tokens``, shaped as vLLM emits it."""
    hashes = engine_hashes(tokens, salt)
    parent = hashes[first_block - 1] if first_block else None
    extra = None
    if salt is not None and first_block == 0:
        extra = [(salt,)] + [None] * (num_blocks - 1)
    return kv_events.BlockStored(
        block_hashes=hashes[first_block:first_block + num_blocks], parent_block_hash=parent,
        token_ids=tokens[first_block * BLOCK:(first_block + num_blocks) * BLOCK],
        block_size=block_size, lora_id=None, medium=medium, lora_name=None,
        extra_keys=extra, group_idx=0)


def removed(tokens, blocks, medium="GPU"):
    hashes = engine_hashes(tokens)
    return kv_events.BlockRemoved(block_hashes=[hashes[i] for i in blocks], medium=medium,
                                  group_idx=0)


def batch(*events):
    # dp rank set up front, so the bytes a test encodes equal the published ones.
    return kv_events.KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)


async def wait_until(predicate, timeout_s=15.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class Engine:
    """A vLLM publisher on free ports; ``restart`` makes a new one on the same ports."""

    def __init__(self, free_port, buffer_steps=10_000):
        self.port, self.replay_port = free_port(), free_port()
        self.buffer_steps = buffer_steps
        self.published = 0
        self.pub = self._new()

    def _new(self):
        deadline = time.monotonic() + 5
        while True:  # a just-closed socket may hold the port for a moment
            try:
                return kv_events.ZmqEventPublisher(
                    data_parallel_rank=0, endpoint=f"tcp://*:{self.port}",
                    replay_endpoint=f"tcp://*:{self.replay_port}",
                    buffer_steps=self.buffer_steps, topic="kv@e0")
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def source(self, engine="e0"):
        return EngineSource(engine=engine, endpoint=f"tcp://127.0.0.1:{self.port}",
                            replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}",
                            topic="kv@e0")

    def publish(self, kv_batch):
        self.pub.publish(kv_batch)
        self.published += 1
        return msgspec.msgpack.encode(kv_batch)

    async def flushed(self, ctx):
        """Wait until the publisher thread has sent everything (seen via replay)."""
        async def last_seq():
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
            try:
                await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                seqs = []
                while True:
                    frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == -1:
                        return max(seqs, default=-1)
                    seqs.append(seq)
            finally:
                dealer.close(linger=0)

        await wait_until(lambda: self._at_least(last_seq, self.published - 1),
                         what="publisher flush")

    @staticmethod
    async def _at_least(fn, seq):
        return await fn() >= seq

    def restart(self):
        self.pub.shutdown()
        self.published = 0
        self.pub = self._new()

    def close(self):
        self.pub.shutdown()


@pytest.fixture
def zctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


@pytest.fixture
def engine(free_port):
    eng = Engine(free_port)
    yield eng
    eng.close()


@pytest.fixture
async def both_indexes(redis_server):
    """The two backends, side by side."""
    indexes = {"memory": MemoryIndex(),
               "redis": RedisIndex.from_url(redis_server, namespace=f"c{uuid.uuid4().hex}")}
    yield indexes
    for index in indexes.values():
        await index.close()


@pytest.fixture(params=["memory", "redis"])
async def index(request):
    if request.param == "memory":
        idx = MemoryIndex()
    else:
        url = request.getfixturevalue("redis_server")
        idx = RedisIndex.from_url(url, namespace=f"c{uuid.uuid4().hex}")
    yield idx
    await idx.close()


async def lookups(index):
    return {
        "A": await index.lookup(request_keys(PROMPT_A, BLOCK)),
        "B": await index.lookup(request_keys(PROMPT_B, BLOCK)),
        "B_salted": await index.lookup(request_keys(PROMPT_B, BLOCK, salt="t1")),
        "C": await index.lookup(request_keys(PROMPT_C, BLOCK)),
    }


async def test_late_consumer_replays_then_follows_live_on_both_backends(engine, both_indexes, zctx):
    # Published before any proxy exists: only the replay buffer can supply these.
    engine.publish(batch(stored(PROMPT_A, 0, 4)))
    engine.publish(batch(stored(PROMPT_A, 4, 2),  # continues the chain from block 3
                         stored(PROMPT_B, 0, 4, salt="t1")))
    engine.publish(batch(kv_events.BlockStored(  # host tier, announced by hash only
        block_hashes=engine_hashes(PROMPT_A)[:3], parent_block_hash=None, token_ids=[],
        block_size=BLOCK, lora_id=None, medium="CPU", lora_name=None)))
    await engine.flushed(zctx)

    consumers = {name: KVEventConsumer([engine.source()], idx)
                 for name, idx in both_indexes.items()}
    for consumer in consumers.values():
        consumer.start()
    try:
        for consumer in consumers.values():
            await wait_until(lambda c=consumer: c.stats()["e0"].last_seq == 2, what="replay")
        for name, idx in both_indexes.items():
            assert await lookups(idx) == {
                "A": {"e0": {GPU: 6, CPU: 3}}, "B": {}, "B_salted": {"e0": {GPU: 4}}, "C": {}}, name

        # Live: evict A's last block; C arrives with a parent the index never saw.
        engine.publish(batch(removed(PROMPT_A, [5]), stored(PROMPT_C, 1, 2)))
        for consumer in consumers.values():
            await wait_until(lambda c=consumer: c.stats()["e0"].last_seq == 3, what="live")
        engine.publish(batch(kv_events.AllBlocksCleared()))
        for consumer in consumers.values():
            await wait_until(lambda c=consumer: c.stats()["e0"].last_seq == 4, what="live")

        answers = {name: await lookups(idx) for name, idx in both_indexes.items()}
        assert answers["memory"] == answers["redis"] == {
            "A": {"e0": {CPU: 3}}, "B": {}, "B_salted": {}, "C": {}}
        for consumer in consumers.values():
            stats = consumer.stats()["e0"]
            assert stats.replays >= 1 and stats.batches_applied == 5
            assert stats.events_applied == 6 and stats.events_dropped == 1
            assert stats.dropped_by_reason == {"unknown_parent": 1}
            assert stats.gaps == 0 and stats.resets == 0 and stats.batches_lost == 0
            assert 0 <= stats.last_lag_s < 10 and stats.max_lag_s >= stats.last_lag_s
    finally:
        for consumer in consumers.values():
            await consumer.stop()


async def test_gap_in_live_stream_is_filled_by_replay(engine, index, zctx):
    sub = EngineSubscriber(engine.source(), index, zctx)
    engine.publish(batch(stored(PROMPT_A, 0, 2)))
    engine.publish(batch(stored(PROMPT_A, 2, 2)))
    payload = engine.publish(batch(stored(PROMPT_A, 4, 2)))
    await engine.flushed(zctx)

    # The live stream shows seq 2 first: 0 and 1 were missed.
    await sub.handle_live(2, payload)
    assert (sub.stats.gaps, sub.stats.replays, sub.stats.batches_applied) == (1, 1, 3)
    assert sub.stats.batches_duplicate == 1  # seq 2 itself came with the replay
    assert await index.lookup(request_keys(PROMPT_A, BLOCK)) == {"e0": {GPU: 6}}

    engine.publish(batch(removed(PROMPT_A, [4, 5])))
    engine.publish(batch(removed(PROMPT_A, [3])))
    payload = engine.publish(batch(stored(PROMPT_B, 0, 1)))
    await engine.flushed(zctx)
    await sub.handle_live(5, payload)  # 3 and 4 missed
    assert (sub.stats.gaps, sub.stats.replays, sub.stats.batches_applied) == (2, 2, 6)
    assert sub.stats.batches_lost == 0 and sub.stats.last_seq == 5
    assert await index.lookup(request_keys(PROMPT_A, BLOCK)) == {"e0": {GPU: 3}}
    assert await index.lookup(request_keys(PROMPT_B, BLOCK)) == {"e0": {GPU: 1}}


async def test_gap_beyond_replay_buffer_drops_and_rebuilds(free_port, index, zctx):
    engine = Engine(free_port, buffer_steps=2)
    try:
        sub = EngineSubscriber(engine.source(), index, zctx)
        await sub.handle_live(0, engine.publish(batch(stored(PROMPT_C, 0, 3))))
        engine.publish(batch(stored(PROMPT_A, 0, 2)))
        engine.publish(batch(removed(PROMPT_C, [2])))  # lost: C would stay 3 blocks
        engine.publish(batch(stored(PROMPT_B, 0, 2)))
        payload = engine.publish(batch(stored(PROMPT_B, 2, 2)))
        await engine.flushed(zctx)
        await sub.handle_live(4, payload)  # buffer now holds only 3 and 4
        assert sub.stats.batches_lost == 2 and sub.stats.gaps == 1
        # Everything from before the loss is gone, rather than partly wrong.
        assert await index.lookup(request_keys(PROMPT_C, BLOCK)) == {}
        assert await index.lookup(request_keys(PROMPT_A, BLOCK)) == {}
        assert await index.lookup(request_keys(PROMPT_B, BLOCK)) == {"e0": {GPU: 4}}
    finally:
        engine.close()


async def test_publisher_restart_drops_and_rebuilds(engine, index, zctx):
    consumer = KVEventConsumer([engine.source()], index)
    consumer.start()
    stats = consumer.stats()["e0"]
    try:
        await wait_until(lambda: stats.replays >= 1, what="start-up replay")
        for first in range(0, 6, 2):
            engine.publish(batch(stored(PROMPT_A, first, 2)))
        # The SUB may join after the first batches: replay fills in (gap or start-up).
        await wait_until(lambda: stats.last_seq == 2, what="first publisher")
        assert await index.lookup(request_keys(PROMPT_A, BLOCK)) == {"e0": {GPU: 6}}

        engine.restart()  # new process: sequence numbers start at 0 again
        for _ in range(3):  # the SUB reconnects on its own; messages before that are lost
            engine.publish(batch(stored(PROMPT_B, 0, 4)))
            try:
                await wait_until(lambda: stats.resets == 1, timeout_s=2, what="reset")
                break
            except AssertionError:
                continue
        await wait_until(lambda: stats.resets == 1, what="reset")
        await wait_until(lambda: stats.last_seq == engine.published - 1, what="rebuild")
        assert await index.lookup(request_keys(PROMPT_A, BLOCK)) == {}
        assert await index.lookup(request_keys(PROMPT_B, BLOCK)) == {"e0": {GPU: 4}}
    finally:
        await consumer.stop()


async def test_restart_seen_only_by_replay_before_is_still_a_restart(engine, index, zctx):
    # Everything of the first publisher came by replay (the SUB joined late), so no
    # live number exists to compare with: the bytes under seq 0 tell the restart.
    sub = EngineSubscriber(engine.source(), index, zctx)
    for first in range(0, 6, 2):
        engine.publish(batch(stored(PROMPT_A, first, 2)))
    await engine.flushed(zctx)
    await sub.catch_up()
    assert sub.stats.last_seq == 2 and sub.stats.resets == 0

    engine.restart()
    await sub.handle_live(0, engine.publish(batch(stored(PROMPT_B, 0, 4))))
    assert sub.stats.resets == 1 and sub.stats.last_seq == 0
    assert await index.lookup(request_keys(PROMPT_A, BLOCK)) == {}
    assert await index.lookup(request_keys(PROMPT_B, BLOCK)) == {"e0": {GPU: 4}}
    # The same bytes again (a replay overlapping the live stream) are a duplicate.
    engine.publish(batch(stored(PROMPT_C, 0, 3)))
    await engine.flushed(zctx)
    await sub.catch_up()
    assert sub.stats.resets == 1 and sub.stats.batches_duplicate == 0 and sub.stats.last_seq == 1


async def test_restart_that_passed_the_old_sequence_number_is_caught(engine, index, zctx):
    sub = EngineSubscriber(engine.source(), index, zctx)
    await sub.handle_live(0, engine.publish(batch(stored(PROMPT_A, 0, 6))))
    engine.restart()  # the SUB missed the new publisher's first batches
    engine.publish(batch(stored(PROMPT_B, 0, 2)))
    engine.publish(batch(stored(PROMPT_B, 2, 2)))
    payload = engine.publish(batch(stored(PROMPT_C, 0, 3)))
    await engine.flushed(zctx)
    await sub.handle_live(2, payload)  # looks like a gap of 1 and 2 after 0
    assert sub.stats.resets == 1 and sub.stats.batches_lost == 0 and sub.stats.last_seq == 2
    assert await index.lookup(request_keys(PROMPT_A, BLOCK)) == {}
    assert await index.lookup(request_keys(PROMPT_B, BLOCK)) == {"e0": {GPU: 4}}
    assert await index.lookup(request_keys(PROMPT_C, BLOCK)) == {"e0": {GPU: 3}}


async def test_bad_batches_and_events_are_counted(engine, index, zctx):
    sub = EngineSubscriber(engine.source(), index, zctx)
    await sub.handle_live(0, b"\xc1 not msgpack")
    assert sub.stats.batches_undecodable == 1 and sub.stats.last_seq == 0
    unknown = {"type": "BlockPinned", "block_hashes": [1]}
    good = msgspec.to_builtins(stored(PROMPT_A, 0, 1))
    await sub.handle_live(1, msgspec.msgpack.encode([time.time(), [unknown, good], 0]))
    assert sub.stats.events_undecodable == 1 and sub.stats.events_applied == 1
    await sub.handle_live(2, msgspec.msgpack.encode(batch(
        stored(PROMPT_B, 0, 2, block_size=32),  # engine runs another block size
        kv_events.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * BLOCK,
                              block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
                              group_idx=1))))  # another KV-cache group
    assert sub.stats.dropped_by_reason == {"block_size_mismatch": 1, "other_group": 1}
    assert sub.stats.gaps == 0
    assert await index.lookup(request_keys(PROMPT_A, BLOCK)) == {"e0": {GPU: 1}}
    assert await index.size() == 1
