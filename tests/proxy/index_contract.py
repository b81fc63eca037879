"""One test suite for every ``KVIndex`` backend.

A backend's test module subclasses ``IndexContract`` and supplies an ``index_factory``
fixture: an async callable ``make(max_blocks_per_slot=None) -> KVIndex`` whose indexes
it closes at teardown.  The randomized test replays random event streams against a
plain dict reference model.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from sessionkv_proxy.index import TIER_DEVICE, TIER_HOST, KVIndex

__all__ = ["IndexContract", "ReferenceIndex"]

GPU, CPU = TIER_DEVICE, TIER_HOST


def keys(*values: int) -> list[int]:
    return list(values)


class ReferenceIndex:
    """The specification, as plainly as possible: (engine, tier) -> {engine hash: key}."""

    def __init__(self) -> None:
        self.slots: dict[tuple[str, str], dict] = {}

    def store(self, engine, tier, blocks):
        self.slots.setdefault((engine, tier), {}).update(blocks)

    def remove(self, engine, tier, engine_hashes):
        for h in engine_hashes:
            self.slots.get((engine, tier), {}).pop(h, None)

    def clear(self, engine, tier=None):
        for slot in [s for s in self.slots if s[0] == engine and tier in (None, s[1])]:
            del self.slots[slot]

    def request_key(self, engine, engine_hash):
        for (e, _t), entries in self.slots.items():
            if e == engine and engine_hash in entries:
                return entries[engine_hash]
        return None

    def lookup(self, request_keys):
        result: dict[str, dict[str, int]] = {}
        for (engine, tier), entries in self.slots.items():
            held = set(entries.values())
            n = 0
            while n < len(request_keys) and request_keys[n] in held:
                n += 1
            if n:
                result.setdefault(engine, {})[tier] = n
        return result

    def size(self):
        return sum(len(e) for e in self.slots.values())


class IndexContract:
    """Behaviour every ``KVIndex`` backend must show."""

    @pytest.fixture
    async def index(self, index_factory) -> KVIndex:
        return await index_factory()

    @pytest.fixture
    def publish_handle(self):
        """``async (index, session_key, raw, ttl_ms)``: what an engine's connector does
        to publish a session's handle where this backend reads it; None where it
        reads none."""
        return None

    # -- lookups ----------------------------------------------------------------

    async def test_empty_index_matches_nothing(self, index):
        assert await index.lookup(keys(1, 2, 3)) == {}
        assert await index.lookup([]) == {}
        assert await index.size() == 0

    async def test_lookup_returns_longest_prefix_per_engine(self, index):
        await index.store("a", GPU, [(10, 1), (11, 2), (12, 3), (13, 4), (14, 5)])
        await index.store("b", GPU, [(20, 1), (21, 2)])
        assert await index.lookup(keys(1, 2, 3, 4, 5, 6, 7)) == {"a": {GPU: 5}, "b": {GPU: 2}}
        assert await index.lookup(keys(1, 2, 99, 4)) == {"a": {GPU: 2}, "b": {GPU: 2}}
        assert await index.lookup(keys(1)) == {"a": {GPU: 1}, "b": {GPU: 1}}
        assert await index.lookup(keys(99, 1, 2)) == {}

    async def test_blocks_after_a_hole_do_not_count(self, index):
        # b holds blocks 1.. but not block 0: no usable prefix at all.
        await index.store("a", GPU, [(1, 100), (2, 101), (3, 102)])
        await index.store("b", GPU, [(2, 101), (3, 102)])
        assert await index.lookup(keys(100, 101, 102)) == {"a": {GPU: 3}}

    async def test_tiers_are_matched_separately(self, index):
        await index.store("a", GPU, [(1, 100), (2, 101)])
        await index.store("a", CPU, [(1, 100), (2, 101), (3, 102), (4, 103)])
        assert await index.lookup(keys(100, 101, 102, 103)) == {"a": {GPU: 2, CPU: 4}}

    async def test_keys_keep_all_64_bits(self, index):
        top = 2**64 - 1
        await index.store("a", GPU, [(top, top), (top - 1, top - 1)])
        assert await index.lookup([top, top - 1]) == {"a": {GPU: 2}}
        assert await index.lookup([top, top - 2]) == {"a": {GPU: 1}}
        assert await index.request_key("a", top - 1) == top - 1

    # -- updates ----------------------------------------------------------------

    async def test_remove_affects_only_that_engine_and_tier(self, index):
        await index.store("a", GPU, [(1, 100), (2, 101), (3, 102)])
        await index.store("a", CPU, [(1, 100), (2, 101), (3, 102)])
        await index.store("b", GPU, [(1, 100), (2, 101), (3, 102)])
        await index.remove("a", GPU, [2, 999])  # 999 was never stored: ignored
        await index.remove("c", GPU, [1])  # unknown engine: ignored
        assert await index.lookup(keys(100, 101, 102)) == {
            "a": {GPU: 1, CPU: 3}, "b": {GPU: 3}}
        assert await index.size() == 8

    async def test_store_is_idempotent(self, index):
        blocks = [(1, 100), (2, 101)]
        await index.store("a", GPU, blocks)
        await index.store("a", GPU, blocks)
        assert await index.size() == 2
        await index.remove("a", GPU, [2])
        assert await index.lookup(keys(100, 101)) == {"a": {GPU: 1}}

    async def test_two_engine_hashes_for_one_key_need_two_removals(self, index):
        await index.store("a", GPU, [(1, 100), (2, 101), (3, 101)])
        await index.remove("a", GPU, [2])
        assert await index.lookup(keys(100, 101)) == {"a": {GPU: 2}}
        await index.remove("a", GPU, [3])
        assert await index.lookup(keys(100, 101)) == {"a": {GPU: 1}}

    async def test_restore_with_a_new_key_repoints_the_hash(self, index):
        await index.store("a", GPU, [(1, 100), (2, 101)])
        await index.store("a", GPU, [(2, 555)])
        assert await index.lookup(keys(100, 101)) == {"a": {GPU: 1}}
        assert await index.lookup(keys(100, 555)) == {"a": {GPU: 2}}
        assert await index.request_key("a", 2) == 555

    async def test_int_and_bytes_hashes_are_distinct(self, index):
        await index.store("a", GPU, [(1, 100), (b"\x01", 200)])
        assert await index.request_key("a", 1) == 100
        assert await index.request_key("a", b"\x01") == 200
        await index.remove("a", GPU, [b"\x01"])
        assert await index.request_key("a", 1) == 100
        assert await index.request_key("a", b"\x01") is None

    async def test_clear_one_tier_or_every_tier(self, index):
        await index.store("a", GPU, [(1, 100)])
        await index.store("a", CPU, [(1, 100)])
        await index.store("b", GPU, [(1, 100)])
        await index.clear("a", GPU)
        assert await index.lookup(keys(100)) == {"a": {CPU: 1}, "b": {GPU: 1}}
        await index.clear("a")
        assert await index.lookup(keys(100)) == {"b": {GPU: 1}}
        assert await index.size() == 1
        await index.clear("nobody")
        # A cleared engine can store again.
        await index.store("a", GPU, [(1, 100)])
        assert await index.lookup(keys(100)) == {"a": {GPU: 1}, "b": {GPU: 1}}

    async def test_request_key_is_per_engine_across_tiers(self, index):
        await index.store("a", CPU, [(7, 700)])
        assert await index.request_key("a", 7) == 700
        assert await index.request_key("b", 7) is None
        assert await index.request_key("a", 8) is None

    async def test_capacity_evicts_least_recently_stored(self, index_factory):
        index = await index_factory(max_blocks_per_slot=3)
        await index.store("a", GPU, [(1, 100), (2, 101), (3, 102)])
        await index.store("a", GPU, [(1, 100)])  # refresh: now 2 is the oldest
        await index.store("a", GPU, [(4, 103)])
        assert await index.size() == 3
        assert await index.request_key("a", 2) is None
        assert await index.lookup(keys(100)) == {"a": {GPU: 1}}
        assert await index.lookup(keys(100, 101)) == {"a": {GPU: 1}}
        # The bound is per engine and tier.
        await index.store("a", CPU, [(5, 104), (6, 105)])
        await index.store("b", GPU, [(5, 104), (6, 105)])
        assert await index.size() == 7

    # -- sessions ---------------------------------------------------------------

    async def test_sessions_store_and_expire(self, index):
        assert await index.get_session("s1") is None
        await index.put_session("s1", b"\x00handle", ttl_s=30)
        await index.put_session("s2", b"short", ttl_s=0.2)
        assert await index.get_session("s1") == b"\x00handle"
        assert await index.get_session("s2") == b"short"
        await index.put_session("s1", b"newer", ttl_s=30)
        assert await index.get_session("s1") == b"newer"
        deadline = time.monotonic() + 5
        while await index.get_session("s2") is not None:   # its 0.2 s run out
            assert time.monotonic() < deadline, "a session record outlived its ttl"
            await asyncio.sleep(0.05)
        assert await index.get_session("s1") == b"newer"

    async def test_clear_sessions_drops_every_record_and_nothing_else(self, index):
        await index.put_session("s1", b"a", ttl_s=30)
        await index.put_session("s2", b"b", ttl_s=30)
        await index.store("e", TIER_DEVICE, [(1, 100)])
        assert await index.clear_sessions() == 2
        assert await index.get_session("s1") is None and await index.get_session("s2") is None
        assert await index.lookup([100]) == {"e": {TIER_DEVICE: 1}}
        await index.put_session("s1", b"c", ttl_s=30)
        assert await index.get_session("s1") == b"c"

    # -- the routing read -------------------------------------------------------

    async def test_route_read_is_the_record_and_the_lookup_in_one(self, index):
        await index.store("a", TIER_DEVICE, [(1, 100), (2, 101), (3, 102)])
        await index.store("b", TIER_HOST, [(1, 100)])
        await index.put_session("s1", b"rec", ttl_s=30)
        prompt = keys(100, 101, 102, 103)
        read = await index.route_read("s1", prompt)
        assert read.record == b"rec" and read.handle is None and not read.handle_taken
        assert read.matches == await index.lookup(prompt) == {"a": {GPU: 3}, "b": {CPU: 1}}
        read = await index.route_read(None, prompt, take_handle=True)
        assert read.record is None and read.matches == {"a": {GPU: 3}, "b": {CPU: 1}}
        read = await index.route_read("nobody", [])
        assert read.record is None and read.matches == {}

    async def test_a_taken_handle_is_single_use_until_given_back(self, index,
                                                                  publish_handle):
        key = f"s-{uuid.uuid4().hex}"   # the session's key (protocol.session_store_key)
        if publish_handle is None:   # this backend holds no published handles
            read = await index.route_read(key, [], take_handle=True)
            assert read.handle is None and not read.handle_taken
            await index.return_handle(key, b"h1", 1000)   # a no-op
            assert (await index.route_read(key, [])).handle is None
            return
        await publish_handle(index, key, b"h1", 60_000)
        assert (await index.route_read(key, [])).handle == b"h1"   # read only
        # Of many readers at once, exactly one takes it.
        reads = await asyncio.gather(*(index.route_read(key, [], take_handle=True)
                                       for _ in range(20)))
        taken = [r for r in reads if r.handle_taken]
        assert len(taken) == 1 and taken[0].handle == b"h1"
        assert all(r.handle is None for r in reads if not r.handle_taken)
        assert 0 < taken[0].handle_ttl_ms <= 60_000
        # Given back with what was left of its time, it can be taken again.
        await index.return_handle(key, b"h1", taken[0].handle_ttl_ms)
        again = await index.route_read(key, [], take_handle=True)
        assert again.handle == b"h1" and 0 < again.handle_ttl_ms <= taken[0].handle_ttl_ms
        # A handle published meanwhile (a newer turn) is not overwritten by it.
        await publish_handle(index, key, b"h2", 60_000)
        await index.return_handle(key, b"h1", again.handle_ttl_ms)
        assert (await index.route_read(key, [])).handle == b"h2"

    # -- against the reference model -------------------------------------------

    @pytest.mark.parametrize("seed", [1, 2, 3])
    async def test_random_streams_match_reference_model(self, index, seed):
        rng = random.Random(seed)
        ref = ReferenceIndex()
        engines = ["e0", "e1", "e2"]
        tiers = [GPU, CPU]
        # Engine hashes come from a small pool so stores overlap and removals hit;
        # some share a request key, as two engine hashes for one block would.
        engine_hashes: list[int | bytes] = list(range(40)) + [bytes([i]) * 8 for i in range(10)]
        key_of = {h: rng.randrange(30) for h in engine_hashes}
        prompts = [[rng.randrange(30) for _ in range(rng.randint(1, 12))] for _ in range(20)]
        for step in range(300):
            op = rng.random()
            engine, tier = rng.choice(engines), rng.choice(tiers)
            if op < 0.55:
                blocks = [(h, key_of[h]) for h in rng.sample(engine_hashes, rng.randint(1, 8))]
                ref.store(engine, tier, blocks)
                await index.store(engine, tier, blocks)
            elif op < 0.9:
                hashes = rng.sample(engine_hashes, rng.randint(1, 6))
                ref.remove(engine, tier, hashes)
                await index.remove(engine, tier, hashes)
            else:
                clear_tier = rng.choice([None, tier])
                ref.clear(engine, clear_tier)
                await index.clear(engine, clear_tier)
            if step % 10 == 0:
                assert await index.size() == ref.size(), f"step {step}"
                for prompt in prompts:
                    assert await index.lookup(prompt) == ref.lookup(prompt), f"step {step}"
                probe = rng.choice(engine_hashes)
                for e in engines:
                    assert await index.request_key(e, probe) == ref.request_key(e, probe)
        assert await index.size() == ref.size()
