"""Host-DRAM tier for idle session KV: slot bookkeeping and the block copies.

Two halves, one per connector role, like the rest of the connector:

* :class:`HostTierManager` (scheduler process, pure Python) decides which engine
  blocks live in which host *slot*.  Blocks are content-addressed by their engine
  block hash (``request.block_hashes[i]``), which covers every token up to and
  including the block, so a hash names the same KV on every request that shares
  the prefix.  It plans stores and loads, evicts least-recently-used blocks, pins
  blocks that a load is copying out, and records ``stored``/``removed`` events.
* :class:`HostBlockPool` (worker process, torch) holds one DRAM buffer per KV cache
  tensor, shaped like it with ``capacity_blocks`` in the block dimension, and copies
  blocks between vLLM's KV cache and those buffers.

The manager treats a planned store as resident at once.  That is sound because the
worker executes the planned copies in the order they were planned (the connector
metadata carries them as one ordered list): a load planned after a store reads what
that store wrote, and a store that reuses an evicted slot runs after every load
that read the slot earlier.  Pins cover the case where a load is not executed in
that order (deferred or asynchronous), and are released by the scheduler once the
worker has run the load.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "EVENT_REMOVED",
    "EVENT_STORED",
    "HostBlockPool",
    "HostTierManager",
    "find_block_dim",
    "unique_caches",
]

logger = logging.getLogger("vllm.sessionkv.host_tier")

EVENT_STORED = "stored"
EVENT_REMOVED = "removed"

_POLICIES = ("lru",)


class HostTierManager:
    """Which block hashes sit in which host slots; scheduler side, no torch.

    Recency: every store or load refreshes the blocks it names, *last block first*,
    so within one chain the first block is the most recent.  Eviction then takes a
    chain's tail before its head, as vLLM's own block pool does when it frees a
    request: a chain with its head evicted is useless (``lookup`` counts
    consecutive blocks from the start), a chain with its tail evicted still serves
    its prefix.
    """

    def __init__(self, capacity_bytes: int, block_bytes: int, policy: str = "lru"):
        if block_bytes <= 0:
            raise ValueError(f"host tier: block_bytes must be positive, got {block_bytes}")
        if policy not in _POLICIES:
            raise ValueError(f"host tier: unsupported eviction policy {policy!r}; "
                             f"supported: {', '.join(_POLICIES)}")
        capacity_blocks = capacity_bytes // block_bytes
        if capacity_blocks <= 0:
            raise ValueError(
                f"host tier: capacity_bytes={capacity_bytes} holds no block of "
                f"{block_bytes} bytes; raise the host tier's capacity")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.policy = policy
        # Resident blocks in recency order, least recent first.
        self._slot_by_hash: OrderedDict[Hashable, int] = OrderedDict()
        # Slot -> hash for resident slots; None for a discarded slot still pinned.
        self._hash_by_slot: dict[int, Hashable | None] = {}
        self._pin_count_by_slot: dict[int, int] = {}
        # Stack of free slots; popping from the end hands out 0, 1, 2, ... first, so
        # a fresh tier fills contiguous slots (fewer, larger copies on GPU).
        self._free_slots: list[int] = list(range(capacity_blocks - 1, -1, -1))
        self._events: list[tuple[str, list[Hashable]]] = []
        # (hash, slot) of blocks evicted since the last take_evicted, in order: the
        # disk tier spills them before their slots are reused (disk_tier.py).
        self._evicted: list[tuple[Hashable, int]] = []
        self.stores_total_blocks = 0
        self.loads_total_blocks = 0
        self.evictions_total_blocks = 0

    # -- queries -------------------------------------------------------------------

    @property
    def resident_blocks(self) -> int:
        return len(self._slot_by_hash)

    @property
    def resident_bytes(self) -> int:
        return len(self._slot_by_hash) * self.block_bytes

    @property
    def pinned_blocks(self) -> int:
        return len(self._pin_count_by_slot)

    def lookup(self, block_hashes: Sequence[Hashable], start_block: int) -> int:
        """Number of consecutive resident blocks from ``block_hashes[start_block]``.

        Side-effect free, as ``get_num_new_matched_tokens`` requires.
        """
        hit_blocks = 0
        for block_hash in block_hashes[start_block:]:
            if block_hash not in self._slot_by_hash:
                break
            hit_blocks += 1
        return hit_blocks

    # -- stores --------------------------------------------------------------------

    def plan_store(self, block_hashes: Sequence[Hashable]) -> list[tuple[Hashable, int]]:
        """Allocate slots for the blocks not yet resident; return ``(hash, slot)``
        pairs the worker must copy into, in the order given.

        Resident blocks are skipped but refreshed.  Room is made by evicting
        least-recently-used blocks that are neither pinned nor named in this call.
        When no room is left, only a prefix of the missing blocks is stored: a
        chain's later blocks are worthless without its earlier ones.
        """
        protected = set(block_hashes)
        planned: list[tuple[Hashable, int]] = []
        evicted: list[Hashable] = []
        for block_hash in block_hashes:
            if block_hash in self._slot_by_hash:
                continue
            slot = self._free_slot(protected, evicted)
            if slot is None:
                break
            self._slot_by_hash[block_hash] = slot
            self._hash_by_slot[slot] = block_hash
            planned.append((block_hash, slot))
        # One refresh over the whole chain, after allocation: new and already
        # resident blocks alike end in chain order, head most recent.
        self._touch(block_hashes)
        # Evicted blocks were stored in earlier calls; their removal precedes the
        # new stores, whose slots they may have vacated.
        if evicted:
            self._events.append((EVENT_REMOVED, evicted))
            self.evictions_total_blocks += len(evicted)
        if planned:
            self._events.append((EVENT_STORED, [h for h, _ in planned]))
            self.stores_total_blocks += len(planned)
        skipped_blocks = sum(1 for h in dict.fromkeys(block_hashes)
                             if h not in self._slot_by_hash)
        if skipped_blocks:
            logger.debug("host tier full: %d of %d blocks not stored (%d pinned of %d)",
                         skipped_blocks, len(block_hashes), self.pinned_blocks,
                         self.capacity_blocks)
        return planned

    def discard(self, block_hashes: Iterable[Hashable]) -> list[Hashable]:
        """Forget resident blocks, e.g. when their store could not run; returns
        those that were resident.  A pinned slot is reused only after its release.
        """
        removed: list[Hashable] = []
        for block_hash in block_hashes:
            slot = self._slot_by_hash.pop(block_hash, None)
            if slot is None:
                continue
            removed.append(block_hash)
            if slot in self._pin_count_by_slot:
                self._hash_by_slot[slot] = None
            else:
                del self._hash_by_slot[slot]
                self._free_slots.append(slot)
        if removed:
            self._events.append((EVENT_REMOVED, removed))
        return removed

    def discard_all(self) -> list[Hashable]:
        """Forget every resident block (a cache reset); returns them."""
        return self.discard(list(self._slot_by_hash))

    # -- loads ---------------------------------------------------------------------

    def plan_load(self, block_hashes: Sequence[Hashable], start_block: int,
                  num_blocks: int) -> list[int]:
        """Slots of ``block_hashes[start_block:start_block + num_blocks]``, in order,
        each pinned until :meth:`release`; the blocks are refreshed.

        Raises ``LookupError`` if one is not resident (ask :meth:`lookup` first, in
        the same scheduler step).
        """
        wanted = block_hashes[start_block:start_block + num_blocks]
        if len(wanted) != num_blocks:
            raise LookupError(f"host tier: load of {num_blocks} blocks from block "
                              f"{start_block} runs past the {len(block_hashes)} hashes")
        missing = [i for i, h in enumerate(wanted, start_block) if h not in self._slot_by_hash]
        if missing:
            raise LookupError(f"host tier: blocks {missing} are not resident")
        slots = [self._slot_by_hash[h] for h in wanted]
        for slot in slots:
            self._pin_count_by_slot[slot] = self._pin_count_by_slot.get(slot, 0) + 1
        self._touch(wanted)
        self.loads_total_blocks += num_blocks
        return slots

    def release(self, slots: Iterable[int]) -> None:
        """Unpin slots returned by :meth:`plan_load` (once per time returned)."""
        for slot in slots:
            count = self._pin_count_by_slot.get(slot)
            if count is None:
                raise ValueError(f"host tier: release of slot {slot}, which is not pinned")
            if count > 1:
                self._pin_count_by_slot[slot] = count - 1
                continue
            del self._pin_count_by_slot[slot]
            if slot in self._hash_by_slot and self._hash_by_slot[slot] is None:
                # Discarded while pinned: free only now that no load reads it.
                del self._hash_by_slot[slot]
                self._free_slots.append(slot)

    def pin(self, block_hashes: Sequence[Hashable]) -> list[int]:
        """Pin the slots of resident ``block_hashes`` (no load counted), e.g. while a
        disk read fills them; unpin with :meth:`release`."""
        slots = [self._slot_by_hash[h] for h in block_hashes]
        for slot in slots:
            self._pin_count_by_slot[slot] = self._pin_count_by_slot.get(slot, 0) + 1
        return slots

    def take_evicted(self) -> list[tuple[Hashable, int]]:
        """``(hash, slot)`` of the blocks evicted since the last call, in order."""
        evicted, self._evicted = self._evicted, []
        return evicted

    # -- events --------------------------------------------------------------------

    def take_events(self) -> list[tuple[str, list[Hashable]]]:
        """``("stored" | "removed", hashes)`` since the last call, in order."""
        events, self._events = self._events, []
        return events

    # -- internals -----------------------------------------------------------------

    def _touch(self, block_hashes: Sequence[Hashable]) -> None:
        for block_hash in reversed(block_hashes):
            if block_hash in self._slot_by_hash:
                self._slot_by_hash.move_to_end(block_hash)

    def _free_slot(self, protected: set[Hashable], evicted: list[Hashable]) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, slot in self._slot_by_hash.items():
            if slot in self._pin_count_by_slot or block_hash in protected:
                continue
            del self._slot_by_hash[block_hash]
            del self._hash_by_slot[slot]
            evicted.append(block_hash)
            self._evicted.append((block_hash, slot))
            return slot
        return None


def find_block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a vLLM KV cache tensor that indexes blocks.

    Attention backends lay a layer's cache out block-first (``(num_blocks, ...)``,
    the CPU backend's ``LBHNC``) or K/V-first (``(2, num_blocks, ...)``, e.g.
    FlashAttention), so the block dimension is 0 or 1.
    """
    matches = [d for d in (0, 1) if d < tensor.dim() and tensor.shape[d] == num_blocks]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ValueError(
            f"host tier: KV cache tensor of shape {tuple(tensor.shape)} has no block "
            f"dimension of size num_blocks={num_blocks} at dim 0 or 1 (a kernel block "
            "size different from the logical block size is not supported)")
    raise ValueError(
        f"host tier: KV cache tensor of shape {tuple(tensor.shape)} has size "
        f"num_blocks={num_blocks} at both dim 0 and dim 1; cannot tell which indexes blocks")


