#!/usr/bin/env python3
"""What each piece of a P/D engine costs per token: engine variants up at once.

    python benchmarks/overhead_variants.py                 # every variant, 4 rounds
    python benchmarks/overhead_variants.py --only "ours D" "stock NIXL D" --rounds 2

``engine_overhead.py --live`` compares our P and D with the plain engine in the
launcher's cluster; this one takes the difference apart.  It starts every variant
at once (``engine_overhead.VARIANTS`` plus a plain engine with KV events): the plain
engine, plain with KV-event publishing, vLLM's stock NixlConnector as D, ours as D
and as P, and ours as D with one piece turned back to vLLM's behaviour (the queue
spin cap, KV events).  Every model thread computes on the same core (the last one,
where stock NIXL's worker re-pins its own), so placement is no part of any
difference.  In each round every engine in turn gets closed-loop streamed
completions straight (256 prompt token ids, 64 output tokens, ``ignore_eos``,
temperature 0) for a fixed time, after a gap that lets the engine before it go
idle; the order is reversed every other round (ABBA).  Per block: vLLM's own time
per output token (the mean of ``vllm:request_time_per_output_token_seconds``) and
the client's latency p50; each as a ratio to the plain engine of the same round, the
summary the median over rounds.  Prints a table and writes
``docs/benchmarks/engine_overhead_variants.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

REPO = Path(__file__).resolve().parent.parent

from sessionkv_bench.metrics import histogram_mean, histogram_sums  # noqa: E402
from engine_overhead import VARIANTS, Variant, spec_for  # noqa: E402
from sessionkv_bench import report  # noqa: E402
from sessionkv_bench.client import completion_bodies  # noqa: E402
from overhead_live import _stream_one  # noqa: E402

from vllm_sessionkv.dev.launch import start_engine, stop_all, wait_healthy  # noqa: E402

REPORT = REPO / "docs" / "benchmarks" / "engine_overhead_variants.md"
TPOT = "vllm:request_time_per_output_token_seconds"
BASELINE = "plain"
ALL = [*VARIANTS, Variant("plain + KV events", "colocated", what="plain vLLM publishing KV events")]
DEFAULT = ("plain", "plain + KV events", "stock NIXL D", "ours D", "ours P", "D: vLLM spin",
           "D: KV events off")


async def _block(url: str, bodies: list[dict], seconds: float, concurrency: int) -> list:
    """Closed-loop streams for ``seconds``; the finished requests' samples."""
    todo = iter(bodies)
    out = []
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker():
            while time.monotonic() < deadline:
                out.append(await _stream_one(session, url, next(todo)))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def run(args) -> dict:
    variants = [v for v in ALL if v.name in args.only]
    tmp = Path(tempfile.mkdtemp(prefix="skv-variants-"))
    from vllm_sessionkv.dev.tiny_model import generate_tiny_model
    model = str(generate_tiny_model(tmp / "tiny-model"))
    core = str(args.core if args.core is not None else max(os.sched_getaffinity(0)))
    specs, procs = {}, []
    for v in variants:
        spec = spec_for(v, model, args)
        spec.extra_env["VLLM_CPU_OMP_THREADS_BIND"] = core
        specs[v.name] = spec
        procs.append(start_engine(spec, v.name.replace(" ", "_").replace(":", ""),
                                  Path(args.log_dir) if args.log_dir else tmp / "logs"))
    started = time.monotonic()
    try:
        wait_healthy([(p, specs[v.name].url) for p, v in zip(procs, variants)], timeout_s=900)
        for v in variants:   # warm-up
            asyncio.run(_block(specs[v.name].url, completion_bodies(model, 50, 256, 64, 99),
                               2.0, 1))
        names = [v.name for v in variants]
        rounds = []
        for rnd in range(args.rounds):
            order = names if rnd % 4 in (0, 3) else names[::-1]
            blocks = []
            for name in order:
                time.sleep(args.gap_s)
                url = specs[name].url
                before = histogram_sums(url)
                bodies = completion_bodies(model, 5000, 256, 64, seed=100 * rnd + names.index(name))
                samples = asyncio.run(_block(url, bodies, args.block_s, args.concurrency))
                blocks.append({"engine": name, "requests": len(samples),
                               "engine_tpot_s": histogram_mean(before, histogram_sums(url), TPOT),
                               "latency_p50_s": statistics.median(s.latency_s for s in samples),
                               "loadavg": os.getloadavg()[0]})
                b = blocks[-1]
                print(f"[round {rnd + 1}/{args.rounds}] {name:20s} tpot "
                      f"{b['engine_tpot_s'] * 1e3:.3f} ms  latency p50 "
                      f"{b['latency_p50_s'] * 1e3:.1f} ms  ({b['requests']} requests, "
                      f"load {b['loadavg']:.1f})", flush=True)
            rounds.append({"round": rnd + 1, "order": order, "blocks": blocks})
    finally:
        stop_all(procs)
    return {"variants": [{"name": v.name, "what": v.what} for v in variants], "core": core,
            "rounds": rounds, "wall_s": time.monotonic() - started}


