#!/usr/bin/env python3
"""What our connector costs one engine per token, against a plain vLLM engine.

    python benchmarks/engine_overhead.py            # every variant, 2 rounds (~20 min)
    python benchmarks/engine_overhead.py --quick    # plain, ours as D and as P, 1 round
    python benchmarks/engine_overhead.py --model /models/M --gpus 0   # a GPU host
    python benchmarks/engine_overhead.py --live [--layout 1p1d 2p2d] [--cores vllm]

``--live`` measures the cluster users start instead: every engine of a launcher
cluster up at once, requests interleaved across them (``overhead_live.py``; its
report is ``docs/benchmarks/engine_overhead_live.md``).  Without it:

It starts, one at a time and with the same launcher settings (``launch.engine_command``:
the same threads, reserved CPU, KV cache, block size and model), a plain vLLM engine,
an engine with vLLM's stock NixlConnector, and engines with ours: as D and as P with
the defaults, and as D with each pacing setting turned back to vLLM's behaviour one at
a time, and with KV events off.  Each engine gets the same streamed completions
(prompt token ids, ``ignore_eos``, temperature 0) straight, with no proxy, at
concurrency 1 and then 4, after a warm-up.  Round 2 runs the engines in the reverse
order, so a drift of the machine over the run falls on both sides of each ratio.

Per engine: decode time per output token and prefill time (means of vLLM's own
``vllm:request_time_per_output_token_seconds`` and ``vllm:request_prefill_time_seconds``
histograms over the phase), client-side ITL and latency p50/p99, the CPU the engine's
processes used idle (no requests, nothing held) and busy (during the c=4 phase), and
the CPU cores its processes' threads may run on.  Every figure is also a ratio to the
plain engine of the same run.  Prints a table and writes
``docs/benchmarks/engine_overhead.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

REPO = Path(__file__).resolve().parent.parent

from sessionkv_bench.metrics import histogram_mean, histogram_sums  # noqa: E402
from sessionkv_bench import report  # noqa: E402
from sessionkv_bench.client import closed_loop, completion_bodies, sse_chunks  # noqa: E402
from sessionkv_bench.stats import pct  # noqa: E402

from vllm_sessionkv.dev.launch import (  # noqa: E402
    EngineSpec,
    cpu_seconds,
    engine_command,
    free_port,
    process_tree,
    start_engine,
    stop_all,
    wait_healthy,
)

REPORT = REPO / "docs" / "benchmarks" / "engine_overhead.md"
# Launcher environment keys that decide threads and cores, stated in the report.
THREAD_ENV = ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
              "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Variant:
    name: str
    role: str                       # colocated (plain), decode (D) or prefill (P)
    connector: str = "sessionkv"    # sessionkv (ours) or nixl (stock NixlConnector)
    sessionkv: dict = field(default_factory=dict)
    kv_events: bool = True
    what: str = ""


VARIANTS = [
    Variant("plain", "colocated", kv_events=False, what="plain vLLM, no connector"),
    Variant("ours D", "decode", what="our connector as D, defaults"),
    Variant("ours P", "prefill", what="our connector as P, defaults"),
    Variant("stock NIXL D", "decode", connector="nixl", kv_events=False,
            what="vLLM's NixlConnector as D (progress thread off on CPU)"),
    Variant("D: busy-spin capped", "decode", sessionkv={"engine_spin_while_busy": False},
            what="the 2 ms spin cap on every step, busy or not (before this fix)"),
    Variant("D: vLLM spin", "decode", sessionkv={"engine_busy_poll_s": 1.0},
            what="engine_busy_poll_s 1.0: vLLM's 1 s spin, idle too"),
    Variant("D: holding steps vLLM", "decode", sessionkv={"holding_step_interval_s": 0.0},
            what="holding_step_interval_s 0: vLLM's back-to-back holding steps"),
    Variant("D: idle-step wait off", "decode", sessionkv={"idle_step_recv_wait_s": 0.0},
            what="idle_step_recv_wait_s 0"),
    Variant("D: KV events off", "decode", kv_events=False, what="no --kv-events-config"),
]
QUICK = ("plain", "ours D", "ours P")
# The engines the must-show holds for, and its bound.
JUDGED = ("ours D", "ours P")
BOUND = 1.15


# ---------------------------------------------------------------- client

@dataclass
class Sample:
    latency_s: float
    itl_s: list[float]
    chunks: int


async def _one(session: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    started = time.perf_counter()
    stamps: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for chunk in sse_chunks(resp):
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                stamps.append(time.perf_counter())
    return Sample(time.perf_counter() - started,
                  [b - a for a, b in zip(stamps, stamps[1:])], len(stamps))


# ---------------------------------------------------------------- engine side

def thread_cores(procs: list[psutil.Process]) -> str:
    """Each process's threads' allowed cores, e.g. ``api:0-1 EngineCore:0-1
    Worker:0 (1 thread on 1)``: what the engine computes on."""
    parts = []
    for p in procs:
        try:
            name = p.name().replace("VLLM::", "")
            by_cores: dict[str, int] = {}
            for t in p.threads():
                cores = os.sched_getaffinity(t.id)
                key = ",".join(str(c) for c in sorted(cores))
                by_cores[key] = by_cores.get(key, 0) + 1
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            continue
        main = max(by_cores, key=by_cores.get) if by_cores else "?"
        odd = [f"{n} thread{'s' * (n > 1)} on {k}" for k, n in by_cores.items() if k != main]
        parts.append(f"{name}:{main}" + (f" ({', '.join(odd)})" if odd else ""))
    return " ".join(parts)


def model_thread_cores(procs: list[psutil.Process]) -> str:
    """The cores of the thread that runs the forward pass: the worker process's main
    thread (NIXL's worker re-pins exactly that one), or the engine core's."""
    for p in reversed(procs):  # workers are the deepest children
        try:
            if "Worker" in p.name() or p.name().startswith("VLLM::Engine"):
                return ",".join(str(c) for c in sorted(os.sched_getaffinity(p.pid)))
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return "?"


def spec_for(variant: Variant, model: str, args) -> EngineSpec:
    port = free_port()
    spec = EngineSpec(role=variant.role, model=model, port=port,
                      side_channel_port=free_port() if variant.role != "colocated" else None,
                      kv_events_port=free_port() if variant.kv_events else None,
                      connector=variant.connector, sessionkv=dict(variant.sessionkv),
                      max_model_len=args.max_model_len,
                      kv_cache_space_gb=args.kv_cache_gb)
    if args.gpus is not None:
        spec.gpus = args.gpus
    return spec


def measure_engine(variant: Variant, model: str, args, log_dir: Path,
                   bodies: dict[int, list[dict]], warm: list[dict]) -> dict:
    spec = spec_for(variant, model, args)
    proc = start_engine(spec, variant.name.replace(" ", "_").replace(":", ""), log_dir)
    try:
        wait_healthy([(proc, spec.url)], timeout_s=600)
        asyncio.run(closed_loop(_one, spec.url, warm, 2))
        procs = process_tree([proc.pid])
        # Idle: nothing running and nothing held (no request of ours holds a lease).
        time.sleep(args.settle_s)
        c0, t0 = cpu_seconds(procs), time.monotonic()
        time.sleep(args.idle_s)
        idle_share = (cpu_seconds(procs) - c0) / (time.monotonic() - t0)
        out = {"name": variant.name, "what": variant.what, "idle_cpu": idle_share,
               "cores": thread_cores(procs), "model_thread_cores": model_thread_cores(procs)}
        for conc, phase_bodies in bodies.items():
            before = histogram_sums(spec.url)
            c0, t0 = cpu_seconds(procs), time.monotonic()
            samples = asyncio.run(closed_loop(_one, spec.url, phase_bodies, conc))
            busy = (cpu_seconds(procs) - c0) / (time.monotonic() - t0)
            after = histogram_sums(spec.url)
            itl = [x for s in samples for x in s.itl_s]
            lat = [s.latency_s for s in samples]
            out[f"c{conc}"] = {
                "tpot_s": histogram_mean(before, after,
                                         "vllm:request_time_per_output_token_seconds"),
                "prefill_s": histogram_mean(before, after, "vllm:request_prefill_time_seconds"),
                "itl_p50_s": pct(itl, 0.50), "itl_p99_s": pct(itl, 0.99),
                "latency_p50_s": pct(lat, 0.50), "latency_p99_s": pct(lat, 0.99),
                "busy_cpu": busy, "requests": len(samples),
                "chunks": sum(s.chunks for s in samples),
            }
        return out
    finally:
        stop_all([proc])


# ---------------------------------------------------------------- report

METRICS = ("tpot_s", "latency_p50_s", "latency_p99_s", "itl_p50_s", "itl_p99_s", "prefill_s",
           "busy_cpu")


def median_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: list[list[dict]], concurrencies: list[int]) -> list[dict]:
    """One row per engine: medians over rounds, and ratios to plain's medians."""
    names = [r["name"] for r in runs[0]]
    by_name = {n: [r for rnd in runs for r in rnd if r["name"] == n] for n in names}
    rows = []
    for name in names:
        got = by_name[name]
        row = {"name": name, "what": got[0]["what"],
               "idle_cpu": median_or_none([g["idle_cpu"] for g in got]),
               "model_thread_cores": got[-1]["model_thread_cores"],
               "cores": got[-1]["cores"]}
        for c in concurrencies:
            for m in METRICS:
                row[f"c{c}.{m}"] = median_or_none([g[f"c{c}"][m] for g in got])
        rows.append(row)
    plain = next(r for r in rows if r["name"] == "plain")
    for row in rows:
        for key, value in list(row.items()):
            if "." in key and value is not None and plain.get(key):
                row[key + "/plain"] = value / plain[key]
    return rows


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _share(x) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def render_table(rows: list[dict], concurrencies: list[int]) -> str:
    head = ["engine"]
    for c in concurrencies:
        head += [f"c{c} TPOT ms", "/plain", f"c{c} lat p50 ms", "/plain", "lat p99 ms",
                 "ITL p50/p99 ms", "prefill ms"]
    head += ["idle CPU", "busy CPU (c4)", "model thread cores"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    last = concurrencies[-1]
    for r in rows:
        cells = [r["name"]]
        for c in concurrencies:
            p = f"c{c}."
            cells += [_ms(r[p + "tpot_s"]), _x(r.get(p + "tpot_s/plain")),
                      _ms(r[p + "latency_p50_s"]), _x(r.get(p + "latency_p50_s/plain")),
                      _ms(r[p + "latency_p99_s"]),
                      f"{_ms(r[p + 'itl_p50_s'])}/{_ms(r[p + 'itl_p99_s'])}",
                      _ms(r[p + "prefill_s"])]
        cells += [_share(r["idle_cpu"]), _share(r[f"c{last}.busy_cpu"]), r["model_thread_cores"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(rows: list[dict], concurrencies: list[int]) -> list[str]:
    out = []
    for row in rows:
        if row["name"] not in JUDGED:
            continue
        for c in concurrencies:
            for m in ("tpot_s", "latency_p50_s"):
                ratio = row.get(f"c{c}.{m}/plain")
                ok = ratio is not None and ratio <= BOUND
                out.append(f"{'ok  ' if ok else 'OVER'} {row['name']} c={c} {m}: "
                           f"{_x(ratio)} of plain (bound {BOUND}x)")
    return out


def per_round(runs: list[list[dict]], concurrencies: list[int]) -> str:
    """Each engine's TPOT in each round: how far one engine moves between runs here."""
    lines = []
    for name in [r["name"] for r in runs[0]]:
        cells = []
        for c in concurrencies:
            values = [next(r for r in rnd if r["name"] == name)[f"c{c}"]["tpot_s"]
                      for rnd in runs]
            cells.append(f"c{c} " + " / ".join(_ms(v) for v in values))
        lines.append(f"- {name}: " + "; ".join(cells) + " ms")
    return "\n".join(lines)


def render_report(rows, concurrencies, args, settings: dict, verdicts, wall_s,
                  runs: list[list[dict]]) -> str:
    variants = "\n".join(f"- **{r['name']}**: {r['what']}" for r in rows)
    cores = "\n".join(f"- {r['name']}: {r['cores']}" for r in rows)
    env = ", ".join(f"`{k}={v}`" for k, v in settings["env"].items()) or "none set"
    return f"""# Engine overhead: our connector against a plain vLLM engine

> Each engine alone, minutes apart, on a machine shared with other work: one engine
> moves by up to half between rounds, so this mode's ordering of the engines (here
> plain slowest) is the machine's drift, not the engines'. It is retired for that
> question; the cluster users start is measured with the engines interleaved in
> `--live` mode ([engine_overhead_live.md](engine_overhead_live.md)).

Command: `python benchmarks/engine_overhead.py{' --quick' if args.quick else ''}`
({args.rounds} round(s), engines one at a time, round 2 in reverse order; {wall_s / 60:.0f} min).
Machine: {settings['machine']}. Model: `{settings['model']}`.
Requests: {args.requests} streamed completions per concurrency, {args.prompt_len} prompt
token ids, {args.max_tokens} output tokens, `ignore_eos`, temperature 0, sent straight
to the engine (no proxy), after {args.warmup} warm-up requests.
Thread and core settings, the same for every engine (the launcher's): {env}.

TPOT and prefill are means of vLLM's own histograms over the phase; latency and ITL
are the client's; CPU is the engine's processes (API server, engine core, worker) in
cores (100% = one core), idle over {args.idle_s:.0f} s with nothing running or held.
Ratios are to the plain engine of this run (medians over rounds).

{render_table(rows, concurrencies)}

The engines:
{variants}

Decode time per output token in each round (round 1 / round 2): on this shared
2-core machine one engine moves by up to half between rounds, so ratios within
that spread say "no slower", not "faster".

{per_round(runs, concurrencies)}

Cores each engine's threads may run on (process:cores):
{cores}

Judged (our defaults, D and P, within {BOUND}x of plain in decode time per token and
client latency p50, at each concurrency):

```
{chr(10).join(verdicts)}
```
"""


# ---------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="plain, ours as D and as P; one round, fewer requests")
    ap.add_argument("--model", help="model directory (default: generate the tiny model)")
    ap.add_argument("--real-model", action="store_true",
                    help="serve the real model (SmolLM2-135M-Instruct, built by "
                         "sessionkv-real-model into $SESSIONKV_REAL_MODEL_DIR or "
                         f"~/{REAL_MODEL_CACHE}) instead of the tiny one")
    ap.add_argument("--gpus", help="CUDA_VISIBLE_DEVICES for every engine (GPU hosts)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None, help="per concurrency")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--only", nargs="+", help="engine names to run (plain is always run)")
    ap.add_argument("--out", default=str(REPORT), help="report path ('' to skip)")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--render", metavar="JSON",
                    help="only write the report again from a run's JSON (no engines)")
    live = ap.add_argument_group("live cluster (--live)")
    live.add_argument("--live", action="store_true",
                      help="every engine of a launcher cluster up at once (P, D, co-located)")
    live.add_argument("--layout", nargs="+", choices=["1p1d", "2p2d"], default=["1p1d"],
                      help="clusters to run, one after the other")
    live.add_argument("--cores", default="auto",
                      help="the launcher's --cores (auto: its default; vllm: vLLM's binding)")
    live.add_argument("--base-port", type=int, default=22100,
                      help="the cluster's ports count up from here")
    live.add_argument("--sessionkv-config", default="{}",
                      help="JSON for the P and D engines' sessionkv config (the launcher's "
                           "--sessionkv-config), e.g. to compare a pacing setting")
    live.add_argument("--front-ab", action="store_true",
                      help="an A/B in one cluster: in every other pair of rounds each "
                           "engine's API server and engine core are kept off its model "
                           "thread's core")
    live.add_argument("--cores-ab", action="store_true",
                      help="an A/B in one cluster: in every other pair of rounds every "
                           "engine's model thread on the first core (vLLM's binding under "
                           "the launcher's old defaults) instead of its own")
    live.add_argument("--gap-s", type=float, default=1.5,
                      help="wait before each engine's block (vLLM's queues spin for 1 s "
                           "after an engine's last step)")
    live.add_argument("--no-holding", action="store_true",
                      help="skip the holding-D CPU measurement")
    args = ap.parse_args(argv)
    if args.real_model:
        if args.model:
            ap.error("--real-model and --model name two models: give one")
        args.model = real_model_dir()
    if args.rounds is None:
        args.rounds = (4 if args.live else 1) if args.quick else (8 if args.live else 2)
    if args.requests is None:
        args.requests = 12 if args.quick else 24
    if args.live:
        # Per concurrency: enough requests for a p50, few enough for many rounds.
        args.requests = {c: max(args.requests // 2, 4 * c) for c in args.concurrency}
        if args.out == str(REPORT):
            args.out = str(REPORT.with_name("engine_overhead_live.md"))
    return args


def main_live(args, argv) -> int:
    import platform

    import overhead_live

    command = public_command(argv if argv is not None else sys.argv[1:])
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        saved["command"] = public_command(saved["command"].split()[2:])
        runs = saved["runs"]
    else:
        runs = []
        for layout in args.layout:
            ns = argparse.Namespace(**{**vars(args), "layout": layout})
            runs.append(overhead_live.run_live(ns))
            if args.out:  # kept even if a later step fails
                Path(args.out).with_suffix(f".{layout}.partial.json").write_text(
                    json.dumps(runs[-1], indent=1))
            print("\n".join(overhead_live.verdicts(runs[-1], args.concurrency)), flush=True)
        saved = {"args": {k: v for k, v in vars(args).items() if k not in _PATH_ARGS},
                 "runs": runs,
                 "machine": f"{psutil.cpu_count()} cores, "
                            f"{psutil.virtual_memory().total / 2**30:.0f} GiB, "
                            f"{platform.system()} {platform.release()}",
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "commit": report.commit(), "command": command}
    all_verdicts = [v for run in runs for v in overhead_live.verdicts(run, args.concurrency)]
    if args.out:
        out = Path(args.out)
        sections = "\n".join(overhead_live.render_section(run, args, saved["command"])
                              for run in runs)
        out.write_text(LIVE_HEADER.format(**saved, rounds=args.rounds,
                                          requests=args.requests,
                                          prompt_len=args.prompt_len,
                                          max_tokens=args.max_tokens,
                                          warmup=args.warmup) + sections)
        if not args.render:
            out.with_suffix(".json").write_text(json.dumps(saved, indent=1))
        print(f"wrote {out}")
    return 0 if all(v.startswith("ok") for v in all_verdicts) else 1


# Flags whose values are local paths: a report names them, never gives them.
_PATH_FLAGS = {"--model": "MODEL_DIR", "--out": "REPORT", "--log-dir": "LOG_DIR",
               "--render": "JSON"}
_PATH_ARGS = ("model", "out", "log_dir", "render")
REAL_MODEL_CACHE = ".cache/vllm-sessionkv/smollm2-135m-instruct"


def public_command(argv: list[str]) -> str:
    """The command line as a report states it (``--model MODEL_DIR``, no local path)."""
    return report.public_command("engine_overhead.py", argv, _PATH_FLAGS)


def real_model_dir() -> str:
    """The real model's folder (``sessionkv-real-model``), built there if not yet."""
    from vllm_sessionkv.dev.real_model import build_real_model

    where = os.environ.get("SESSIONKV_REAL_MODEL_DIR") or str(Path.home() / REAL_MODEL_CACHE)
    path, _ = build_real_model(Path(where))
    return str(path)


LIVE_HEADER = """# Engine overhead in the cluster users start

{date}, commit {commit}. Machine: {machine}.
Command: `{command}`.
Each layout is one launcher cluster (`LocalCluster`, the defaults of
`examples/local_cluster.py`: Redis, the proxy, P and D with our connector, a plain
co-located engine), all engines up at once. {rounds} rounds; in each, every engine
in turn gets the same streamed completions straight (no proxy): {requests}
requests per concurrency (concurrency: requests), {prompt_len} prompt token ids,
{max_tokens} output tokens, `ignore_eos`, temperature 0, after {warmup} warm-up
requests each. The engines' order is reversed every other round (ABBA). Each
round's figures are ratios to the co-located engine of that round; the verdict is
the median of the rounds' ratios (bound 1.15x). CPU shares come from every thread's
`/proc/<pid>/task/<tid>/stat` (100% = one core).

"""


def rerender(path: str, out: str) -> int:
    saved = json.loads(Path(path).read_text())
    args = argparse.Namespace(**saved["args"])
    rows = summarize(saved["rounds"], args.concurrency)
    verdicts = verdict(rows, args.concurrency)
    wall_s = saved.get("wall_s", 0.0)
    Path(out).write_text(render_report(rows, args.concurrency, args, saved["settings"],
                                       verdicts, wall_s, saved["rounds"]))
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.live:
        return main_live(args, argv)
    if args.render:
        return rerender(args.render, args.out)
    names = QUICK if args.quick else tuple(v.name for v in VARIANTS)
    if args.only:
        names = ("plain", *[n for n in args.only if n != "plain"])
    variants = [v for v in VARIANTS if v.name in names]
    unknown = set(names) - {v.name for v in variants}
    if unknown:
        raise SystemExit(f"unknown engine names: {sorted(unknown)}")
    tmp = Path(tempfile.mkdtemp(prefix="skv-overhead-"))
    log_dir = Path(args.log_dir) if args.log_dir else tmp / "logs"
    model = args.model
    if model is None:
        from vllm_sessionkv.dev.tiny_model import generate_tiny_model
        model = str(tmp / "tiny-model")
        generate_tiny_model(model)
    bodies = {c: completion_bodies(model, args.requests, args.prompt_len, args.max_tokens,
                                   seed=c) for c in args.concurrency}
    warm = completion_bodies(model, args.warmup, args.prompt_len, args.max_tokens, seed=99)
    _, env = engine_command(EngineSpec(role="colocated", model=model, port=0))
    settings = {"env": {k: env[k] for k in THREAD_ENV if k in env}, "model": model,
                "machine": f"{psutil.cpu_count()} cores, "
                           f"{psutil.virtual_memory().total / 2**30:.0f} GiB"}
    started = time.monotonic()
    runs: list[list[dict]] = []
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else list(reversed(variants))
        results = []
        for v in order:
            print(f"[round {rnd + 1}/{args.rounds}] {v.name} ...", flush=True)
            results.append(measure_engine(v, model, args, log_dir, bodies, warm))
            r = results[-1]
            print("   " + "  ".join(f"c{c}: tpot {_ms(r[f'c{c}']['tpot_s'])} ms, "
                                    f"lat p50 {_ms(r[f'c{c}']['latency_p50_s'])} ms"
                                    for c in args.concurrency)
                  + f"  idle {_share(r['idle_cpu'])}", flush=True)
        runs.append(sorted(results, key=lambda r: names.index(r["name"])))
    rows = summarize(runs, args.concurrency)
    verdicts = verdict(rows, args.concurrency)
    table = render_table(rows, args.concurrency)
    print(table)
    print("\n".join(verdicts))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_report(rows, args.concurrency, args, settings, verdicts,
                                     time.monotonic() - started, runs))
        out.with_suffix(".json").write_text(json.dumps(
            {"settings": settings, "args": vars(args), "rounds": runs, "rows": rows,
             "wall_s": time.monotonic() - started},
            indent=1))
        print(f"wrote {out}")
    return 0 if all(v.startswith("ok") for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
