"""``engine_overhead.py --live``: every engine of a launcher cluster up at once.

A cluster as ``examples/local_cluster.py`` starts it (``LocalCluster``, the launcher's
defaults: Redis, the proxy, P and D engines with our connector, the plain co-located
engine; ``--layout 2p2d`` for two of each), then, round after round, the same streamed
completions straight to each engine in turn (no proxy), at each concurrency, the
engines' order reversed every other round (ABBA: A B C, C B A, C B A, A B C, ...), so
a drift of the machine falls on both sides of every ratio.  Each round's figures are
ratios to the co-located engine of that round; the verdict takes the median over rounds.

Per engine and phase it records the CPU time of every thread of the engine's
processes (``/proc/<pid>/task/<tid>/stat``: utime+stime, and field 39, the core the
thread last ran on), so the report states where each engine's model thread computed
and what the idle engines beside a busy one cost.  It also measures, in the same
cluster, the idle CPU (nothing running, nothing held) and the CPU of a D holding a
session lease (a turn sent through the proxy with a session id), and the machine's
load average at the start of every round (other work on the machine shows there).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
import requests

REPO = Path(__file__).resolve().parent.parent

from sessionkv_bench.metrics import histogram_mean, histogram_sums, metric_sum  # noqa: E402
from sessionkv_bench.client import closed_loop, completion_bodies, sse_chunks  # noqa: E402
from sessionkv_bench.stats import pct  # noqa: E402

from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster, process_tree  # noqa: E402

REPORT = REPO / "docs" / "benchmarks" / "engine_overhead_live.md"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
BASELINE = "colocated"
BOUND = 1.15
IDLE_BOUND = 0.20      # 1P+1D idle, in cores
HOLDING_BOUND = 0.25   # a D holding one session, in cores
TPOT = "vllm:request_time_per_output_token_seconds"


# ---------------------------------------------------------------- client

@dataclass
class Stream:
    latency_s: float
    ttft_s: float | None
    # Seconds per output token from the first streamed chunk to the last, counted by
    # the engine's own running usage (chunks carry several tokens when the API
    # server falls behind, so chunk gaps are not token gaps).
    tpot_s: float | None


async def _stream_one(session: aiohttp.ClientSession, url: str, body: dict) -> Stream:
    body = {**body, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    started = time.perf_counter()
    first = last = None  # (time, completion tokens so far)
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for chunk in sse_chunks(resp):
            usage = chunk.get("usage") or {}
            if chunk.get("choices") and usage.get("completion_tokens"):
                point = (time.perf_counter(), usage["completion_tokens"])
                first = first or point
                last = point
    ended = time.perf_counter()
    tpot = None
    if first and last and last[1] > first[1]:
        tpot = (last[0] - first[0]) / (last[1] - first[1])
    return Stream(ended - started, first[0] - started if first else None, tpot)


# ---------------------------------------------------------------- threads

@dataclass(frozen=True)
class ThreadSample:
    process: str     # the process's name (VLLM::Worker, VLLM::EngineCore, python, ...)
    thread: str      # the thread's name (comm)
    ticks: int       # utime + stime, in clock ticks
    last_core: int   # /proc stat field 39: the core it last ran on
    allowed: str     # its affinity, e.g. "0" or "0-1"


def _allowed(tid: int) -> str:
    try:
        cores = sorted(os.sched_getaffinity(tid))
    except OSError:
        return "?"
    if cores == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def sample_threads(procs: list[psutil.Process]) -> dict[int, ThreadSample]:
    """Every thread of ``procs``, by thread id."""
    out = {}
    for p in procs:
        try:
            pname = p.name()
            tids = os.listdir(f"/proc/{p.pid}/task")
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
        for tid in map(int, tids):
            try:
                raw = Path(f"/proc/{p.pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            comm = raw[raw.index("(") + 1:raw.rindex(")")]
            fields = raw[raw.rindex(")") + 2:].split()  # fields[0] is field 3
            out[tid] = ThreadSample(pname, comm, int(fields[11]) + int(fields[12]),
                                    int(fields[36]), _allowed(tid))
    return out


def thread_use(before: dict[int, ThreadSample], after: dict[int, ThreadSample],
               wall_s: float) -> list[dict]:
    """Threads that used CPU between two samples, busiest first: share of a core,
    where they ran."""
    rows = []
    for tid, a in after.items():
        b = before.get(tid)
        used = (a.ticks - (b.ticks if b else 0)) * TICK_S
        if used > 0:
            rows.append({"tid": tid, "process": a.process, "thread": a.thread,
                         "cores": used / wall_s, "last_core": a.last_core,
                         "allowed": a.allowed})
    return sorted(rows, key=lambda r: -r["cores"])


class Engines:
    """Each engine's processes (the launcher's child and its descendants)."""

    def __init__(self, cluster: LocalCluster, names: list[str]):
        self.names = names
        by_name = {p.name: p.pid for p in cluster.procs}
        self.procs = {n: process_tree([by_name[n]]) for n in names}
        self.urls = {n: u for n, u in _engine_urls(cluster).items() if n in names}

    def sample(self) -> dict[str, dict[int, ThreadSample]]:
        return {n: sample_threads(self.procs[n]) for n in self.names}


def _engine_urls(cluster: LocalCluster) -> dict[str, str]:
    urls = {f"prefill{i}": e.url for i, e in enumerate(cluster.prefill)}
    urls.update({f"decode{i}": e.url for i, e in enumerate(cluster.decode)})
    if cluster.colocated:
        urls["colocated"] = cluster.colocated.url
    return urls


def cpu_by_engine(engines: Engines, before, after, wall_s: float
                  ) -> dict[str, dict]:
    out = {}
    for n in engines.names:
        threads = thread_use(before[n], after[n], wall_s)
        out[n] = {"cores": sum(t["cores"] for t in threads),
                  "top": [{k: (round(v, 4) if isinstance(v, float) else v)
                           for k, v in t.items() if k != "tid"} for t in threads[:4]]}
    return out


def measure_quiet(engines: Engines, seconds: float) -> dict[str, dict]:
    before, t0 = engines.sample(), time.monotonic()
    time.sleep(seconds)
    return cpu_by_engine(engines, before, engines.sample(), time.monotonic() - t0)


def pin_front_ends(engines: Engines, binds: dict[str, str | None], pinned: bool) -> None:
    """Every thread of each engine's API server and engine core on the cores other
    than its model thread's (``pinned``), or back on every core.  The worker process
    (the model thread and its helpers) is left as vLLM bound it."""
    every = sorted(os.sched_getaffinity(0))
    for name, procs in engines.procs.items():
        bind = binds.get(name)
        model = {int(bind)} if bind and bind.isdigit() else set()
        cores = [c for c in every if c not in model] if pinned else every
        for p in procs:
            try:
                if "Worker" in p.name():
                    continue
                for tid in map(int, os.listdir(f"/proc/{p.pid}/task")):
                    try:
                        os.sched_setaffinity(tid, cores or every)
                    except OSError:
                        pass
            except (psutil.NoSuchProcess, FileNotFoundError):
                continue


def pin_model_threads(engines: Engines, binds: dict[str, str | None], planned: bool) -> None:
    """Each engine's model thread (its worker's main thread, the one OpenMP thread)
    on its planned core (``planned``), or every one on the first core, where
    vLLM's own binding put them with the launcher's one reserved CPU (the old
    default): an A/B of the placement on the same engines."""
    first = str(min(os.sched_getaffinity(0)))
    for name, procs in engines.procs.items():
        bind = binds.get(name) if planned else first
        if not bind or not bind.isdigit():
            continue
        for p in procs:
            try:
                if "Worker" in p.name():
                    os.sched_setaffinity(p.pid, {int(bind)})
            except (psutil.NoSuchProcess, OSError):
                continue


# ---------------------------------------------------------------- phases

def run_block(engines: Engines, name: str, bodies: list[dict], concurrency: int) -> dict:
    """One engine's requests; every engine's CPU meanwhile."""
    url = engines.urls[name]
    hist0 = histogram_sums(url)
    before, t0 = engines.sample(), time.monotonic()
    samples = asyncio.run(closed_loop(_stream_one, url, bodies, concurrency))
    wall_s = time.monotonic() - t0
    cpu = cpu_by_engine(engines, before, engines.sample(), wall_s)
    hist1 = histogram_sums(url)
    lat = [s.latency_s for s in samples]
    tpot = [s.tpot_s for s in samples if s.tpot_s is not None]
    ttft = [s.ttft_s for s in samples if s.ttft_s is not None]
    return {"engine": name, "concurrency": concurrency,
            "tpot_s": statistics.median(tpot) if tpot else None,
            "ttft_p50_s": pct(ttft, 0.50),
            "engine_tpot_s": histogram_mean(hist0, hist1, TPOT),
            "latency_p50_s": pct(lat, 0.50), "latency_p99_s": pct(lat, 0.99),
            "requests": len(samples), "wall_s": wall_s,
            "cpu": {n: round(c["cores"], 4) for n, c in cpu.items()},
            "busy_threads": cpu[name]["top"]}


def abba_order(names: list[str], rnd: int) -> list[str]:
    """Rounds 0 and 3 forward, 1 and 2 reversed (then again)."""
    return list(names) if rnd % 4 in (0, 3) else list(reversed(names))


def hold_a_session(proxy: str, model: str) -> str:
    """One turn through the proxy with a session id; D holds its blocks for the next
    turn.  Returns that D's URL once its hold gauge shows it."""
    history = [(5 * i + 2) % 900 + 20 for i in range(1000)]
    body = {"model": model, "prompt": history, "max_tokens": 64, "temperature": 0.0,
            "ignore_eos": True}
    resp = requests.post(proxy + "/v1/completions", json=body,
                         headers={"X-Session-ID": "overhead-live-hold"}, timeout=300)
    resp.raise_for_status()
    d_url = resp.headers["x-sessionkv-decode-engine"]
    deadline = time.monotonic() + 60
    while metric_sum(d_url, "sessionkv_session_holds") < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{d_url} reports no session hold")
        time.sleep(0.5)
    return d_url


