"""The host-DRAM tier: slot planning (LRU, pins, events) and block copies."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_sessionkv import host_tier
from vllm_sessionkv.host_tier import HostBlockPool, HostTierManager, find_block_dim

NUM_BLOCKS = 12
NUM_LAYERS = 3
BLOCK_SIZE_TOKENS = 16
NUM_KV_HEADS = 2
HEAD_SIZE = 8


def block_first_caches(dtype=torch.bfloat16, seed=0) -> dict[str, torch.Tensor]:
    """The CPU backend's layout: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``."""
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(
                NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE_TOKENS, 2 * HEAD_SIZE,
                generator=gen).to(dtype)
            for i in range(NUM_LAYERS)}


def kv_first_caches(dtype=torch.float16, seed=1) -> dict[str, torch.Tensor]:
    """K/V split first, as FlashAttention: ``[2, num_blocks, block_size, heads, head_size]``."""
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(
                2, NUM_BLOCKS, BLOCK_SIZE_TOKENS, NUM_KV_HEADS, HEAD_SIZE,
                generator=gen).to(dtype)
            for i in range(NUM_LAYERS)}


LAYOUTS = {"block_first": (block_first_caches, 0), "kv_first": (kv_first_caches, 1)}


def block(cache: torch.Tensor, dim: int, block_id: int) -> torch.Tensor:
    return cache.select(dim, block_id)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Compare raw bytes, not values: NaN-safe and dtype-exact.
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def chain(*ids: int) -> list[bytes]:
    return [h(i) for i in ids]


def resident(manager: HostTierManager, hashes) -> set[bytes]:
    return {x for x in hashes if manager.lookup([x], 0) == 1}


# -- worker side: HostBlockPool ------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_store_load_round_trip_restores_exact_bytes_into_other_blocks(layout):
    make, dim = LAYOUTS[layout]
    caches = make()
    original = {name: c.clone() for name, c in caches.items()}
    pool = HostBlockPool(caches, num_blocks=NUM_BLOCKS, capacity_blocks=6)

    src_ids, slots, dst_ids = [3, 7, 1], [0, 5, 2], [8, 2, 4]
    pool.store(src_ids, slots)
    for cache in caches.values():  # the device blocks are reused for something else
        cache.zero_()
    pool.load(slots, dst_ids)

    untouched = set(range(NUM_BLOCKS)) - set(dst_ids)
    for name, cache in caches.items():
        for src, dst in zip(src_ids, dst_ids):
            assert same_bytes(block(cache, dim, dst), block(original[name], dim, src)), (name, dst)
        for other in untouched:
            assert not block(cache, dim, other).any(), (name, other)
    assert pool.stored_total_blocks == 3 and pool.loaded_total_blocks == 3
    assert pool.store_s_total > 0 and pool.load_s_total > 0


def test_load_of_one_slot_does_not_disturb_other_slots():
    caches = block_first_caches(dtype=torch.float32)
    original = {name: c.clone() for name, c in caches.items()}
    pool = HostBlockPool(caches, num_blocks=NUM_BLOCKS, capacity_blocks=4)
    pool.store([0, 1, 2, 3], [0, 1, 2, 3])
    pool.store([9], [2])  # overwrite slot 2 only
    pool.load([0, 1, 2, 3], [4, 5, 6, 7])
    for name, cache in caches.items():
        for src, dst in ((0, 4), (1, 5), (9, 6), (3, 7)):
            assert same_bytes(cache[dst], original[name][src])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_block_bytes_helper_equals_manual_computation(layout):
    make, _ = LAYOUTS[layout]
    caches = make()
    element_bytes = next(iter(caches.values())).element_size()
    # K and V, every head, every token of the block, in every layer.
    manual_bytes = NUM_LAYERS * 2 * NUM_KV_HEADS * BLOCK_SIZE_TOKENS * HEAD_SIZE * element_bytes
    assert HostBlockPool.block_bytes_from_kv_caches(caches, NUM_BLOCKS) == manual_bytes
    # The scheduler sizes itself from kv_cache_config: total tensor bytes / num_blocks.
    assert manual_bytes == sum(c.nbytes for c in caches.values()) // NUM_BLOCKS
    pool = HostBlockPool(caches, num_blocks=NUM_BLOCKS, capacity_blocks=5)
    assert pool.block_bytes == manual_bytes