def summary(run: dict) -> list[dict]:
    rows = []
    for v in run["variants"]:
        name = v["name"]
        per = []
        for rnd in run["rounds"]:
            by = {b["engine"]: b for b in rnd["blocks"]}
            per.append((by[name], by[BASELINE]))
        rows.append({"name": name, "what": v["what"],
                     "tpot_s": statistics.median(b["engine_tpot_s"] for b, _ in per),
                     "latency_p50_s": statistics.median(b["latency_p50_s"] for b, _ in per),
                     "tpot_x": [b["engine_tpot_s"] / p["engine_tpot_s"] for b, p in per],
                     "latency_x": [b["latency_p50_s"] / p["latency_p50_s"] for b, p in per]})
    return rows


def render(run: dict, rows: list[dict], meta: dict) -> str:
    table = ["| engine | what | TPOT ms | /plain (rounds) | latency p50 ms | /plain (rounds) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        table.append(
            f"| {r['name']} | {r['what']} | {r['tpot_s'] * 1e3:.3f} | "
            f"{statistics.median(r['tpot_x']):.2f}x ({', '.join(f'{x:.2f}' for x in r['tpot_x'])}) | "
            f"{r['latency_p50_s'] * 1e3:.1f} | {statistics.median(r['latency_x']):.2f}x "
            f"({', '.join(f'{x:.2f}' for x in r['latency_x'])}) |")
    blocks = ["| round | engine | TPOT ms | latency p50 ms | requests | load (1 min) |",
              "|---|---|---|---|---|---|"]
    for rnd in run["rounds"]:
        for b in rnd["blocks"]:
            blocks.append(f"| {rnd['round']} | {b['engine']} | {b['engine_tpot_s'] * 1e3:.3f} | "
                          f"{b['latency_p50_s'] * 1e3:.1f} | {b['requests']} | "
                          f"{b['loadavg']:.1f} |")
    return f"""# What each piece of a P/D engine costs per token

{meta['date']}, commit {meta['commit']}. Machine: {meta['machine']}.
Command: `{meta['command']}` ({run['wall_s'] / 60:.1f} min).

Every variant up at once, every model thread on core {run['core']}; in each round
every engine in turn gets closed-loop streamed completions at concurrency
{meta['concurrency']} for {meta['block_s']:g} s (256 prompt token ids, 64 output
tokens, `ignore_eos`, temperature 0) after a {meta['gap_s']:g} s gap, the order
reversed every other round (ABBA). TPOT is vLLM's own (the mean of
`vllm:request_time_per_output_token_seconds` over the block), latency p50 the
client's; ratios are to the plain engine of the same round, the summary their
median. Every round's data: [engine_overhead_variants.json](engine_overhead_variants.json).

{chr(10).join(table)}

Every block:

{chr(10).join(blocks)}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", default=list(DEFAULT),
                    help=f"variants (plain is always run): {', '.join(v.name for v in ALL)}")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block-s", type=float, default=6.0)
    ap.add_argument("--gap-s", type=float, default=1.5)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--core", type=int, default=None, help="default: the last core")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=str(REPORT), help="report path ('' to skip)")
    args = ap.parse_args(argv)
    args.gpus = None
    args.only = [BASELINE, *[n for n in args.only if n != BASELINE]]
    unknown = set(args.only) - {v.name for v in ALL}
    if unknown:
        raise SystemExit(f"unknown variants: {sorted(unknown)}")
    command = "python benchmarks/overhead_variants.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    result = run(args)
    rows = summary(result)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": report.commit(),
            "machine": f"{psutil.cpu_count()} cores, "
                       f"{psutil.virtual_memory().total / 2**30:.0f} GiB, "
                       f"{platform.system()} {platform.release()}",
            "command": command.strip(), "concurrency": args.concurrency,
            "block_s": args.block_s, "gap_s": args.gap_s}
    text = render(result, rows, meta)
    print(text)
    if args.out:
        out = Path(args.out)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps({**meta, **result, "rows": rows},
                                                       indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
