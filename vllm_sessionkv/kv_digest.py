"""The content digest: a reader checks the bytes it read against the holder's.

Defence in depth behind the pull guard (``guard.py``, ``docs/kv_lifetimes.md``).  The
guard proves the blocks were *held* from the read's start to its end; the digest
checks that what the reader holds after the read are the bytes the holder had when
the hold began.  Anything that changed the held bytes in between (a block-manager
bug, a stray write into a held block, a read paired with the wrong blocks) is a
mismatch, and the read fails like a refuted confirm: vLLM recomputes.

One digest per block and tensor-parallel rank: a weighted sum of the block's bytes,
read as int32 words, over every KV cache tensor, wrapped modulo 2**64.  Integer
arithmetic with wrap-around is exact and order-free, so the holder and the reader
get the same value from the same bytes whatever the reduction order, on the KV
tensors' own device (no copy of the blocks to the host; only one int64 a block
comes back).  Each word has an odd weight that depends on its place, so a change of
any one word, or words moved within a block, changes the digest; it is a checksum,
not a cryptographic hash (``docs/kv_lifetimes.md`` says what it cannot catch).

The holder's worker digests a hold's blocks the step after vLLM finished the
request, and passes them to its scheduler in its ``WorkerReport``
(``metadata.py``, vLLM's worker->scheduler metadata); the guard's ledger answers a
reader's confirm with them.  The reader's worker digests the blocks its read wrote,
before it reports them received.
"""

from __future__ import annotations

import os

import torch

from vllm_sessionkv.host_tier import find_block_dim, unique_caches

__all__ = ["KVDigester", "TEST_CORRUPT_HELD_KV_ENV"]

# Test only (never in production): an engine started with this set to 1 overwrites
# the blocks of every hold it starts with noise right after it digested them, so a
# reader reads bytes other than those digested (tests/e2e/test_kv_digest_corrupted_hold.py).
TEST_CORRUPT_HELD_KV_ENV = "SESSIONKV_TEST_CORRUPT_HELD_KV"

# Blocks digested per pass: bounds the temporary copy of the selected blocks.
_CHUNK_BYTES = 32 << 20
_WEIGHT_MULT = 2654435761          # Knuth's multiplicative constant (odd)
_WEIGHT_ADD = 0x632BE5AB
_LAYER_MULT = 0x9E3779B97F4A7C15 - (1 << 64)   # as a signed int64 (odd)


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """One odd int32 weight per word of a block's row."""
    w = (torch.arange(n, dtype=torch.int64, device=device) * _WEIGHT_MULT + _WEIGHT_ADD)
    w = (w | 1) & 0xFFFFFFFF
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


class KVDigester:
    """Per-block digests of this worker's KV cache (one KV cache group)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        caches = unique_caches(kv_caches)
        # Sorted by layer name: the holder's and the reader's layers line up.
        self._layers = [(caches[name], find_block_dim(caches[name], num_blocks))
                        for name in sorted(caches)]
        self._weights: dict[tuple[int, torch.device], torch.Tensor] = {}

    def digest(self, block_ids: list[int]) -> list[int]:
        """The blocks' digests, in order."""
        if not block_ids:
            return []
        device = self._layers[0][0].device
        ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
        total = torch.zeros(len(block_ids), dtype=torch.int64, device=device)
        for layer, (cache, block_dim) in enumerate(self._layers):
            salt = (_LAYER_MULT * (layer + 1)) & ((1 << 64) - 1)
            salt = salt - (1 << 64) if salt >= 1 << 63 else salt
            row_bytes = cache.numel() // cache.shape[block_dim] * cache.element_size()
            chunk = max(1, _CHUNK_BYTES // max(row_bytes, 1))
            for start in range(0, len(block_ids), chunk):
                part = ids[start:start + chunk]
                rows = self._rows(cache, block_dim, part)
                weights = self._weight_row(rows.shape[1], device)
                sums = (rows * weights).sum(dim=1, dtype=torch.int64)
                total[start:start + chunk] += sums * salt
        return total.tolist()

    @staticmethod
    def _rows(cache: torch.Tensor, block_dim: int, ids: torch.Tensor) -> torch.Tensor:
        """The selected blocks of one tensor as int32 words, one row a block."""
        rows = cache.index_select(block_dim, ids).movedim(block_dim, 0)
        rows = rows.reshape(len(ids), -1).contiguous()
        if rows.shape[1] * rows.element_size() % 4 == 0:
            return rows.view(torch.int32)
        return rows.view(torch.uint8).to(torch.int32)

    def _weight_row(self, n: int, device: torch.device) -> torch.Tensor:
        key = (n, device)
        weights = self._weights.get(key)
        if weights is None:
            weights = self._weights[key] = _weights(n, device)
        return weights

    def corrupt(self, block_ids: list[int]) -> None:
        """Test only (``TEST_CORRUPT_HELD_KV_ENV``): overwrite the blocks with noise."""
        if not block_ids:
            return
        generator = torch.Generator(device="cpu").manual_seed(len(block_ids))
        for cache, block_dim in self._layers:
            ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
            shape = list(cache.shape)
            shape[block_dim] = len(block_ids)
            noise = torch.randn(shape, generator=generator) * 4
            cache.index_copy_(block_dim, ids, noise.to(cache.dtype).to(cache.device))

    @staticmethod
    def corrupt_for_test() -> bool:
        return os.environ.get(TEST_CORRUPT_HELD_KV_ENV) == "1"