def wait_no_holds(urls: list[str], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(metric_sum(u, "sessionkv_session_holds") for u in urls) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("session holds did not end")
        time.sleep(1.0)


# ---------------------------------------------------------------- run

def run_live(args) -> dict:
    n_prefill, n_decode = {"1p1d": (1, 1), "2p2d": (2, 2)}[args.layout]
    tmp = Path(tempfile.mkdtemp(prefix="skv-overhead-live-"))
    model = args.model
    served = None
    if model is None:
        from vllm_sessionkv.dev.tiny_model import generate_tiny_model
        model = str(generate_tiny_model(tmp / "sessionkv-tiny-model"))
        served = "sessionkv-tiny-model"
    spec = ClusterSpec(model=model, served_model_name=served, prefill=n_prefill,
                       decode=n_decode, colocated=True, redis=True, proxy=True,
                       base_port=args.base_port, proxy_port=None,
                       kv_cache_space_gb=args.kv_cache_gb, cores=args.cores,
                       sessionkv=json.loads(args.sessionkv_config),
                       log_dir=Path(args.log_dir) if args.log_dir else tmp / "logs",
                       gpus=[args.gpus] if args.gpus else None)
    names = spec.engine_names()
    request_model = served or model
    started = time.monotonic()
    load_at_start = os.getloadavg()
    cluster = LocalCluster(spec)
    print(cluster.core_plan.rule, flush=True)
    cluster.start()
    try:
        engines = Engines(cluster, names)
        warm = completion_bodies(request_model, args.warmup, args.prompt_len,
                                 args.max_tokens, seed=99)
        for n in names:
            asyncio.run(closed_loop(_stream_one, engines.urls[n], warm, 2))
        time.sleep(args.settle_s)
        idle = measure_quiet(engines, args.idle_s)
        print("idle: " + ", ".join(f"{n} {c['cores'] * 100:.1f}%" for n, c in idle.items()),
              flush=True)
        rounds = []
        for rnd in range(args.rounds):
            order = abba_order(names, rnd)
            blocks = []
            front = None
            if args.cores_ab:
                # Rounds 1, 4, 5, 8 as the launcher places them, 2, 3, 6, 7 every
                # model thread on the first core (vLLM's binding, the old default).
                # Odd rounds as the launcher places them, even rounds every model
                # thread on the first core: each arm meets both orders (ABBA).
                front = "one core each" if rnd % 2 == 0 else "all on core 0"
                pin_model_threads(engines, cluster.core_plan.binds, rnd % 2 == 0)
            if args.front_ab:
                # Odd rounds as started, even rounds with the front ends apart.
                front = "front ends apart" if rnd % 2 else "front ends free"
                pin_front_ends(engines, cluster.core_plan.binds, rnd % 2 == 1)
            load = os.getloadavg()
            for conc in args.concurrency:
                bodies = completion_bodies(request_model, args.requests[conc],
                                           args.prompt_len, args.max_tokens,
                                           seed=1000 * rnd + conc)
                for n in order:
                    # vLLM's queues spin for 1 s after an engine's last step: let the
                    # engine before this one go idle, so its neighbours are idle.
                    time.sleep(args.gap_s)
                    blocks.append(run_block(engines, n, bodies, conc))
            rounds.append({"round": rnd + 1, "order": order, "front": front, "loadavg": load,
                           "loadavg_end": os.getloadavg(), "blocks": blocks})
            print(f"[round {rnd + 1}/{args.rounds}] {front or ''} load {load[0]:.2f} " + "  ".join(
                f"{b['engine']}@c{b['concurrency']} tpot {b['tpot_s'] * 1e3:.2f} ms "
                f"p50 {b['latency_p50_s'] * 1e3:.0f} ms" for b in blocks), flush=True)
        if args.cores_ab:
            pin_model_threads(engines, cluster.core_plan.binds, True)
        if args.front_ab:
            pin_front_ends(engines, cluster.core_plan.binds, False)
        d_urls = [e.url for e in cluster.decode]
        holding = None
        if cluster.proxy_url and not args.no_holding:
            d_url = hold_a_session(cluster.proxy_url, request_model)
            holder = next(n for n, u in engines.urls.items() if u == d_url)
            time.sleep(args.settle_s)
            holding = {"engine": holder, "cpu": measure_quiet(engines, args.idle_s),
                       "holds": metric_sum(d_url, "sessionkv_session_holds")}
            print(f"holding: {holder} {holding['cpu'][holder]['cores'] * 100:.1f}%",
                  flush=True)
            requests.post(cluster.proxy_url + "/admin/reset", timeout=60)
            wait_no_holds(d_urls)
        placement = {n: {"bind": cluster.core_plan.binds.get(n),
                         "threads": len(engines.sample()[n])} for n in names}
    finally:
        cluster.stop()
    return {"layout": args.layout, "engines": names, "core_rule": cluster.core_plan.rule,
            "placement": placement, "idle": idle, "rounds": rounds, "holding": holding,
            "load_at_start": load_at_start, "load_at_end": os.getloadavg(),
            "wall_s": time.monotonic() - started}


# ---------------------------------------------------------------- summary

def ratios(run: dict, concurrencies: list[int]) -> dict:
    """``{engine: {"c1.tpot_s": [per-round ratio, ...], ...}}`` to the baseline."""
    out: dict[str, dict[str, list]] = {n: {} for n in run["engines"] if n != BASELINE}
    for rnd in run["rounds"]:
        for c in concurrencies:
            by = {b["engine"]: b for b in rnd["blocks"] if b["concurrency"] == c}
            base = by[BASELINE]
            for n in out:
                for m in ("engine_tpot_s", "latency_p50_s"):
                    r = by[n][m] / base[m] if by[n][m] and base[m] else None
                    out[n].setdefault(f"c{c}.{m}", []).append(r)
    return out


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def verdicts(run: dict, concurrencies: list[int]) -> list[str]:
    modes = sorted({r.get("front") for r in run["rounds"]} - {None})
    if modes:  # an A/B: one verdict per arm
        lines = []
        for mode in modes:
            sub = {**run, "holding": None, "layout": "ab",
                   "rounds": [{**r, "front": None} for r in run["rounds"]
                              if r.get("front") == mode]}
            lines += [f"[{mode}] {v}" for v in verdicts(sub, concurrencies)]
        return lines
    lines = []
    for n, by_metric in ratios(run, concurrencies).items():
        for key, values in by_metric.items():
            m = _med(values)
            ok = m is not None and m <= BOUND
            lines.append(f"{'ok  ' if ok else 'OVER'} {n} {key}: median {_x(m)} of "
                         f"{BASELINE} (rounds: {', '.join(_x(v) for v in values)}; "
                         f"bound {BOUND}x)")
    pd = [n for n in run["engines"] if n != BASELINE]
    if run["layout"] == "1p1d":
        idle_total = sum(run["idle"][n]["cores"] for n in pd)
        lines.append(f"{'ok  ' if idle_total < IDLE_BOUND else 'OVER'} idle 1P+1D: "
                     f"{idle_total * 100:.1f}% of a core (bound {IDLE_BOUND * 100:.0f}%)")
    if run["holding"]:
        h = run["holding"]
        used = h["cpu"][h["engine"]]["cores"]
        lines.append(f"{'ok  ' if used < HOLDING_BOUND else 'OVER'} holding D "
                     f"({h['engine']}): {used * 100:.1f}% of a core "
                     f"(bound {HOLDING_BOUND * 100:.0f}%)")
    return lines


def _x(x):
    return "-" if x is None else f"{x:.2f}x"


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.2f}"


