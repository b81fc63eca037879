"""Host-DRAM tier, end to end on a real engine with a deliberately small KV cache.

A session's turn is copied to host DRAM when it finishes.  Other traffic then evicts
it from the engine's KV cache; the next turn restores it from host instead of
recomputing it, and still equals the co-located baseline.  The tier's KV events
(``medium="CPU"``) reach a real ZMQ subscriber.
"""

from __future__ import annotations

import threading

import pytest
import zmq

from cluster import (
    TEST_DTYPE,
    TEST_ENGINE_ARGS,
    TEST_KV_CACHE_GB,
    TINY_KV_BYTES_PER_TOKEN,
    free_port_block,
)
from helpers import (
    assert_same,
    completion_body,
    metric_sum,
    post,
    reset_prefix_cache,
    wait_until,
)
from sessionkv_proxy.events import BlockRemoved, BlockStored, decode_batch
from vllm_sessionkv.dev.launch import EngineSpec, start_engine, stop_all, wait_healthy

pytestmark = pytest.mark.cluster

BLOCK = 32
DEVICE_BLOCKS = 64
HOST_BLOCKS = 48
BLOCK_BYTES = BLOCK * TINY_KV_BYTES_PER_TOKEN


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 990 + 20 for i in range(n)]


class EventLog:
    """A real ZMQ SUB on the engine's KV-event publisher, collecting decoded events."""

    def __init__(self, endpoint: str):
        self.events: list = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self._sock.poll(100):
                _topic, _seq, payload = self._sock.recv_multipart()
                self.events.extend(decode_batch(payload).events)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture(scope="module")
