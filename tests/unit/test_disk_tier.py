"""The disk tier (disk_tier.py): the index's cap, eviction and start-up scan, the
block files' checks (a corrupt, truncated, renamed, missing or other-layout file is
refused and deleted, never read into a slot), and the host tier spilling to it and
restoring from it through the scheduler's plan (scheduling/host_restore.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from vllm_sessionkv import disk_tier
from vllm_sessionkv.config import CostConfig, SessionKVConfig
from vllm_sessionkv.disk_tier import DiskBlockStore, DiskTierIndex, file_bytes, layout_fingerprint
from vllm_sessionkv.host_tier import HostBlockPool, HostTierManager
from vllm_sessionkv.metadata import HostCopy, HostCopyKind
from vllm_sessionkv.scheduling.host_restore import MEDIUM_DISK, MEDIUM_HOST, HostRestore
from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.wire.cost import LinkModel

NUM_BLOCKS = 8
BLOCK_TOKENS = 4
FINGERPRINT = layout_fingerprint("tiny|layer0:(2, 4, 16)")
FAST = LinkModel(bytes_per_s=1e12, per_transfer_s=0.0)


def h(i: int) -> bytes:
    return bytes([i]) * 32


def caches(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(NUM_BLOCKS, 2, BLOCK_TOKENS, 16, generator=gen
                                     ).to(torch.bfloat16) for i in range(2)}


def block(kv: dict[str, torch.Tensor], block_id: int) -> list[torch.Tensor]:
    return [t[block_id].clone() for t in kv.values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def kv():
    return caches()


@pytest.fixture
def pool(kv):
    return HostBlockPool(kv, NUM_BLOCKS, capacity_blocks=4)


def index(tmp_path: Path, pool: HostBlockPool, blocks: int = 3) -> DiskTierIndex:
    return DiskTierIndex(str(tmp_path / "disk"), blocks * file_bytes(pool.block_bytes, 32),
                         pool.block_bytes)


def store(tmp_path: Path, pool: HostBlockPool, fingerprint: bytes = FINGERPRINT) -> DiskBlockStore:
    return DiskBlockStore(str(tmp_path / "disk"), 0, fingerprint, pool)


# ---------------------------------------------------------------- the index


def test_cap_is_whole_files_and_eviction_is_least_recently_used(tmp_path, pool):
    idx = index(tmp_path, pool, blocks=3)
    assert idx.capacity_blocks == 3
    assert idx.plan_spill([h(1), h(2), h(3)]) == ([h(1), h(2), h(3)], [])
    idx.touch([h(1)])                         # h(2) is now the least recently used
    assert idx.plan_spill([h(4)]) == ([h(4)], [h(2)])
    assert idx.plan_spill([h(1)]) == ([], [])   # present: refreshed, not rewritten
    assert idx.resident_blocks == 3 and idx.resident_bytes == 3 * idx.file_bytes
    assert idx.lookup([h(3), h(4), h(1), h(2)], 0) == 3
    assert idx.lookup([h(3), h(4), h(1), h(2)], 3) == 0
    assert idx.take_events() == [("stored", [h(1), h(2), h(3)]), ("removed", [h(2)]),
                                 ("stored", [h(4)])]
    assert idx.refused([h(4), h(9)]) == [h(4)]
    assert idx.take_events() == [("removed", [h(4)])]
    assert (idx.spilled_total_blocks, idx.evictions_total_blocks,
            idx.refused_total_blocks) == (4, 1, 2)


def test_a_spill_never_evicts_blocks_named_in_it(tmp_path, pool):
    idx = index(tmp_path, pool, blocks=2)
    assert idx.plan_spill([h(1), h(2), h(3)]) == ([h(1), h(2)], [])


def test_start_up_validates_the_directory_and_the_cap(tmp_path, pool):
    with pytest.raises(ValueError, match="absolute"):
        DiskTierIndex("relative/dir", 1 << 20, pool.block_bytes)
    with pytest.raises(ValueError, match="holds no block file"):
        DiskTierIndex(str(tmp_path / "d"), file_bytes(pool.block_bytes, 32) - 1,
                      pool.block_bytes)
    first = index(tmp_path, pool)
    with pytest.raises(ValueError, match="in use by another engine"):
        index(tmp_path, pool)
    first.close()
    index(tmp_path, pool).close()            # the lock went with the first index
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot use"):
        DiskTierIndex(str(blocker / "sub"), 1 << 20, pool.block_bytes)


def test_a_restart_indexes_the_files_left_oldest_first_within_the_cap(tmp_path, kv, pool):
    idx = index(tmp_path, pool, blocks=4)
    files = store(tmp_path, pool)
    pool.store([0, 1, 2], [0, 1, 2])
    for i, slot in ((1, 0), (2, 1), (3, 2)):
        assert files.spill(slot, h(i))
        os.utime(files.path(h(i)), (1000 + i, 1000 + i))
    rank0 = tmp_path / "disk" / "rank0"
    (rank0 / (h(7).hex() + ".kv")).write_bytes(b"short")             # wrong size
    (rank0 / (h(8).hex() + ".kv.123.tmp")).write_bytes(b"partial")   # a crashed write
    idx.close()
    again = DiskTierIndex(str(tmp_path / "disk"), 2 * idx.file_bytes, pool.block_bytes)
    assert again.lookup([h(2), h(3)], 0) == 2          # the newest two
    assert h(1) not in again and not files.path(h(1)).exists()   # over the cap: removed
    assert sorted(p.name for p in rank0.iterdir()) == sorted(
        [h(2).hex() + ".kv", h(3).hex() + ".kv"])
    # And the files still read back into the host tier, exactly.
    assert files.promote(h(3), 3)
    pool.load([3], [5])
    assert same(block(kv, 5), block(kv, 2))


# ---------------------------------------------------------------- the files


def test_a_spilled_block_reads_back_exactly(tmp_path, kv, pool):
    files = store(tmp_path, pool)
    expected = block(kv, 3)
    pool.store([3], [0])
    assert files.spill(0, h(1))
    pool.store([4], [0])                     # the slot is reused
    assert files.promote(h(1), 2)
    pool.load([2], [6])
    assert same(block(kv, 6), expected)
    assert not list(files.directory.glob("*.tmp"))


@pytest.mark.parametrize("damage", ["payload", "checksum", "truncated", "renamed",
                                    "missing", "layout"])
def test_a_damaged_or_foreign_file_is_refused_deleted_and_never_read(tmp_path, kv, pool,
                                                                       damage):
    files = store(tmp_path, pool)
    pool.store([3], [0])
    assert files.spill(0, h(1))
    path = files.path(h(1))
    data = bytearray(path.read_bytes())
    reader = files
    if damage == "payload":
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "checksum":
        data[30] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[:-10]))
    elif damage == "renamed":                # another block's file under this name
        os.replace(path, files.path(h(2)))
        path = files.path(h(2))
    elif damage == "missing":
        path.unlink()
    else:
        reader = store(tmp_path, pool, fingerprint=layout_fingerprint("another model"))
    pool.store([5], [1])
    before = pool.read_slot(1)
    target_hash = h(2) if damage == "renamed" else h(1)
    assert not reader.promote(target_hash, 1)
    assert pool.read_slot(1) == before       # the slot is untouched
    assert not path.exists()
    assert reader.refused_total_blocks == 1
    # A slot a refused read was for is never spilled under any hash until rewritten.
    assert not reader.spill(1, h(3))
    pool.store([5], [1])
    reader.stored_into([1])
    assert reader.spill(1, h(3))


# ---------------------------------------------------------------- host <-> disk plan


class Worker:
    """The worker's side of the plan: host copies and disk operations, in order."""

    def __init__(self, pool: HostBlockPool, files: DiskBlockStore) -> None:
        self.pool, self.files = pool, files
        self.promoted: set[bytes] = set()
        self.refused: set[bytes] = set()

    def run(self, ops: list[HostCopy]) -> None:
        for op in ops:
            if op.kind is HostCopyKind.STORE:
                self.pool.store(op.src, op.dst)
                self.files.stored_into(op.dst)
            elif op.kind is HostCopyKind.LOAD:
                self.pool.load(op.src, op.dst)
            elif op.kind is HostCopyKind.SPILL:
                for slot, key in zip(op.src, op.block_hashes):
                    self.files.spill(slot, key)
            elif op.kind is HostCopyKind.PROMOTE:
                for key, slot in zip(op.block_hashes, op.dst):
                    (self.promoted if self.files.promote(key, slot) else self.refused).add(key)
            else:
                for key in op.block_hashes:
                    self.files.drop(key)

    def report(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        out = frozenset(self.promoted), frozenset(self.refused)
        self.promoted, self.refused = set(), set()
        return out


def pricing(recompute_s_per_token: float = 1e-3) -> Pricing:
    return Pricing(CostConfig(recompute_s_per_token=recompute_s_per_token),
                   kv_bytes_per_token=100.0, host_link=FAST)


def tiers(tmp_path, pool, host_blocks=2, disk_blocks=8, disk_link=FAST):
    files = store(tmp_path, pool)
    host = HostRestore(HostTierManager(host_blocks * pool.block_bytes, pool.block_bytes),
                       BLOCK_TOKENS, index(tmp_path, pool, blocks=disk_blocks), disk_link)
    return host, Worker(pool, files)


def test_host_evictions_spill_to_disk_and_a_request_restores_from_it(tmp_path, kv, pool):
    host, worker = tiers(tmp_path, pool, host_blocks=2)
    chain = [h(1), h(2), h(3)]
    expected = [block(kv, b) for b in (0, 1, 2)]
    host.offload(chain[:2], [0, 1], num_tokens=8)
    worker.run(host.take_ops())
    host.offload([h(9)], [7], num_tokens=4)          # evicts h(2)'s slot (the chain's tail)
    ops = host.take_ops()
    assert [op.kind for op in ops] == [HostCopyKind.SPILL, HostCopyKind.STORE]
    assert ops[0].block_hashes == [h(2)]
    worker.run(ops)
    host.offload([h(8)], [6], num_tokens=4)          # and then h(1)
    worker.run(host.take_ops())
    events = host.take_events()
    # A block is announced on disk before its host removal (the router re-maps it).
    assert events.index((MEDIUM_DISK, "stored", [h(2)])) < \
        events.index((MEDIUM_HOST, "removed", [h(2)]))
    # The request: 13 prompt tokens, nothing local; blocks 0-1 are on disk only.
    assert host.decide(chain, 13, 0, pricing()) == (None, None)     # wait for the read
    ops = host.take_ops()
    assert ops[-1].kind is HostCopyKind.PROMOTE and ops[-1].block_hashes == [h(1), h(2)]
    assert host.decide(chain, 13, 0, pricing()) == (None, None)     # still pending
    worker.run(ops)
    host.disk_reported(*worker.report())
    tokens, plan = host.decide(chain, 13, 0, pricing())
    assert (tokens, plan) == (8, (0, 2))
    host.restore(chain, plan, [4, 5, 6])
    worker.run(host.take_ops())
    assert same(block(kv, 4), expected[0]) and same(block(kv, 5), expected[1])
    assert (MEDIUM_HOST, "stored", [h(1), h(2)]) in host.take_events()


def test_a_corrupt_file_is_refused_and_the_request_recomputes(tmp_path, kv, pool):
    host, worker = tiers(tmp_path, pool, host_blocks=1)
    chain = [h(1), h(2)]
    host.offload(chain[:1], [0], num_tokens=4)
    host.offload([h(9)], [7], num_tokens=4)          # h(1) -> disk
    worker.run(host.take_ops())
    path = worker.files.path(h(1))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    assert host.decide(chain, 9, 0, pricing()) == (None, None)
    worker.run(host.take_ops())
    promoted, refused = worker.report()
    assert refused == {h(1)} and not promoted
    host.disk_reported(promoted, refused)
    assert host.decide(chain, 9, 0, pricing()) == (0, None)         # neither tier has it
    assert h(1) not in host.disk and not path.exists()
    assert (MEDIUM_DISK, "removed", [h(1)]) in host.take_events()
    stats = Stats()
    host.record_stats(stats)
    assert stats.data["disk_refused_blocks"] == [1]
    # h(1), and h(9), which the read into the one host slot evicted in turn.
    assert stats.data["disk_spilled_blocks"] == [2]


def test_a_disk_restore_dearer_than_recompute_is_not_read(tmp_path, pool):
    slow = LinkModel(bytes_per_s=1e3, per_transfer_s=1.0)
    host, worker = tiers(tmp_path, pool, host_blocks=1, disk_link=slow)
    host.offload([h(1)], [0], num_tokens=4)
    host.offload([h(9)], [7], num_tokens=4)
    worker.run(host.take_ops())
    assert host.decide([h(1), h(2)], 9, 0, pricing()) == (0, None)
    assert host.take_ops() == []


class Stats:
    def __init__(self):
        self.data: dict[str, list] = {}

    def record(self, key, value=1):
        self.data.setdefault(key, []).append(value)


def test_config_needs_the_host_tier_and_an_absolute_directory():
    with pytest.raises(ValueError, match="needs the host tier"):
        SessionKVConfig(disk_tier_bytes=1 << 20, disk_tier_dir="/tmp/x")
    with pytest.raises(ValueError, match="absolute"):
        SessionKVConfig(host_tier_bytes=1 << 20, disk_tier_bytes=1 << 20, disk_tier_dir="x")
    SessionKVConfig(host_tier_bytes=1 << 20, disk_tier_bytes=1 << 20, disk_tier_dir="/x")


def test_exports():
    assert disk_tier.__all__ == sorted(disk_tier.__all__)
