#!/usr/bin/env python3
"""Load-and-fault soak: concurrent sessions through 2P+2D with Redis while a schedule
kills and restarts a D, restarts Redis and stops a P.

    python benchmarks/soak.py                      # tiny model on this machine
    python benchmarks/soak.py --sessions 8 --turns 4 --quick
    python benchmarks/soak.py --model /models/M --gpus 0,1,2,3,4   # GPU host

It starts the cluster itself (``vllm_sessionkv.dev.launch.LocalCluster``, supervised: a
killed engine or Redis is restarted on its ports), plus a co-located plain vLLM
server, and runs ``--sessions`` sessions of ``--turns`` turns each; every turn
re-sends the whole history and is checked against the co-located server at
temperature 0.  The fault schedule (seconds after the traffic starts, scaled by
``--schedule-scale``):

* t=8: SIGKILL D0's process group; the supervisor restarts it on its ports;
* t=20: SIGKILL Redis; the supervisor restarts it (empty) on its port;
* t=30: SIGSTOP P0 (and its children) for 20 s, then SIGCONT.

It prints, and writes to ``docs/benchmarks/soak.md``: requests, client errors
inside and outside the window in which the killed D was down, mismatches against
the co-located server, latency p50/p99, peak proxy RSS, and what ``/health`` said
during each fault.  Exit status 1 when an error falls outside the D window or any
answer differs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

REPO = Path(__file__).resolve().parent.parent
REPORT = REPO / "docs" / "benchmarks" / "soak.md"


@dataclass
class Outcome:
    session: int
    turn: int
    started_s: float
    ended_s: float
    status: int            # HTTP status, or 0 for a broken connection
    error: str = ""
    mismatch: bool = False
    decode_engine: str = ""


@dataclass
class Window:
    name: str
    start_s: float
    end_s: float | None = None
    health: list[str] = field(default_factory=list)   # /health statuses seen


def _body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def _pid_listening(port: int) -> int:
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN \
                and conn.pid:
            return conn.pid
    raise RuntimeError(f"nothing listens on port {port}")


def _signal_tree(pid: int, sig: int) -> None:
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _health(proxy: str) -> str:
    try:
        resp = requests.get(proxy + "/health", timeout=5)
        body = resp.json()
        problems = "; ".join(body.get("problems", []))
        return f"{resp.status_code} {body.get('status')}" + (f": {problems}" if problems else "")
    except (requests.RequestException, ValueError) as exc:
        return f"no answer ({type(exc).__name__})"


class Soak:
    def __init__(self, args, cluster) -> None:
        self.args, self.cluster = args, cluster
        self.proxy = cluster.proxy_url
        self.colocated = cluster.colocated.url
        self.outcomes: list[Outcome] = []
        self.windows: list[Window] = []
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.done = threading.Event()
        self.peak_rss = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def session(self, i: int) -> None:
        args, model = self.args, self.cluster.spec.model
        history = f"soak session {i}: the kato is of rimu and senlo. " * args.prefix_repeats
        sid = f"soak-{os.getpid()}-{i}"
        time.sleep(i * args.think_s / max(1, args.sessions))   # staggered starts
        for turn in range(args.turns):
            history += f" step {turn}: what of the vaqu and the dramon?"
            body = _body(model, history, args.max_tokens)
            started = self.now()
            outcome = Outcome(i, turn, started, started, 0)
            try:
                resp = requests.post(self.proxy + "/v1/completions", json=body,
                                     headers={"X-Session-ID": sid}, timeout=300)
                outcome.status = resp.status_code
                outcome.decode_engine = resp.headers.get("x-sessionkv-decode-engine", "")
                if resp.status_code != 200:
                    outcome.error = resp.text[:200]
            except requests.RequestException as exc:
                outcome.error = f"{type(exc).__name__}: {exc}"[:200]
            outcome.ended_s = self.now()
            if outcome.status == 200:
                got = resp.json()["choices"][0]
                base = requests.post(self.colocated + "/v1/completions", json=body,
                                     timeout=300).json()["choices"][0]
                outcome.mismatch = got.get("token_ids") != base.get("token_ids")
                history += got["text"]
            with self.lock:
                self.outcomes.append(outcome)
            time.sleep(args.think_s)

    def supervise(self) -> None:
        while not self.done.is_set():
            self.cluster.supervise_once()
            try:
                proxy_pid = _pid_listening(int(self.proxy.rsplit(":", 1)[1]))
                self.peak_rss = max(self.peak_rss, psutil.Process(proxy_pid).memory_info().rss)
            except (RuntimeError, psutil.Error):
                pass
            for window in self.windows:
                if window.end_s is None:
                    window.health.append(_health(self.proxy))
            self.done.wait(0.5)

    def _at(self, t: float) -> bool:
        """Wait until ``t`` seconds (scaled) into the run; False if the run ended."""
        while self.now() < t * self.args.schedule_scale:
            if self.done.wait(0.1):
                return False
        return not self.done.is_set()

    def _wait_healthy(self, url: str, timeout_s: float = 600.0) -> bool:
        """Until ``url`` answers /health with 200 (True), or the run ends (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            if self.done.wait(0.5):
                return False
        return False

    def _open(self, name: str) -> Window:
        window = Window(name, self.now())
        with self.lock:
            self.windows.append(window)
        return window

    def kill_decode(self) -> None:
        """t=8: SIGKILL D0 with its EngineCore; the supervisor restarts it."""
        url = self.cluster.decode[0].url
        if not self._at(8):
            return
        window = self._open("D0 killed until healthy again")
        _signal_tree(_pid_listening(int(url.rsplit(":", 1)[1])), signal.SIGKILL)
        if self._wait_healthy(url):
            window.end_s = self.now()

    def kill_redis(self) -> None:
        """t=20: SIGKILL Redis; the supervisor restarts it, empty."""
        port = int(self.cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
        if not self._at(20):
            return
        window = self._open("Redis killed until restarted")
        _signal_tree(_pid_listening(port), signal.SIGKILL)
        while not self.done.wait(0.2):
            try:
                _pid_listening(port)
                break
            except RuntimeError:
                pass
        window.end_s = self.now() if not self.done.is_set() else None

    def stop_prefill(self) -> None:
        """t=30: SIGSTOP P0 and its children for 20 s."""
        url = self.cluster.prefill[0].url
        if not self._at(30):
            return
        window = self._open("P0 stopped (SIGSTOP) for 20 s")
        p0 = _pid_listening(int(url.rsplit(":", 1)[1]))
        _signal_tree(p0, signal.SIGSTOP)
        try:
            self.done.wait(20 * self.args.schedule_scale)
        finally:
            _signal_tree(p0, signal.SIGCONT)
        window.end_s = self.now()

    def run(self) -> None:
        supervisor = threading.Thread(target=self.supervise, daemon=True)
        faults = [threading.Thread(target=f, daemon=True)
                  for f in (self.kill_decode, self.kill_redis, self.stop_prefill)]
        supervisor.start()
        for fault in faults:
            fault.start()
        with ThreadPoolExecutor(self.args.sessions) as pool:
            list(pool.map(self.session, range(self.args.sessions)))
        self.done.set()   # faults not yet due are skipped; a stopped P continues
        for thread in (*faults, supervisor):
            thread.join(timeout=30)


def summarize(soak: Soak, args) -> tuple[str, bool]:
    outcomes = soak.outcomes
    d_window = next((w for w in soak.windows if w.name.startswith("D0")), None)

    def in_d_window(o: Outcome) -> bool:
        # A request that was running on D0, or was sent to it, while it was down.
        return d_window is not None and o.ended_s >= d_window.start_s and (
            d_window.end_s is None or o.started_s <= d_window.end_s)

    errors = [o for o in outcomes if o.status != 200]
    inside = [o for o in errors if in_d_window(o)]
    outside = [o for o in errors if not in_d_window(o)]
    mismatches = [o for o in outcomes if o.mismatch]
    latencies = sorted(o.ended_s - o.started_s for o in outcomes if o.status == 200)

    def pct(q: float) -> float:
        if not latencies:
            return float("nan")
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))]

    lines = [
        "| measure | value |", "|---|---|",
        f"| sessions x turns | {args.sessions} x {args.turns} |",
        f"| requests | {len(outcomes)} |",
        f"| client errors outside the D-down window | {len(outside)} |",
        f"| client errors inside the D-down window | {len(inside)} |",
        f"| mismatches against the co-located server | {len(mismatches)} |",
        f"| latency p50 / p99 | {pct(0.5):.2f} s / {pct(0.99):.2f} s |",
        f"| latency mean | {statistics.fmean(latencies) if latencies else float('nan'):.2f} s |",
        f"| peak proxy RSS | {soak.peak_rss / 2**20:.0f} MiB |",
        "", "Seconds from the first request. A session whose D was killed sends its "
        "next turn to the other D (the proxy retries a refused connection there), so "
        "only requests running on the killed D when it died can fail; they are counted "
        "inside the window.", "",
        "| fault | from | to | /health answers seen |", "|---|---|---|---|",
    ]
    for w in soak.windows:
        seen = sorted(set(w.health))
        lines.append(f"| {w.name} | {w.start_s:.1f} s | "
                     f"{'after the traffic ended' if w.end_s is None else f'{w.end_s:.1f} s'} | "
                     f"{'<br>'.join(seen) if seen else '-'} |")
    if errors:
        lines += ["", "Errors:", ""]
        lines += [f"- t={o.started_s:.1f}-{o.ended_s:.1f} s session {o.session} turn "
                  f"{o.turn}: {o.status} {o.error}" for o in errors[:20]]
    reached = {w.name.split(" ")[0] for w in soak.windows}
    missed = [name for name in ("D0", "Redis", "P0") if name not in reached]
    if missed:
        lines += ["", f"Faults not reached before the traffic ended: {', '.join(missed)} "
                      "(raise --turns or --think-s, or lower --schedule-scale)."]
    ok = not outside and not mismatches and not missed
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prefix-repeats", type=int, default=8,
                   help="repeats of the sessions' opening sentence (prompt length)")
    p.add_argument("--think-s", type=float, default=5.0,
                   help="pause between turns (a tool's run; agent traces' median is about "
                        "5 s), so that the traffic spans the fault schedule")
    p.add_argument("--schedule-scale", type=float, default=1.0,
                   help="stretch (>1) or shrink the fault schedule")
    p.add_argument("--model", help="model directory (default: a tiny random Llama)")
    p.add_argument("--gpus", help="CUDA_VISIBLE_DEVICES per engine, comma-separated")
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--quick", action="store_true",
                   help="8 sessions x 8 turns, 2 s apart, the schedule at 0.5x")
    p.add_argument("--no-report", action="store_true",
                   help=f"print only; do not write {REPORT.relative_to(REPO)}")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.think_s, args.schedule_scale = 8, 8, 2.0, 0.5

    from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster

    # The supervisor's lines (exited, restarted, healthy) with their times.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("vllm_sessionkv.dev.launch").setLevel(logging.INFO)

    workdir = Path(tempfile.mkdtemp(prefix="sessionkv-soak-"))
    model = args.model
    if model is None:
        from vllm_sessionkv.dev.tiny_model import generate_tiny_model

        model = str(generate_tiny_model(workdir / "tiny-llama", seed=0))
    spec = ClusterSpec(model=model, prefill=2, decode=2, colocated=True, redis=True,
                       kv_cache_space_gb=args.kv_cache_gb, log_dir=workdir / "logs",
                       gpus=args.gpus.split(",") if args.gpus else None)
    cluster = LocalCluster(spec)
    started = time.monotonic()
    cluster.start()
    print(f"cluster ready in {time.monotonic() - started:.0f} s; logs in {spec.log_dir}",
          flush=True)
    try:
        soak = Soak(args, cluster)
        soak.run()
    finally:
        cluster.stop()
    table, ok = summarize(soak, args)
    print(table)
    if not args.no_report:
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(
            "# Load-and-fault soak\n\n"
            f"`python benchmarks/soak.py {' '.join(argv or sys.argv[1:])}`, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{os.cpu_count()} CPUs; 2 P + 2 D + Redis + a co-located server.\n\n"
            + table + "\n")
        print(f"wrote {REPORT.relative_to(REPO)}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
