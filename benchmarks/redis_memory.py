"""Redis memory per indexed block, per session record and per published handle.

Writes through the project's own code into a private redis-server and reads
``INFO memory``'s ``used_memory`` before and after each step:

1. the KV index (``RedisIndex.store``, as the proxy stores an engine's KV events):
   ``--blocks`` blocks held by one engine (P), in prompts of ``--context-tokens``
   tokens (a 32-byte sha256 engine hash and a 64-bit request key each, vLLM's
   ``--prefix-caching-hash-algo sha256``), then the same request keys held by a second
   engine (D: its own engine hashes), the cost of a block two engines hold;
2. ``--sessions`` session records (``encode_record`` of the proxy's ``SessionRecord``:
   the last D, the prompt's router keys, and D's handle as a non-streamed turn stores
   it), each ``SET`` with its TTL through ``RedisIndex.put_session``;
3. as many published handles (``encode_handle`` of D's end-of-turn
   ``kv_transfer_params``: one block id per full block, the hash chain, the partial
   block's tokens), ``SET PX`` under ``RedisKeys.handle`` as the engines' publisher
   writes them.

    PYTHONPATH=.:proxy .venv/bin/python benchmarks/redis_memory.py [--quick] [--port 33100]

Writes docs/benchmarks/redis_memory.{md,json} with ``sessionkv_bench.report`` (``--quick``,
``--no-report``: print only).  The redis-server is started by PID and stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from sessionkv_bench import report
from sessionkv_proxy.index import TIER_DEVICE
from sessionkv_proxy.index.redis import RedisIndex
from sessionkv_proxy.sessions import SessionRecord, encode_record
from vllm_sessionkv.dev.launch import start_redis, stop_all, wait_redis
from vllm_sessionkv.wire.hashing import encode_chain
from vllm_sessionkv.wire.protocol import encode_handle, handle_from_params
from vllm_sessionkv.wire.redis_keys import RedisKeys

P_URL, D_URL = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
NAMESPACE = "sessionkv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=200_000,
                   help="index entries P holds (D then holds the same request keys)")
    p.add_argument("--sessions", type=int, default=20_000,
                   help="session records, and as many published handles")
    p.add_argument("--context-tokens", type=int, default=4096,
                   help="each prompt's (and session's) context in tokens")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--port", type=int, default=33100, help="the private redis-server's port")
    p.add_argument("--quick", action="store_true",
                   help="20,000 blocks and 2,000 sessions: a smoke run of a few seconds")
    p.add_argument("--no-report", action="store_true")
    return p.parse_args(argv)


async def used_memory(client: aioredis.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


def handle_params(rng: random.Random, session_id: str, blocks: int, tail: int) -> dict:
    """D's end-of-turn kv_transfer_params for a session of ``blocks`` full blocks."""
    return {
        "do_remote_decode": False, "do_remote_prefill": True,
        "remote_engine_id": "3f1c2a9e-5b7d-4c1e-9a2b-7d6e5f4c3b2a",
        "remote_block_ids": [[rng.randrange(1, 200_000) for _ in range(blocks + 1)]],
        "remote_host": "10.0.0.2", "remote_port": 5600, "tp_size": 1,
        "remote_request_id": f"cmpl-{rng.getrandbits(128):032x}-0",
        "remote_num_tokens": blocks * 32 + tail,
        "remote_blocks_expiry_time": time.time() + 120,
        "sessionkv": {
            "session_id": session_id,
            "hash_chain": encode_chain([rng.randbytes(32) for _ in range(blocks)]),
            "tail_token_ids": [rng.randrange(49_152) for _ in range(tail)],
            "block_size": 32, "hash_algo": "sha256", "num_tokens": blocks * 32 + tail,
            "expires_at_unix_s": time.time() + 120, "hold_token": rng.getrandbits(63),
            "engine_url": D_URL,
        },
    }