def test_layers_sharing_one_tensor_are_counted_and_copied_once():
    caches = block_first_caches()
    first = next(iter(caches))
    shared = dict(caches, **{"model.layers.9.self_attn.attn": caches[first]})
    assert (HostBlockPool.block_bytes_from_kv_caches(shared, NUM_BLOCKS)
            == HostBlockPool.block_bytes_from_kv_caches(caches, NUM_BLOCKS))
    original = caches[first].clone()
    pool = HostBlockPool(shared, num_blocks=NUM_BLOCKS, capacity_blocks=2)
    pool.store([5], [1])
    caches[first].zero_()
    pool.load([1], [0])
    assert same_bytes(caches[first][0], original[5])


def test_find_block_dim_handles_both_layouts_and_rejects_others():
    assert find_block_dim(torch.empty(NUM_BLOCKS, 2, 4, 8), NUM_BLOCKS) == 0
    assert find_block_dim(torch.empty(2, NUM_BLOCKS, 4, 8), NUM_BLOCKS) == 1
    with pytest.raises(ValueError, match="no block dimension"):
        find_block_dim(torch.empty(2, 4, NUM_BLOCKS), NUM_BLOCKS)
    with pytest.raises(ValueError, match="both dim 0 and dim 1"):
        find_block_dim(torch.empty(2, 2, 4), 2)
    with pytest.raises(ValueError, match="no block dimension"):
        HostBlockPool({"l0": torch.empty(2, 4, 8)}, num_blocks=NUM_BLOCKS, capacity_blocks=2)


