#!/usr/bin/env python3
"""Cost of the content digest per KV block (``vllm_sessionkv/kv_digest.py``), on this
machine's CPU, for the KV shapes of the models the project serves.

    python benchmarks/kv_digest_cost.py [--threads 1] [--blocks 64]

For each shape it builds KV cache tensors as vLLM's CPU backend lays them out
(block-first, bfloat16, 32-token blocks), digests ``--blocks`` blocks several times and
prints the time per block, next to the time to copy the same blocks once (about what
a read moves into the reader's cache).  The holder digests each hold's blocks once
as it begins; the reader digests the blocks each read wrote once.  Nothing here
starts an engine; an engine's own figure is ``sessionkv_kv_digest_seconds_total``
over ``sessionkv_kv_digest_blocks_total`` (``benchmarks/kv_pressure.py`` prints it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_sessionkv.kv_digest import KVDigester  # noqa: E402

# name: (layers, KV heads, head dim), from tiny_model.py and real_model.py.
SHAPES = {
    "tiny model (tests)": (2, 2, 64),
    "tiny bench model": (6, 2, 64),
    "SmolLM2-135M (sessionkv-real-model)": (30, 3, 64),
}
BLOCK_TOKENS = 32


def measure(layers: int, heads: int, head_dim: int, blocks: int, rounds: int = 5):
    num_blocks = blocks * 2 + 8
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(
        num_blocks, 2, heads, BLOCK_TOKENS, head_dim).to(torch.bfloat16) for i in range(layers)}
    digester = KVDigester(caches, num_blocks)
    ids = list(range(3, 3 + blocks))
    digester.digest(ids)                         # weights made, pages touched
    started = time.perf_counter()
    for _ in range(rounds):
        digester.digest(ids)
    digest_s = (time.perf_counter() - started) / rounds / blocks
    src = torch.tensor(ids)
    dst = torch.tensor(range(blocks + 4, 2 * blocks + 4))
    started = time.perf_counter()
    for _ in range(rounds):
        for cache in caches.values():
            cache.index_copy_(0, dst, cache.index_select(0, src))
    copy_s = (time.perf_counter() - started) / rounds / blocks
    block_bytes = sum(c[0].numel() * c.element_size() for c in caches.values())
    return block_bytes, digest_s, copy_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--blocks", type=int, default=64, help="blocks digested at a time")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.blocks} blocks "
          f"of {BLOCK_TOKENS} tokens, bfloat16")
    print("| KV shape | bytes a block | digest a block | copy a block |")
    print("|---|---|---|---|")
    for name, shape in SHAPES.items():
        block_bytes, digest_s, copy_s = measure(*shape, args.blocks)
        print(f"| {name} | {block_bytes / 1024:.0f} KiB | {digest_s * 1e6:.1f} us | "
              f"{copy_s * 1e6:.1f} us |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