def host_engine(tiny_model, colocated_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("host-tier-logs")
    base = free_port_block(6)
    engine = EngineSpec(
        role="decode", model=tiny_model, port=base, side_channel_port=base + 1,
        kv_cache_space_gb=TEST_KV_CACHE_GB, dtype=TEST_DTYPE, extra_args=list(TEST_ENGINE_ARGS),
        kv_events_port=base + 2, num_gpu_blocks_override=DEVICE_BLOCKS, max_model_len=2000,
        sessionkv={"host_tier_bytes": HOST_BLOCKS * BLOCK_BYTES, "session_lease_s": 2.0,
                   "superseded_hold_grace_s": 1.0})
    procs = [start_engine(engine, "decode-host-tier", log_dir)]
    try:
        wait_healthy([(procs[0], engine.url)], timeout_s=400)
        events = EventLog(engine.kv_events_endpoint)
        yield engine, colocated_url, events
        events.close()
    finally:
        stop_all(procs)


def _turn(url: str, model: str, prompt: list[int], session: str, max_tokens: int = 32):
    body = completion_body(model, prompt, max_tokens=max_tokens,
                           kv_transfer_params={"sessionkv": {"session_id": session}},
                           session_id=session)
    out = post(url, "/v1/completions", body)
    return out, out.raw["kv_transfer_params"]["sessionkv"]["accounting"]


def test_an_unused_session_hold_ends_quietly_at_its_lease(host_engine):
    """A hold nobody pulls is a normal outcome: the connector releases it at the end
    of ``session_lease_s`` (2 s here), counted as ``lease_ended``, before NIXL's own
    expiry timer would count it in ``vllm:nixl_num_kv_expired_reqs`` (and log a
    warning)."""
    engine, _colocated, _events = host_engine
    url = engine.url

    def counts() -> tuple[float, float]:
        return (metric_sum(url, "sessionkv_session_holds_released_total",
                           reason="lease_ended"),
                metric_sum(url, "vllm:nixl_num_kv_expired_reqs_total"))

    wait_until(lambda: metric_sum(url, "sessionkv_session_holds") == 0, 30,
              "earlier tests' holds to end")
    released_before, expired_before = counts()
    _turn(url, engine.model, _ids(300, 200), "lease-quiet", max_tokens=4)
    wait_until(lambda: counts()[0] > released_before, 30, "the lease to end")
    # NIXL's expiry and our release are reported by the same step's output, so an
    # expiry that came first would show now.
    released, expired = counts()
    assert released == released_before + 1
    assert expired == expired_before == 0
    assert metric_sum(url, "sessionkv_session_holds") == 0


def _holds_released(url: str) -> float:
    return metric_sum(url, "sessionkv_session_holds_released_total")


def _wait_holds_ended(url: str, released_before: float, turns: int = 1) -> None:
    """Until the holds of the last ``turns`` session turns have ended (their lease,
    ``session_lease_s=2``, runs out with no next turn) and no hold pins a block."""
    wait_until(lambda: _holds_released(url) >= released_before + turns
               and metric_sum(url, "sessionkv_session_holds") == 0, 30,
               f"{turns} session hold(s) to end")


def _evict_device_cache(url: str, model: str, released_before: float) -> None:
    _wait_holds_ended(url, released_before)   # a held block cannot be evicted
    for seed in (901, 902):
        post(url, "/v1/completions", completion_body(model, _ids(seed, 1500), max_tokens=2))


def test_evicted_session_is_restored_from_host(host_engine):
    engine, colocated, events = host_engine
    model = engine.model
    prompt = _ids(1, 600)
    released_before = _holds_released(engine.url)
    first, _ = _turn(engine.url, model, prompt, "host-s1")
    _evict_device_cache(engine.url, model, released_before)

    prompt2 = prompt + first.token_ids + _ids(2, 40)
    restored_before = metric_sum(engine.url, "sessionkv_prompt_tokens_total",
                                 source="pulled_from_host")
    second, acct = _turn(engine.url, model, prompt2, "host-s1")
    assert_same(second, post(colocated, "/v1/completions",
                             completion_body(model, prompt2, max_tokens=32)), "turn 2")
    print(f"turn 2 accounting: {acct}")
    assert acct.get("pulled_from_host_tokens", 0) > 0, acct
    # The device cache lost the session (the filler prompts took it over) ...
    assert acct.get("local_hit_tokens", 0) < acct["pulled_from_host_tokens"], acct
    # ... and the engine still computed only about the new tokens.
    new_tokens = len(prompt2) - len(prompt) - len(first.token_ids) + 1
    assert acct["recomputed_tokens"] <= new_tokens + BLOCK, acct
    assert metric_sum(engine.url, "sessionkv_prompt_tokens_total",
                      source="pulled_from_host") > restored_before


def test_host_pool_stays_within_budget_and_publishes_cpu_events(host_engine):
    engine, _colocated, events = host_engine
    model = engine.model
    for i, size in enumerate((700, 900, 1100)):  # more than the host pool holds
        released_before = _holds_released(engine.url)
        _turn(engine.url, model, _ids(50 + i, size), f"host-fill-{i}", max_tokens=8)
        _wait_holds_ended(engine.url, released_before)
    # The engine's counters and its CPU-tier events arrive on their own paths: wait
    # until the events report as many removals as the counter (a removal the
    # stream lost fails here, on the timeout).
    wait_until(lambda: _cpu_events(events)[1] == metric_sum(
        engine.url, "sessionkv_host_evicted_blocks_total") > 0, 30,
        "CPU-tier removal events to match the evicted-blocks counter")
    resident = metric_sum(engine.url, "sessionkv_host_resident_bytes")
    evicted = metric_sum(engine.url, "sessionkv_host_evicted_blocks_total")
    assert 0 < resident <= HOST_BLOCKS * BLOCK_BYTES
    assert evicted > 0

    cpu_stored, cpu_removed, removed_after_store = _cpu_events(events)
    print(f"CPU-tier events: {cpu_stored} blocks stored, {cpu_removed} removed; "
          f"resident {resident:.0f} B of {HOST_BLOCKS * BLOCK_BYTES} B, evicted {evicted:.0f}")
    assert cpu_stored > 0
    assert cpu_removed == evicted
    assert removed_after_store == cpu_removed, "a removal preceded its store"


def _cpu_events(events: EventLog) -> tuple[int, int, int]:
    """CPU-tier blocks stored, removed, and removed after their store, in the stream."""
    stored, removed_after_store = set(), 0
    cpu_stored = cpu_removed = 0
    for ev in list(events.events):
        if isinstance(ev, BlockStored) and ev.medium == "CPU":
            cpu_stored += len(ev.block_hashes)
            stored.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved) and ev.medium == "CPU":
            cpu_removed += len(ev.block_hashes)
            removed_after_store += sum(h in stored for h in ev.block_hashes)
    return cpu_stored, cpu_removed, removed_after_store


