"""Routing-lookup latency of the KV index backends at 10K / 100K / 1M indexed blocks.

Each engine holds chains of ``--prompt-blocks`` request keys (a conversation's
prompt); every chain starts with a system prompt of ``--shared-blocks`` keys that all
engines hold.  A *hit* lookup asks for a stored chain's first ``--hit-blocks`` keys
plus a fresh tail (the next turn), so the walk covers ``--hit-blocks`` blocks before
it stops; a *miss* lookup shares nothing.  Lookup time is what the router waits for
per decision; hashing the prompt into request keys is timed separately.

    PYTHONPATH=.:proxy .venv/bin/python benchmarks/index_bench.py
    PYTHONPATH=.:proxy .venv/bin/python benchmarks/index_bench.py --backends memory --sizes 1000000

Without ``--redis-url`` a private redis-server is started on a free port and killed
by PID afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import uuid

from sessionkv_bench.stats import pct
from sessionkv_proxy.index import TIER_DEVICE, MemoryIndex
from sessionkv_proxy.index.redis import RedisIndex
from vllm_sessionkv.wire.hashing import request_keys


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="memory,redis")
    p.add_argument("--sizes", default="10000,100000,1000000",
                   help="indexed blocks (engine, tier, block entries), comma separated")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--prompt-blocks", type=int, default=128, help="blocks per stored chain")
    p.add_argument("--shared-blocks", type=int, default=16, help="system prompt held by all")
    p.add_argument("--hit-blocks", type=int, default=100, help="matched blocks per hit lookup")
    p.add_argument("--query-blocks", type=int, default=128, help="blocks per lookup prompt")
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--block-size-tokens", type=int, default=16)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def start_redis() -> tuple[subprocess.Popen, str, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not on PATH; pass --redis-url or install it")
    workdir = tempfile.mkdtemp(prefix="index-bench-redis-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
                             "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0", workdir
        except OSError:
            time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    raise SystemExit("redis-server did not start")


async def populate(index, total_blocks: int, args, rng: random.Random) -> list[list[int]]:
    """Store chains round-robin over engines until ``total_blocks`` entries exist."""
    shared = [rng.getrandbits(64) for _ in range(args.shared_blocks)]
    chains: list[list[int]] = []
    stored = 0
    engine_no = 0
    salts = [rng.getrandbits(64) for _ in range(args.engines)]
    holds_shared: set[int] = set()
    while stored < total_blocks:
        n = min(args.prompt_blocks, total_blocks - stored + args.shared_blocks)
        chain = (shared + [rng.getrandbits(64) for _ in range(args.prompt_blocks)])[:n]
        slot = engine_no % args.engines
        # Engine hashes are per engine and content: the shared prefix is stored once.
        await index.store(f"engine-{slot}", TIER_DEVICE,
                          [(key ^ salts[slot], key) for key in chain])
        new_blocks = n - (min(n, args.shared_blocks) if slot in holds_shared else 0)
        holds_shared.add(slot)
        chains.append(chain)
        stored += new_blocks
        engine_no += 1
    return chains


async def bench_backend(name: str, index, total_blocks: int, args) -> dict:
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    chains = await populate(index, total_blocks, args, rng)
    populate_s = time.perf_counter() - t0
    size = await index.size()
    full = [c for c in chains if len(c) >= args.hit_blocks] or chains
    hit_queries = []
    for _ in range(args.lookups):
        chain = rng.choice(full)[:args.hit_blocks]
        tail = [rng.getrandbits(64) for _ in range(args.query_blocks - len(chain))]
        hit_queries.append(chain + tail)
    miss_queries = [[rng.getrandbits(64) for _ in range(args.query_blocks)]
                    for _ in range(args.lookups)]
    # Warm up (script load, dict caches), then time one lookup at a time, as routing does.
    for q in hit_queries[:50]:
        await index.lookup(q)
    result = {"backend": name, "blocks": size, "populate_s": populate_s}
    for kind, queries in (("hit", hit_queries), ("miss", miss_queries)):
        samples = []
        matched = 0
        for q in queries:
            t = time.perf_counter()
            answer = await index.lookup(q)
            samples.append(time.perf_counter() - t)
            matched = max([matched] + [b for tiers in answer.values() for b in tiers.values()])
        result[f"{kind}_p50_us"] = pct(samples, 0.50) * 1e6
        result[f"{kind}_p99_us"] = pct(samples, 0.99) * 1e6
        result[f"{kind}_mean_us"] = statistics.fmean(samples) * 1e6
        result[f"{kind}_max_matched"] = matched
    return result


async def main() -> None:
    args = parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    backends = args.backends.split(",")
    redis_proc = None
    redis_url = args.redis_url
    if "redis" in backends and redis_url is None:
        redis_proc, redis_url, _ = start_redis()
    try:
        tokens = list(range(args.query_blocks * args.block_size_tokens))
        t = time.perf_counter()
        for _ in range(200):
            request_keys(tokens, args.block_size_tokens)
        keys_us = (time.perf_counter() - t) / 200 * 1e6
        print(f"request_keys for a {len(tokens)}-token prompt "
              f"({args.query_blocks} blocks of {args.block_size_tokens}): {keys_us:.0f} us")
        print(f"{args.engines} engines, chains of {args.prompt_blocks} blocks "
              f"({args.shared_blocks} shared), lookups of {args.query_blocks} keys, "
              f"hit = first {args.hit_blocks} held; {args.lookups} lookups each")
        header = (f"{'backend':8} {'blocks':>9} {'populate_s':>10} {'hit p50':>9} "
                  f"{'hit p99':>9} {'miss p50':>9} {'miss p99':>9}  (us)")
        print(header)
        for backend in backends:
            for total in sizes:
                if backend == "memory":
                    index = MemoryIndex(max_blocks_per_slot=None)
                else:
                    index = RedisIndex.from_url(redis_url, namespace=f"bench-{uuid.uuid4().hex}",
                                                max_blocks_per_slot=None)
                try:
                    r = await bench_backend(backend, index, total, args)
                finally:
                    if backend == "redis":
                        for engine_no in range(args.engines):
                            await index.clear(f"engine-{engine_no}")
                    await index.close()
                print(f"{r['backend']:8} {r['blocks']:>9} {r['populate_s']:>10.1f} "
                      f"{r['hit_p50_us']:>9.1f} {r['hit_p99_us']:>9.1f} "
                      f"{r['miss_p50_us']:>9.1f} {r['miss_p99_us']:>9.1f}"
                      f"   (hit matched {r['hit_max_matched']} blocks)", flush=True)
    finally:
        if redis_proc is not None:
            os.kill(redis_proc.pid, signal.SIGTERM)
            redis_proc.wait(timeout=10)


if __name__ == "__main__":
    asyncio.run(main())