def unique_caches(kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop layers that alias another layer's exact view (KV sharing across layers):
    copying them twice would double the bytes and the buffer, and vLLM's
    ``kv_cache_tensors`` count such a tensor once."""
    unique: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for layer_name, cache in kv_caches.items():
        key = (cache.data_ptr(), tuple(cache.shape), tuple(cache.stride()), cache.dtype)
        if key in seen:
            continue
        seen.add(key)
        unique[layer_name] = cache
    return unique


class HostBlockPool:
    """Host-DRAM copies of KV blocks, one buffer per KV cache tensor; worker side.

    On CPU the copies are synchronous.  On CUDA they are issued on the current
    stream with ``non_blocking`` (pinned buffers when ``pin_memory``), so they are
    ordered with the forward passes that read or overwrite the same blocks, and
    ``store_s_total``/``load_s_total`` measure the time to issue them.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int,
                 capacity_blocks: int, pin_memory: bool = False):
        import torch

        if capacity_blocks <= 0:
            raise ValueError(f"host tier: capacity_blocks must be positive, got {capacity_blocks}")
        if not kv_caches:
            raise ValueError("host tier: no KV cache tensors to mirror")
        for layer_name, cache in kv_caches.items():
            if not isinstance(cache, torch.Tensor):
                raise ValueError(f"host tier: layer {layer_name} has a "
                                 f"{type(cache).__name__} KV cache (state-space layers "
                                 "are not supported)")
        self.num_blocks = num_blocks
        self.capacity_blocks = capacity_blocks
        self._caches = unique_caches(kv_caches)
        self._block_dim_by_layer = {name: find_block_dim(cache, num_blocks)
                                    for name, cache in self._caches.items()}
        self.device = next(iter(self._caches.values())).device
        self._on_cpu = self.device.type == "cpu"
        # Pinning needs a CUDA context, and buys nothing when the KV cache is on CPU.
        self.pin_memory = pin_memory and not self._on_cpu
        self._buffers: dict[str, torch.Tensor] = {}
        for name, cache in self._caches.items():
            shape = list(cache.shape)
            shape[self._block_dim_by_layer[name]] = capacity_blocks
            self._buffers[name] = torch.zeros(shape, dtype=cache.dtype, device="cpu",
                                              pin_memory=self.pin_memory)
        self.block_bytes = self.block_bytes_from_kv_caches(kv_caches, num_blocks)
        self.store_s_total = 0.0
        self.load_s_total = 0.0
        self.stored_total_blocks = 0
        self.loaded_total_blocks = 0
        logger.info("host tier: %d slots of %d bytes (%.1f MiB) for %d KV tensors, pinned=%s",
                    capacity_blocks, self.block_bytes,
                    capacity_blocks * self.block_bytes / 2**20, len(self._buffers),
                    self.pin_memory)

    @staticmethod
    def block_bytes_from_kv_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> int:
        """Bytes one block occupies across all KV cache tensors.

        Equals ``sum(t.size for t in kv_cache_config.kv_cache_tensors) // num_blocks``
        for one KV cache group without page padding (the dense models we serve).
        With several groups vLLM's tensors alias each other and that sum overcounts;
        with padded pages it exceeds this.  Size both halves from one
        ``capacity_blocks`` rather than from two byte counts.
        """
        total_bytes = 0
        for cache in unique_caches(kv_caches).values():
            block_dim = find_block_dim(cache, num_blocks)
            total_bytes += cache.numel() // cache.shape[block_dim] * cache.element_size()
        return total_bytes

    def store(self, src_block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy KV blocks ``src_block_ids[i]`` into host slots ``slots[i]``."""
        elapsed_s = self._copy(src_block_ids, slots, to_host=True)
        if elapsed_s is not None:
            self.store_s_total += elapsed_s
            self.stored_total_blocks += len(slots)

    def load(self, slots: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        """Copy host slots ``slots[i]`` into KV blocks ``dst_block_ids[i]``."""
        elapsed_s = self._copy(dst_block_ids, slots, to_host=False)
        if elapsed_s is not None:
            self.load_s_total += elapsed_s
            self.loaded_total_blocks += len(slots)

    def read_slot(self, slot: int) -> bytes:
        """Host slot ``slot``'s bytes, every KV tensor's in layer order (the disk
        tier's file payload)."""
        self._check([0], [slot], max(1, self.num_blocks), self.capacity_blocks)
        parts = [buffer.select(self._block_dim_by_layer[name], slot).contiguous()
                 for name, buffer in self._buffers.items()]
        return b"".join(_raw_bytes(part) for part in parts)

    def write_slot(self, slot: int, data: bytes) -> None:
        """Fill host slot ``slot`` from :meth:`read_slot`'s bytes."""
        import torch

        self._check([0], [slot], max(1, self.num_blocks), self.capacity_blocks)
        if len(data) != self.block_bytes:
            raise ValueError(f"host tier: {len(data)} bytes for a slot of {self.block_bytes}")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset = 0
        for name, buffer in self._buffers.items():
            view = buffer.select(self._block_dim_by_layer[name], slot)
            size = view.numel() * view.element_size()
            view.copy_(raw[offset:offset + size].view(view.dtype).view(view.shape))
            offset += size

    def layout(self) -> str:
        """One line naming each KV tensor's per-block shape and dtype, in order."""
        return ";".join(
            f"{name}:{tuple(buf.select(self._block_dim_by_layer[name], 0).shape)}:{buf.dtype}"
            for name, buf in self._buffers.items())

    def _copy(self, block_ids: Sequence[int], slots: Sequence[int], to_host: bool
              ) -> float | None:
        """Copy between KV blocks and host slots, pairwise; the seconds it took (None
        when there was nothing to copy)."""
        self._check(block_ids, slots, self.num_blocks, self.capacity_blocks)
        if not slots:
            return None
        start_s = time.perf_counter()
        if self._on_cpu:
            self._copy_on_cpu(block_ids, slots, to_host=to_host)
        elif to_host:
            self._store_device(block_ids, slots)
        else:
            self._load_device(slots, block_ids)
        return time.perf_counter() - start_s

    def _copy_on_cpu(self, block_ids: Sequence[int], slots: Sequence[int], to_host: bool) -> None:
        """One gather and one scatter per layer between KV blocks and host slots."""
        import torch

        blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
        host = torch.as_tensor(list(slots), dtype=torch.long)
        for name, cache in self._caches.items():
            dim = self._block_dim_by_layer[name]
            buffer = self._buffers[name]
            if to_host:
                buffer.index_copy_(dim, host, cache.index_select(dim, blocks))
            else:
                cache.index_copy_(dim, blocks, buffer.index_select(dim, host))

    def _store_device(self, src_block_ids: Sequence[int], slots: Sequence[int]) -> None:
        import torch

        src = torch.as_tensor(list(src_block_ids), dtype=torch.long, device=self.device)
        runs = _runs(slots)
        for name, cache in self._caches.items():
            dim = self._block_dim_by_layer[name]
            gathered = cache.index_select(dim, src)
            for offset, first_slot, length in runs:
                self._buffers[name].narrow(dim, first_slot, length).copy_(
                    gathered.narrow(dim, offset, length), non_blocking=self.pin_memory)

    def _load_device(self, slots: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        import torch

        runs = _runs(slots)
        for name, cache in self._caches.items():
            dim = self._block_dim_by_layer[name]
            staged = torch.cat([
                self._buffers[name].narrow(dim, first_slot, length).to(
                    self.device, non_blocking=self.pin_memory)
                for _, first_slot, length in runs], dim=dim)
            dst = torch.as_tensor(list(dst_block_ids), dtype=torch.long, device=self.device)
            cache.index_copy_(dim, dst, staged)

    @staticmethod
    def _check(block_ids: Sequence[int], slots: Sequence[int], num_blocks: int,
               capacity_blocks: int) -> None:
        if len(block_ids) != len(slots):
            raise ValueError(f"host tier: {len(block_ids)} block ids for {len(slots)} slots")
        if any(not 0 <= b < num_blocks for b in block_ids):
            raise ValueError(f"host tier: block id out of range [0, {num_blocks})")
        if any(not 0 <= s < capacity_blocks for s in slots):
            raise ValueError(f"host tier: slot out of range [0, {capacity_blocks})")


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(offset in slots, first slot, length)`` of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for offset, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((offset, slot, 1))
    return runs