async def _replay(index, events, engine: str) -> None:
    from sessionkv_proxy.block_size import BlockSize
    from sessionkv_proxy.consumer import ConsumerStats, EventApplier

    applier = EventApplier(index, engine, BlockSize(BLOCK), ConsumerStats())
    for event in events:
        await applier.apply(event)


def test_real_event_stream_gives_same_answers_in_both_index_backends(host_engine,
                                                                     tmp_path_factory):
    """The stream this engine really published in this module (device stores and
    evictions, host-tier stores and evictions, then a prefix-cache reset), replayed
    into the in-process and the Redis index: both answer every lookup the same."""
    import asyncio

    from sessionkv_proxy.events import AllBlocksCleared
    from sessionkv_proxy.index.memory import MemoryIndex
    from sessionkv_proxy.index.redis import RedisIndex
    from vllm_sessionkv.wire.hashing import request_keys
    from vllm_sessionkv.dev.launch import start_redis, wait_redis

    engine, _colocated, events = host_engine
    model = engine.model
    # Waits until the engine says its cache is empty (earlier tests' holds end at
    # their 2 s lease, or the reset drops them).
    reset_prefix_cache(engine.url)
    after_reset = _ids(77, 300)
    post(engine.url, "/v1/completions", completion_body(model, after_reset, max_tokens=2))
    wait_until(lambda: _gpu_blocks_stored_since_clear(events) >= 300 // BLOCK, 30,
               "the events of the prompt sent after the reset")
    stream = list(events.events)
    kinds = {(type(e).__name__, getattr(e, "medium", None)) for e in stream}
    assert ("BlockStored", "GPU") in kinds and ("BlockRemoved", "GPU") in kinds, kinds
    assert any(isinstance(e, AllBlocksCleared) for e in stream)

    probes = [_ids(seed, n) for seed, n in ((1, 600), (50, 700), (51, 900), (52, 1100),
                                            (901, 1500), (77, 300))]
    probe_keys = [request_keys(p, BLOCK) for p in probes]
    port = free_port_block(1)
    redis_proc = start_redis(port, tmp_path_factory.mktemp("redis-conformance"))

    async def run():
        memory = MemoryIndex()
        redis_index = RedisIndex.from_url(f"redis://127.0.0.1:{port}/0", namespace="conf")
        try:
            await _replay(memory, stream, "engine")
            await _replay(redis_index, stream, "engine")
            return ([await memory.lookup(k) for k in probe_keys],
                    [await redis_index.lookup(k) for k in probe_keys])
        finally:
            await redis_index.close()

    try:
        wait_redis(port)
        from_memory, from_redis = asyncio.run(run())
    finally:
        stop_all([redis_proc])
    print(f"lookups after replaying {len(stream)} real events: {from_memory}")
    assert from_memory == from_redis
    # Only the prompt sent after the reset is on the device tier now.
    assert from_memory[-1].get("engine", {}).get("GPU", 0) == 300 // BLOCK
    assert all(m.get("engine", {}).get("GPU", 0) == 0 for m in from_memory[:-1])


def _gpu_blocks_stored_since_clear(events: EventLog) -> int:
    """Device blocks the stream stored after its last AllBlocksCleared (0 before one)."""
    from sessionkv_proxy.events import AllBlocksCleared

    stream = list(events.events)
    cleared = [i for i, ev in enumerate(stream) if isinstance(ev, AllBlocksCleared)]
    if not cleared:
        return 0
    return sum(len(ev.block_hashes) for ev in stream[cleared[-1] + 1:]
               if isinstance(ev, BlockStored) and ev.medium == "GPU")
