"""The shared index contract against the in-process backend."""

from __future__ import annotations

import pytest
from index_contract import IndexContract

from sessionkv_proxy.index import TIER_DEVICE, MemoryIndex


@pytest.fixture
async def index_factory():
    made: list[MemoryIndex] = []

    async def make(max_blocks_per_slot: int | None = None) -> MemoryIndex:
        index = MemoryIndex(max_blocks_per_slot=max_blocks_per_slot)
        made.append(index)
        return index

    yield make
    for index in made:
        await index.close()


class TestMemoryIndex(IndexContract):
    @pytest.fixture
    def publish_handle(self):
        # The engines' handle channel, as the proxy's subscriber keeps it.
        async def publish(index: MemoryIndex, session_key: str, raw: bytes,
                          ttl_ms: int) -> None:
            index.put_handle(session_key, raw, ttl_ms)
        return publish


async def test_published_handles_are_bounded_oldest_first_and_expire():
    now = [0.0]
    index = MemoryIndex(max_handles=2, clock=lambda: now[0])
    assert index.put_handle("a", b"ha", 10_000) == 0
    assert index.put_handle("b", b"hb", 10_000) == 0
    assert index.put_handle("a", b"ha2", 10_000) == 0   # replaced: newest wins, moves last
    assert index.put_handle("c", b"hc", 10_000) == 1    # "b" was the oldest
    assert (await index.route_read("b", [])).handle is None
    assert (await index.route_read("a", [])).handle == b"ha2"
    now[0] = 10.0                                       # the lease ran out
    read = await index.route_read("c", [], take_handle=True)
    assert read.handle is None and not read.handle_taken


async def test_slots_are_reused_after_clear():
    index = MemoryIndex()
    for round_ in range(50):
        engine = f"e{round_}"
        await index.store(engine, TIER_DEVICE, [(1, 100)])
        await index.clear(engine)
    await index.store("last", TIER_DEVICE, [(1, 100)])
    assert await index.lookup([100]) == {"last": {TIER_DEVICE: 1}}
    # One live slot: bit positions of cleared engines went back to the free list.
    assert max(index._slot_of.values()) == 0


async def test_session_expiry_follows_the_injected_clock():
    now = [1000.0]
    index = MemoryIndex(clock=lambda: now[0])
    await index.put_session("s", b"r", ttl_s=10)
    now[0] += 9.9
    assert await index.get_session("s") == b"r"
    now[0] += 0.2
    assert await index.get_session("s") is None