async def measure(args: argparse.Namespace, url: str) -> dict:
    rng = random.Random(1)
    client = aioredis.Redis.from_url(url)
    index = RedisIndex(client, namespace=NAMESPACE, max_blocks_per_slot=None)
    keys = RedisKeys(NAMESPACE)
    per_prompt = args.context_tokens // args.block_size
    tail = args.context_tokens % args.block_size or args.block_size // 2
    out: dict = {"blocks": args.blocks, "sessions": args.sessions,
                 "context_tokens": args.context_tokens, "block_size": args.block_size}

    await client.flushall()
    start = await used_memory(client)
    out["empty_used_memory_bytes"] = start
    request_keys = [rng.getrandbits(64) for _ in range(args.blocks)]
    used = []
    for engine in (P_URL, D_URL):   # the same request keys, each engine its own hashes
        for i in range(0, args.blocks, per_prompt):
            await index.store(engine, TIER_DEVICE, [(rng.randbytes(32), k)
                                                    for k in request_keys[i:i + per_prompt]])
        used.append(await used_memory(client))
    after_p, after_d = used
    assert await index.size() >= args.blocks, "the index holds fewer entries than stored"
    out["index_first_engine_bytes_per_block"] = (after_p - start) / args.blocks
    out["index_second_engine_bytes_per_block"] = (after_d - after_p) / args.blocks

    before = await used_memory(client)
    record_sizes, handle_sizes = [], []
    for i in range(args.sessions):
        session_id = f"session-{i:08d}-{rng.getrandbits(64):016x}"
        handle = handle_from_params(handle_params(rng, session_id, per_prompt, tail))
        record = encode_record(SessionRecord(
            session_id=session_id, last_decode=D_URL, handle=handle,
            prompt_keys=[rng.getrandbits(64) for _ in range(per_prompt)],
            updated_at_unix_s=time.time()))
        record_sizes.append(len(record))
        await index.put_session(session_id, record, 3600.0)
    after_sessions = await used_memory(client)
    for i in range(args.sessions):
        session_id = f"handle-{i:08d}-{rng.getrandbits(64):016x}"
        payload = encode_handle(handle_from_params(
            handle_params(rng, session_id, per_prompt, tail)))
        handle_sizes.append(len(payload))
        await client.set(keys.handle(session_id), payload, px=120_000)
    after_handles = await used_memory(client)
    out["session_record_bytes_encoded"] = sum(record_sizes) / len(record_sizes)
    out["session_record_bytes_in_redis"] = (after_sessions - before) / args.sessions
    out["handle_bytes_encoded"] = sum(handle_sizes) / len(handle_sizes)
    out["handle_bytes_in_redis"] = (after_handles - after_sessions) / args.sessions
    out["total_used_memory_bytes"] = after_handles
    await index.close()
    await client.aclose()
    return out


def render(r: dict, meta: dict) -> str:
    blocks_per_session = r["context_tokens"] // r["block_size"]
    per_session = (blocks_per_session * (r["index_first_engine_bytes_per_block"]
                                         + r["index_second_engine_bytes_per_block"])
                   + r["session_record_bytes_in_redis"] + r["handle_bytes_in_redis"])
    context = f"{r['context_tokens']:,}-token context"
    rows = [["index entry, first engine holding the block", f"{r['blocks']:,}",
             f"{r['index_first_engine_bytes_per_block']:,.0f}", None],
            ["index entry, a second engine holding the same block", f"{r['blocks']:,}",
             f"{r['index_second_engine_bytes_per_block']:,.0f}", None],
            [f"session record (with D's handle, {context})", f"{r['sessions']:,}",
             f"{r['session_record_bytes_in_redis']:,.0f}",
             f"{r['session_record_bytes_encoded']:,.0f}"],
            [f"published handle ({context})", f"{r['sessions']:,}",
             f"{r['handle_bytes_in_redis']:,.0f}", f"{r['handle_bytes_encoded']:,.0f}"]]
    lines = report.head("Redis memory per block, session record and handle", meta)
    lines += [f"{meta['redis']}, Python {meta['python']} (Redis memory does not depend on "
              "the machine). `used_memory` deltas (INFO memory) over writes made with the "
              "project's own code (`benchmarks/redis_memory.py` says which).", ""]
    lines += report.table(["what", "count", "bytes each in Redis", "encoded"], rows)
    lines += ["", f"One session at a {context} ({blocks_per_session} blocks of "
              f"{r['block_size']} tokens) held on a P and a D, with its record and a "
              f"published handle: about **{per_session / 1024:,.0f} KiB**. Redis itself "
              f"used {r['empty_used_memory_bytes'] / 2**20:.1f} MiB empty and "
              f"{r['total_used_memory_bytes'] / 2**20:.1f} MiB at the end."]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict:
    """The measurements, on a private redis-server started and stopped here."""
    logs = Path(tempfile.mkdtemp(prefix="sessionkv-redis-memory-"))
    proc = start_redis(args.port, logs)
    try:
        wait_redis(args.port)
        return asyncio.run(measure(args, f"redis://127.0.0.1:{args.port}/0"))
    finally:
        stop_all([proc])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    meta = report.meta("redis_memory.py", sys.argv[1:] if argv is None else argv, {})
    if args.quick:
        args.blocks, args.sessions = 20_000, 2_000
    result = run(args)
    version = subprocess.run(["redis-server", "--version"], capture_output=True,
                             text=True).stdout.split()[2]
    meta.update(redis=f"redis-server {version.removeprefix('v=')}",
                python=platform.python_version())
    text = render(result, meta)
    print(text)
    if not args.no_report and not args.quick:
        report.write(report.OUT_DIR, "redis_memory", {"meta": meta, "result": result}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