def test_pool_rejects_out_of_range_ids_and_mismatched_lengths():
    pool = HostBlockPool(block_first_caches(), num_blocks=NUM_BLOCKS, capacity_blocks=2)
    with pytest.raises(ValueError, match="slot out of range"):
        pool.store([0], [2])
    with pytest.raises(ValueError, match="block id out of range"):
        pool.load([0], [NUM_BLOCKS])
    with pytest.raises(ValueError, match="block ids for"):
        pool.store([0, 1], [0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_on_cuda_with_pinned_buffers(layout):
    make, dim = LAYOUTS[layout]
    caches = {name: c.cuda() for name, c in make().items()}
    original = {name: c.clone() for name, c in caches.items()}
    pool = HostBlockPool(caches, num_blocks=NUM_BLOCKS, capacity_blocks=8, pin_memory=True)
    src_ids, slots, dst_ids = [3, 7, 1, 0], [0, 1, 5, 2], [8, 2, 4, 11]  # runs: 0-1, 5, 2
    pool.store(src_ids, slots)
    for cache in caches.values():
        cache.zero_()
    pool.load(slots, dst_ids)
    torch.cuda.synchronize()
    for name, cache in caches.items():
        for src, dst in zip(src_ids, dst_ids):
            assert same_bytes(block(cache, dim, dst).cpu(), block(original[name], dim, src).cpu())


# -- scheduler side: HostTierManager -------------------------------------------------


def test_capacity_is_whole_blocks_and_must_hold_one():
    assert HostTierManager(capacity_bytes=1000, block_bytes=300).capacity_blocks == 3
    with pytest.raises(ValueError, match="holds no block"):
        HostTierManager(capacity_bytes=299, block_bytes=300)
    with pytest.raises(ValueError, match="unsupported eviction policy"):
        HostTierManager(capacity_bytes=1000, block_bytes=300, policy="mru")


def test_plan_store_allocates_distinct_slots_and_skips_resident_blocks():
    manager = HostTierManager(capacity_bytes=4 * 100, block_bytes=100)
    first = manager.plan_store(chain(1, 2))
    second = manager.plan_store(chain(1, 2, 3))
    assert [x for x, _ in first] == chain(1, 2)
    assert [x for x, _ in second] == chain(3)  # 1 and 2 already resident
    slots = [s for _, s in first + second]
    assert len(set(slots)) == 3 and all(0 <= s < 4 for s in slots)
    assert manager.resident_blocks == 3 and manager.resident_bytes == 300
    assert manager.stores_total_blocks == 3


def test_evicts_least_recently_used_first():
    manager = HostTierManager(capacity_bytes=3, block_bytes=1)
    for i in (1, 2, 3):
        manager.plan_store(chain(i))
    manager.release(manager.plan_load(chain(1), 0, 1))  # 1 is now the most recent
    manager.plan_store(chain(2))  # a store of a resident block refreshes it too
    manager.take_events()
    manager.plan_store(chain(4))
    manager.plan_store(chain(5))
    assert manager.take_events() == [("removed", chain(3)), ("stored", chain(4)),
                                     ("removed", chain(1)), ("stored", chain(5))]
    assert resident(manager, chain(1, 2, 3, 4, 5)) == set(chain(2, 4, 5))
    assert manager.evictions_total_blocks == 2


def test_eviction_takes_a_chains_tail_before_its_head():
    manager = HostTierManager(capacity_bytes=4, block_bytes=1)
    manager.plan_store(chain(1, 2, 3))
    manager.plan_store(chain(10))
    manager.plan_store(chain(11))
    assert resident(manager, chain(1, 2, 3)) == set(chain(1, 2))
    assert manager.lookup(chain(1, 2, 3), 0) == 2  # the prefix still serves


def test_pinned_blocks_are_never_evicted():
    manager = HostTierManager(capacity_bytes=2, block_bytes=1)
    manager.plan_store(chain(1, 2))
    slots = manager.plan_load(chain(1, 2), 0, 2)
    assert manager.plan_store(chain(3)) == []  # every slot is pinned
    assert manager.resident_blocks == 2
    manager.release(slots[:1])  # block 1 unpinned, block 2 still pinned
    stored = manager.plan_store(chain(3))
    assert stored == [(h(3), slots[0])]
    assert resident(manager, chain(1, 2, 3)) == set(chain(2, 3))


def test_pins_count_each_load():
    manager = HostTierManager(capacity_bytes=1, block_bytes=1)
    manager.plan_store(chain(1))
    first = manager.plan_load(chain(1), 0, 1)
    second = manager.plan_load(chain(1), 0, 1)
    manager.release(first)
    assert manager.plan_store(chain(2)) == []  # still pinned by the second load
    manager.release(second)
    assert manager.plan_store(chain(2)) == [(h(2), first[0])]
    with pytest.raises(ValueError, match="not pinned"):
        manager.release(second)


def test_store_that_does_not_fit_stores_a_prefix_and_keeps_its_own_blocks():
    manager = HostTierManager(capacity_bytes=3, block_bytes=1)
    manager.plan_store(chain(1))
    pinned = manager.plan_load(chain(1), 0, 1)
    manager.plan_store(chain(7))
    # Room for two more (7 is evictable, 1 is pinned); 7 is evicted, and 5 is not
    # evicted to make room for 8, because it belongs to the same store.
    planned = manager.plan_store(chain(5, 6, 8))
    assert [x for x, _ in planned] == chain(5, 6)
    assert resident(manager, chain(1, 5, 6, 7, 8)) == set(chain(1, 5, 6))
    assert manager.resident_blocks <= manager.capacity_blocks
    manager.release(pinned)


def test_lookup_counts_only_consecutive_resident_blocks_from_start():
    manager = HostTierManager(capacity_bytes=8, block_bytes=1)
    manager.plan_store(chain(1, 2))
    manager.plan_store(chain(4))
    hashes = chain(1, 2, 3, 4)
    assert manager.lookup(hashes, 0) == 2
    assert manager.lookup(hashes, 1) == 1
    assert manager.lookup(hashes, 2) == 0  # 3 missing, so 4 does not count
    assert manager.lookup(hashes, 3) == 1
    assert manager.lookup(hashes, 4) == 0
    assert manager.lookup([], 0) == 0


def test_lookup_changes_nothing():
    manager = HostTierManager(capacity_bytes=2, block_bytes=1)
    manager.plan_store(chain(1))
    manager.plan_store(chain(2))
    manager.take_events()
    assert manager.lookup(chain(1), 0) == 1  # must not refresh 1
    manager.plan_store(chain(3))
    assert manager.take_events()[0] == ("removed", chain(1))


def test_plan_load_returns_slots_in_order_and_rejects_missing_blocks():
    manager = HostTierManager(capacity_bytes=8, block_bytes=1)
    stored = dict(manager.plan_store(chain(1, 2, 3)))
    assert manager.plan_load(chain(1, 2, 3), 1, 2) == [stored[h(2)], stored[h(3)]]
    assert manager.loads_total_blocks == 2
    with pytest.raises(LookupError, match=r"blocks \[3\] are not resident"):
        manager.plan_load(chain(1, 2, 3, 4), 2, 2)
    with pytest.raises(LookupError, match="runs past"):
        manager.plan_load(chain(1, 2, 3), 2, 2)
    assert manager.pinned_blocks == 2  # failed plans pinned nothing


def test_discard_removes_blocks_and_frees_pinned_slots_only_on_release():
    manager = HostTierManager(capacity_bytes=2, block_bytes=1)
    stored = dict(manager.plan_store(chain(1, 2)))
    pinned = manager.plan_load(chain(1), 0, 1)
    manager.take_events()
    assert manager.discard(chain(1, 9)) == chain(1)
    assert manager.take_events() == [("removed", chain(1))]
    assert manager.lookup(chain(1), 0) == 0
    # Slot of 1 is still being read: 3 must take 2's slot, not 1's.
    assert manager.plan_store(chain(3)) == [(h(3), stored[h(2)])]
    manager.release(pinned)
    assert manager.plan_store(chain(4)) == [(h(4), stored[h(1)])]


def test_discard_all_empties_the_tier_and_reports_each_block_removed():
    manager = HostTierManager(capacity_bytes=4, block_bytes=1)
    manager.plan_store(chain(1, 2, 3))
    pinned = manager.plan_load(chain(1), 0, 1)
    manager.take_events()
    assert sorted(manager.discard_all()) == sorted(chain(1, 2, 3))
    assert manager.take_events() and manager.resident_blocks == 0
    assert manager.discard_all() == [] and manager.take_events() == []
    # The pinned slot is reused only after its load is released.
    assert len(manager.plan_store(chain(4, 5, 6, 7))) == 3
    manager.release(pinned)
    assert len(manager.plan_store(chain(8))) == 1


class ReferenceLRU:
    """A clean-room model of the tier's contract: a list, least recent first."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self.order: list[bytes] = []
        self.pins: dict[bytes, int] = {}

    def store(self, hashes: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        stored, evicted = [], []
        for x in hashes:
            if x in self.order or x in stored:
                continue
            if len(self.order) + len(stored) >= self.capacity_blocks:
                victim = next((v for v in self.order
                               if not self.pins.get(v) and v not in hashes), None)
                if victim is None:
                    break
                self.order.remove(victim)
                evicted.append(victim)
            stored.append(x)
        self.order.extend(stored)
        self.touch(hashes)
        return stored, evicted

    def touch(self, hashes: list[bytes]) -> None:
        for x in reversed(hashes):
            if x in self.order:
                self.order.remove(x)
                self.order.append(x)


def test_randomized_workload_matches_reference_and_never_overfills():
    rng = random.Random(20240607)
    capacity_blocks = 16
    manager = HostTierManager(capacity_bytes=capacity_blocks * 4096, block_bytes=4096)
    reference = ReferenceLRU(capacity_blocks)
    universe = [h(i) for i in range(200)]
    outstanding: list[tuple[list[bytes], list[int]]] = []  # loads not yet released

    for _ in range(3000):
        op = rng.random()
        if op < 0.55:
            start = rng.randrange(len(universe))
            hashes = universe[start:start + rng.randint(1, 8)]
            planned = manager.plan_store(hashes)
            stored, evicted = reference.store(hashes)
            assert [x for x, _ in planned] == stored
            events = manager.take_events()
            expected = ([("removed", evicted)] if evicted else []) + \
                       ([("stored", stored)] if stored else [])
            assert events == expected
        elif op < 0.8 and reference.order:
            first = rng.choice(reference.order)
            num_blocks = rng.randint(1, 4)
            hashes = [first] + rng.sample(universe, num_blocks)
            hit_blocks = manager.lookup(hashes, 0)
            assert hit_blocks == next(
                (i for i, x in enumerate(hashes) if x not in reference.order), len(hashes))
            slots = manager.plan_load(hashes, 0, hit_blocks)
            for x in hashes[:hit_blocks]:
                reference.pins[x] = reference.pins.get(x, 0) + 1
            reference.touch(hashes[:hit_blocks])
            outstanding.append((hashes[:hit_blocks], slots))
        elif outstanding:
            hashes, slots = outstanding.pop(rng.randrange(len(outstanding)))
            manager.release(slots)
            for x in hashes:
                reference.pins[x] -= 1

        # Invariants after every operation.
        assert manager.resident_blocks == len(reference.order) <= capacity_blocks
        assert manager.resident_bytes == manager.resident_blocks * 4096
        assert resident(manager, universe) == set(reference.order)
        for hashes, _ in outstanding:  # a pinned block stays resident
            assert manager.lookup(hashes, 0) == len(hashes)

    assert manager.evictions_total_blocks > 100  # the workload did overfill the tier


def test_every_removal_follows_the_blocks_store():
    rng = random.Random(7)
    manager = HostTierManager(capacity_bytes=10, block_bytes=1)
    live: set[bytes] = set()
    for _ in range(500):
        start = rng.randrange(60)
        manager.plan_store([h(i) for i in range(start, start + rng.randint(1, 5))])
        if rng.random() < 0.1:
            manager.discard([h(rng.randrange(60))])
        for kind, hashes in manager.take_events():
            if kind == "stored":
                assert live.isdisjoint(hashes)
                live.update(hashes)
            else:
                assert kind == "removed"
                assert set(hashes) <= live, "removed before stored"
                live.difference_update(hashes)
        assert resident(manager, [h(i) for i in range(70)]) == live


def test_manager_and_pool_restore_a_session_after_evictions():
    caches = block_first_caches(dtype=torch.float32)
    original = {name: c.clone() for name, c in caches.items()}
    pool = HostBlockPool(caches, num_blocks=NUM_BLOCKS, capacity_blocks=4)
    manager = HostTierManager(capacity_bytes=4 * pool.block_bytes, block_bytes=pool.block_bytes)
    assert manager.capacity_blocks == pool.capacity_blocks

    session = chain(100, 101, 102)
    planned = manager.plan_store(session)
    pool.store([0, 1, 2], [slot for _, slot in planned])  # device blocks 0..2
    other = manager.plan_store(chain(7, 8))  # evicts session's tail, block 102
    pool.store([9, 10], [slot for _, slot in other])

    hit_blocks = manager.lookup(session, 0)
    assert hit_blocks == 2
    slots = manager.plan_load(session, 0, hit_blocks)
    pool.load(slots, [5, 6])
    manager.release(slots)
    for name, cache in caches.items():
        assert same_bytes(cache[5], original[name][0])
        assert same_bytes(cache[6], original[name][1])


def test_exports():
    assert sorted(host_tier.__all__) == host_tier.__all__
    for name in host_tier.__all__:
        assert hasattr(host_tier, name)
