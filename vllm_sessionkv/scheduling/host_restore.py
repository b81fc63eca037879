"""The host-DRAM tier, scheduler side (``host_tier.py``, ``docs/host_tier.md``):
whether a request restores blocks from host DRAM instead of recomputing them, the
copies (restores and offloads of finished session turns) the worker runs next step,
and the slots a restore pins until the worker has run it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm_sessionkv.host_tier import HostTierManager
from vllm_sessionkv.metadata import HostCopy, HostCopyKind
from vllm_sessionkv.scheduling.counters import StatsSink, record_growth
from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.wire.hashing import full_blocks

__all__ = ["HostRestore"]

logger = logging.getLogger("vllm.sessionkv.scheduler")

_TOTALS = ("host_offloaded_blocks", "host_restored_blocks", "host_evicted_blocks")


class HostRestore:
    def __init__(self, tier: HostTierManager, block_size: int) -> None:
        self.tier = tier
        self.block_size = block_size
        # Ordered copy operations for the worker's next step, and slots pinned by
        # loads, released two metadata builds later (the worker may run a step behind).
        self._ops: list[HostCopy] = []
        self._pins: list[list[list[int]]] = [[], []]
        self._counted = (0, 0, 0)

    def decide(self, block_hashes: Sequence[Any], num_prompt_tokens: int,
               num_computed_tokens: int, pricing: Pricing,
               request_id: str = "", session_id: str | None = None
               ) -> tuple[int, tuple[int, int] | None]:
        """(tokens to restore, (start block, blocks)), or (0, None) when the host holds
        none beyond the local hit or recomputing them is no dearer.  vLLM computes at
        least the last prompt token itself."""
        start_block = num_computed_tokens // self.block_size
        usable_blocks = (num_prompt_tokens - 1) // self.block_size - start_block
        hit_blocks = min(self.tier.lookup(block_hashes, start_block), usable_blocks)
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
        """A reset: empty the tier; returns the blocks dropped."""
        dropped = len(self.tier.discard_all())
        stats.record("host_resident_bytes", self.tier.resident_bytes)
        return dropped

    def record_stats(self, stats: StatsSink) -> None:
        counted = (self.tier.stores_total_blocks, self.tier.loads_total_blocks,
                   self.tier.evictions_total_blocks)
        if counted != self._counted:
            stats.record("host_resident_bytes", self.tier.resident_bytes)
        self._counted = record_growth(stats, _TOTALS, counted, self._counted)
