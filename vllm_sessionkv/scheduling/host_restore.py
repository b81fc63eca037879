"""The host-DRAM tier, scheduler side (``host_tier.py``, ``docs/host_tier.md``):
whether a request restores blocks from host DRAM instead of recomputing them, the
copies (restores and offloads of finished session turns) the worker runs next step,
and the slots a restore pins until the worker has run it.  With a disk tier beneath
(``disk_tier.py``, ``docs/tiers.md``) it also spills the blocks the host tier evicts
to files, and reads a request's blocks back from disk into host slots first: the
request waits (``None`` to vLLM) until the worker reports the read, then restores
from host as any other."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm_sessionkv.disk_tier import DiskTierIndex
from vllm_sessionkv.host_tier import HostTierManager
from vllm_sessionkv.metadata import HostCopy, HostCopyKind
from vllm_sessionkv.scheduling.counters import StatsSink, record_growth
from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.wire.cost import LinkModel
from vllm_sessionkv.wire.hashing import full_blocks

__all__ = ["MEDIUM_DISK", "MEDIUM_HOST", "HostRestore"]

logger = logging.getLogger("vllm.sessionkv.scheduler")

_TOTALS = ("host_offloaded_blocks", "host_restored_blocks", "host_evicted_blocks")
_DISK_TOTALS = ("disk_spilled_blocks", "disk_promoted_blocks", "disk_refused_blocks",
                "disk_evicted_blocks")

# vLLM's KV event media: its CPU offloading tier's and its file tier's.
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "STORAGE"


def _key(block_hash: Any) -> bytes:
    return block_hash if isinstance(block_hash, bytes) else \
        int(block_hash).to_bytes(8, "big", signed=int(block_hash) < 0)


class HostRestore:
    def __init__(self, tier: HostTierManager, block_size: int,
                 disk: DiskTierIndex | None = None, disk_link: LinkModel | None = None
                 ) -> None:
        self.tier = tier
        self.block_size = block_size
        self.disk = disk
        self.disk_link = disk_link
        # Disk reads the worker has not reported yet: file key -> (hash, host slot).
        self._pending: dict[bytes, tuple[Any, int]] = {}
        self._events: list[tuple[str, str, list[Any]]] = []
        self._disk_counted = (0, 0, 0, 0)
        # Ordered copy operations for the worker's next step, and slots pinned by
        # loads, released two metadata builds later (the worker may run a step behind).
        self._ops: list[HostCopy] = []
        self._pins: list[list[list[int]]] = [[], []]
        self._counted = (0, 0, 0)

    def decide(self, block_hashes: Sequence[Any], num_prompt_tokens: int,
               num_computed_tokens: int, pricing: Pricing,
               request_id: str = "", session_id: str | None = None
               ) -> tuple[int | None, tuple[int, int] | None]:
        """(tokens to restore, (start block, blocks)), or (0, None) when the host holds
        none beyond the local hit or recomputing them is no dearer, or (None, None)
        while blocks of the prompt are being read from disk into host slots (asked
        again next step).  vLLM computes at least the last prompt token itself."""
        start_block = num_computed_tokens // self.block_size
        usable_blocks = (num_prompt_tokens - 1) // self.block_size - start_block
        if usable_blocks <= 0:
            return 0, None
        window = block_hashes[start_block:start_block + usable_blocks]
        if self._pending and any(_key(h) in self._pending for h in window):
            return None, None
        hit_blocks = min(self.tier.lookup(block_hashes, start_block), usable_blocks)
        if self.disk is not None and self._promote_from_disk(
                window, hit_blocks, num_computed_tokens, pricing, request_id, session_id):
            return None, None
        if hit_blocks <= 0:
            return 0, None
        tokens = hit_blocks * self.block_size
        priced = pricing.decide(tokens, num_computed_tokens, pricing.host_link)
        logger.info(
            "sessionkv host request_id=%s session_id=%s decision=%s host_tokens=%d "
            "local_hit_tokens=%d restore_s=%.6f recompute_s=%.6f", request_id, session_id,
            "restore" if priced.pull else "recompute", tokens, num_computed_tokens,
            priced.pull_s, priced.recompute_s)
        if not priced.pull:
            return 0, None
        return tokens, (start_block, hit_blocks)

    def _promote_from_disk(self, window: Sequence[Any], host_blocks: int,
                           num_computed_tokens: int, pricing: Pricing, request_id: str,
                           session_id: str | None) -> bool:
        """Plan reading the disk blocks that extend the host hit into host slots, if
        restoring them beats recomputing; True when any read was planned."""
        disk_blocks = self.disk.lookup(window, host_blocks)
        if disk_blocks <= 0:
            return False
        tokens = (host_blocks + disk_blocks) * self.block_size
        priced = pricing.decide(tokens, num_computed_tokens, self.disk_link)
        logger.info(
            "sessionkv disk request_id=%s session_id=%s decision=%s host_tokens=%d "
            "disk_tokens=%d local_hit_tokens=%d restore_s=%.6f recompute_s=%.6f",
            request_id, session_id, "promote" if priced.pull else "recompute",
            host_blocks * self.block_size, disk_blocks * self.block_size,
            num_computed_tokens, priced.pull_s, priced.recompute_s)
        if not priced.pull:
            return False
        # Name the host hit too, so that making room evicts none of it.
        pairs = self.tier.plan_store(list(window[:host_blocks + disk_blocks]))
        self._spill_evicted()
        if not pairs:
            return False
        hashes = [h for h, _ in pairs]
        slots = self.tier.pin(hashes)
        keys = [_key(h) for h in hashes]
        self._ops.append(HostCopy(kind=HostCopyKind.PROMOTE, dst=slots, block_hashes=keys))
        for key, block_hash, slot in zip(keys, hashes, slots):
            self._pending[key] = (block_hash, slot)
        self._collect_events()
        return True

    def disk_reported(self, promoted: frozenset[bytes], refused: frozenset[bytes]) -> None:
        """The worker ran these disk reads: unpin their slots; a refused block leaves
        both tiers (its file is gone, its slot holds other bytes)."""
        for key in promoted | refused:
            entry = self._pending.pop(key, None)
            if entry is None:
                continue
            block_hash, slot = entry
            self.tier.release([slot])
            if key in refused:
                self.tier.discard([block_hash])
                self.disk.refused([key])
            else:
                self.disk.promoted([key])
        self._collect_events()

    def _spill_evicted(self) -> None:
        """Spill the blocks the host tier just evicted, before their slots are reused
        (the worker runs the ops in order)."""
        evicted = self.tier.take_evicted()
        if self.disk is None or not evicted:
            return
        slot_of = {_key(h): slot for h, slot in evicted}
        write, drop = self.disk.plan_spill(list(slot_of))
        if drop:
            self._ops.append(HostCopy(kind=HostCopyKind.DROP, block_hashes=drop))
        if write:
            self._ops.append(HostCopy(kind=HostCopyKind.SPILL,
                                      src=[slot_of[k] for k in write], block_hashes=write))

    def _collect_events(self) -> None:
        """Gather both tiers' events in publishing order: a block spilled to disk is
        announced there before its host removal, so a router's index can still map
        its engine hash to the prompt (the tokenless store finds it)."""
        if self.disk is not None:
            self._events.extend((MEDIUM_DISK, kind, hashes)
                                for kind, hashes in self.disk.take_events())
        self._events.extend((MEDIUM_HOST, kind, hashes)
                            for kind, hashes in self.tier.take_events())

    def take_events(self) -> list[tuple[str, str, list[Any]]]:
        """``(medium, "stored" | "removed", hashes)`` since the last call, in order."""
        self._collect_events()
        events, self._events = self._events, []
        return events

    def restore(self, block_hashes: Sequence[Any], plan: tuple[int, int],
                block_ids: Sequence[int]) -> int:
        """Queue the restore of ``plan`` into the request's blocks (first KV cache
        group); returns the tokens restored."""
        start_block, num_blocks = plan
        slots = self.tier.plan_load(block_hashes, start_block, num_blocks)
        dst = list(block_ids[start_block:start_block + num_blocks])
        self._ops.append(HostCopy(kind=HostCopyKind.LOAD, src=list(slots), dst=dst))
        self._pins[-1].append(list(slots))
        return num_blocks * self.block_size

    def offload(self, block_hashes: Sequence[Any], block_ids: Sequence[int],
                num_tokens: int) -> bool:
        """Copy a finished session turn's full blocks (prompt and generated) to host
        DRAM.  The blocks stay held on device until the copy has run: the hold's lease
        outlives the next step, when the worker executes it; a hold demoted as it ends
        is released in the step that runs the copy, after it.  Returns whether all its
        full blocks are on host (resident or planned)."""
        n_full = min(full_blocks(num_tokens, self.block_size), len(block_hashes))
        hashes = list(block_hashes[:n_full])
        position = {h: i for i, h in enumerate(hashes)}
        pairs = self.tier.plan_store(hashes)
        self._spill_evicted()
        self._collect_events()
        if pairs:
            src = [block_ids[position[h]] for h, _ in pairs]
            self._ops.append(HostCopy(kind=HostCopyKind.STORE, src=src,
                                      dst=[slot for _, slot in pairs]))
        return n_full > 0 and self.tier.lookup(hashes, 0) == n_full

    def take_ops(self) -> list[HostCopy]:
        """This step's copies, for the worker; unpins the slots of two steps ago."""
        ops, self._ops = self._ops, []
        for slots in self._pins.pop(0):
            self.tier.release(slots)
        self._pins.append([])
        return ops

    def discard_all(self, stats: StatsSink) -> int:
        """A reset: empty the host tier (the disk tier's files stay: their content is
        checked when read); returns the blocks dropped."""
        for _, slot in self._pending.values():
            self.tier.release([slot])
        self._pending.clear()
        dropped = len(self.tier.discard_all())
        stats.record("host_resident_bytes", self.tier.resident_bytes)
        return dropped

    def record_stats(self, stats: StatsSink) -> None:
        counted = (self.tier.stores_total_blocks, self.tier.loads_total_blocks,
                   self.tier.evictions_total_blocks)
        if counted != self._counted:
            stats.record("host_resident_bytes", self.tier.resident_bytes)
        self._counted = record_growth(stats, _TOTALS, counted, self._counted)
        if self.disk is not None:
            disk = (self.disk.spilled_total_blocks, self.disk.promoted_total_blocks,
                    self.disk.refused_total_blocks, self.disk.evictions_total_blocks)
            if disk != self._disk_counted:
                stats.record("disk_resident_bytes", self.disk.resident_bytes)
            self._disk_counted = record_growth(stats, _DISK_TOTALS, disk,
                                               self._disk_counted)