def render_rounds(run: dict, concurrencies: list[int]) -> str:
    head = ["round", "order", "arm", "load 1/5/15 min", "c", *run["engines"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rnd in run["rounds"]:
        load = "/".join(f"{x:.2f}" for x in rnd["loadavg"])
        for c in concurrencies:
            by = {b["engine"]: b for b in rnd["blocks"] if b["concurrency"] == c}
            cells = [str(rnd["round"]), " ".join(rnd["order"]), rnd.get("front") or "as started",
                     load, str(c)]
            for n in run["engines"]:
                b = by[n]
                cells.append(f"{_ms(b.get('engine_tpot_s'))} / {_ms(b['latency_p50_s'])} "
                             f"({_ms(b['tpot_s'])})")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_neighbours(run: dict, concurrencies: list[int]) -> str:
    """Median CPU of every engine while each one was busy: what idle neighbours cost."""
    names = run["engines"]
    head = ["busy engine", "c", *[f"{n} CPU" for n in names]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in concurrencies:
        for busy in names:
            blocks = [b for r in run["rounds"] for b in r["blocks"]
                      if b["engine"] == busy and b["concurrency"] == c]
            cells = [busy, str(c)] + [
                f"{_med([b['cpu'][n] for b in blocks]) * 100:.0f}%" for n in names]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_threads(run: dict) -> str:
    """Each engine's busiest threads in its last c=1 block, and idle."""
    lines = []
    last = {}
    for r in run["rounds"]:
        for b in r["blocks"]:
            if b["concurrency"] == 1:
                last[b["engine"]] = b
    for n in run["engines"]:
        bind = run["placement"][n]["bind"]
        busy = "; ".join(f"{t['process']}/{t['thread']} {t['cores'] * 100:.0f}% "
                         f"(allowed {t['allowed']}, last on {t['last_core']})"
                         for t in last[n]["busy_threads"][:3]) if n in last else "-"
        idle = "; ".join(f"{t['process']}/{t['thread']} {t['cores'] * 100:.1f}%"
                         for t in run["idle"][n]["top"][:3]) or "none"
        lines.append(f"- **{n}** (VLLM_CPU_OMP_THREADS_BIND={bind or 'unset: vLLM'}, "
                     f"{run['placement'][n]['threads']} threads): busy {busy}. "
                     f"Idle: {idle}.")
    return "\n".join(lines)


def render_section(run: dict, args, command: str) -> str:
    concs = args.concurrency
    gap_s = getattr(args, "gap_s", 0.0)
    idle = ", ".join(f"{n} {c['cores'] * 100:.1f}%" for n, c in run["idle"].items())
    h = run["holding"]
    holding = "not measured" if not h else (
        f"{h['engine']} holding {h['holds']:.0f} session: " + ", ".join(
            f"{n} {c['cores'] * 100:.1f}%" for n, c in h["cpu"].items()))
    load0 = "/".join(f"{x:.2f}" for x in run["load_at_start"])
    load1 = "/".join(f"{x:.2f}" for x in run["load_at_end"])
    return f"""## Layout {run['layout']}: {', '.join(run['engines'])}

Command: `{command}` ({run['wall_s'] / 60:.1f} min; load average 1/5/15 min
{load0} at start, {load1} at the end).

Launcher's core rule, as printed at start-up:

```
{run['core_rule']}
```

Every round, per engine, in ms: TPOT / latency p50 (client TPOT). TPOT is vLLM's own
time per output token (the mean of `vllm:request_time_per_output_token_seconds` over
the block); latency p50 is the client's. Client TPOT: the median over requests of the
time from the first streamed chunk to the last over the tokens between, counted by
the engine's running usage (`continuous_usage_stats`); on a loaded machine an API
server falls behind and sends a request's tokens in a few chunks, so it is shown but
not judged. Before each block the benchmark waits {gap_s:g} s: vLLM's queues spin for
1 s after an engine's last step, and the engine measured next should have idle
neighbours.

{render_rounds(run, concs)}

```
{chr(10).join(verdicts(run, concs))}
```

CPU of every engine (cores; 100% = one) while one engine was busy (median over
rounds): the cost of the idle neighbours.

{render_neighbours(run, concs)}

Idle (nothing running, nothing held, {args.idle_s:.0f} s): {idle}.
Holding ({args.idle_s:.0f} s): {holding}.

Threads (process/thread, share of a core, the cores it may run on, the core it last
ran on):

{render_threads(run)}
"""
