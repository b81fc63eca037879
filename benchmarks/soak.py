#!/usr/bin/env python3
"""Load-and-fault soak: concurrent sessions through 2P+2D with Redis while a schedule
kills and restarts a D, restarts Redis and stops a P; then a KV-pressure phase.

    flock /tmp/sessionkv-cluster.lock python benchmarks/soak.py --base-port 34000
    flock /tmp/sessionkv-cluster.lock python benchmarks/soak.py --quick --out-dir DIR

A supervised ``LocalCluster`` (a killed engine or Redis is restarted on its ports) and
a co-located reference; every answer (temperature 0, engines in float32: in bfloat16 a
plain server's answer depends on where a prefix-cache hit splits the prompt) is
compared with the reference's in token ids (``kv_pressure.Client``).  Fault phase:
``--sessions`` sessions of ``--turns`` text turns ``--think-s`` apart; D0 SIGKILLed at
8 s, Redis at 20 s, P0 SIGSTOPped from 30 to 50 s (``--schedule-scale``).  Then, every
engine healthy again, the KV-pressure phase (``pressure_shape``: D 655 blocks, 393 with
``--quick``, 8 MiB host tiers; 20 (6) sessions of 1,536-2,048-token openings, 5 (3)
turns alternating 300-500 and 24-64 new tokens, the last after every session's others).
Writes ``soak[_quick].{md,json}`` under ``--out-dir``; exit status 1 when an error falls
outside the killed D's window, an answer differs, or a fault or the phase did not run.
"""

from __future__ import annotations

import argparse
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

from kv_pressure import (COLUMNS, LEGEND, Client, Shape, Turn, build_sessions, details, measure,
                         row, run_traffic, summarize, tiny_model)
from sessionkv_bench import report
from sessionkv_bench.runner import PortPool, log
from sessionkv_bench.stats import pct

from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster, process_tree

OPENING = "soak session {}: the kato is of rimu and senlo. "   # eight times


@dataclass
class Window:
    name: str
    start_s: float
    until: object = None            # closes the window once it returns True
    end_s: float | None = None
    health: list[str] = field(default_factory=list)   # /health answers seen


def pressure_shape(args) -> Shape:
    turns = 3 if args.quick else 5
    per_token = 2 if args.dtype in ("float32", "float") else 1   # 655 (393) blocks
    return Shape(sessions=6 if args.quick else 20,
                 concurrent_turns=turns - 1, final_turns=1, prefix_tokens=(1536, 2048),
                 user_tokens=(24, 64), long_turn_tokens=(300, 500),
                 long_turns=tuple(k for k in range(2, turns + 1) if k % 2 == 0 or k == turns),
                 every_session_long=True, max_tokens=32,
                 decode_kv_cache_gb=(0.012 if args.quick else 0.02) * per_token,
                 kv_cache_gb=0.25, think_s=0.5, proxy_logprobs=False, name="soak-pressure")


def _ready(check) -> bool:
    try:
        return bool(check())
    except Exception:  # noqa: BLE001 - not yet
        return False


def _up(url: str) -> bool:
    return requests.get(url + "/health", timeout=2).status_code == 200


def _health(url: str) -> str:
    """Our proxy's /health: its status and problems."""
    try:
        resp = requests.get(url + "/health", timeout=5)
        problems = "; ".join(resp.json().get("problems", []))
        return f"{resp.status_code} {resp.json().get('status')}" + (
            f": {problems}" if problems else "")
    except (requests.RequestException, ValueError) as exc:
        return f"no answer ({type(exc).__name__})"


class Soak:
    def __init__(self, args, cluster) -> None:
        self.args, self.cluster, self.proxy = args, cluster, cluster.proxy_url
        self.client = Client(self.proxy, cluster.colocated.url, cluster.spec.model,
                             args.max_tokens, proxy_logprobs=False)
        self.windows: list[Window] = []
        self.traffic_done = threading.Event()   # the fault phase's sessions are done
        self.closing = threading.Event()        # the whole run is over
        self.peak_rss, self.counters, self.health_before, self.pressure_wall_s = 0, None, "", 0.0

    def pid(self, name: str) -> int:
        """The current pid of the cluster's process ``name`` (a restart changes it)."""
        return next(p.pid for p in self.cluster.procs if p.name == name)

    def signal(self, name: str, sig: int) -> None:
        for proc in process_tree([self.pid(name)]):
            _ready(lambda: proc.send_signal(sig))

    def session(self, i: int) -> None:
        history, sid = OPENING.format(i) * 8, f"soak-{os.getpid()}-{i}"
        time.sleep(i * self.args.think_s / self.args.sessions)   # staggered starts
        for turn in range(self.args.turns):
            history += f" step {turn}: what of the vaqu and the dramon?"
            got = self.client.send(Turn("faults", i, turn + 1), sid, history)
            history += got["text"] if got else ""
            time.sleep(self.args.think_s)

    def supervise(self) -> None:
        while not self.closing.wait(0.5):
            self.cluster.supervise_once()
            try:
                self.peak_rss = max(self.peak_rss,
                                    psutil.Process(self.pid("proxy")).memory_info().rss)
            except psutil.Error:
                pass
            for w in (w for w in self.windows if w.end_s is None):
                w.health.append(_health(self.proxy))
                if w.until and _ready(w.until):
                    w.end_s = self.client.now()

    def faults(self) -> None:
        """At 8 s (scaled) SIGKILL D0 until it answers /health again, at 20 s Redis
        until the supervisor restarted it, at 30 s SIGSTOP P0 for 20 s."""
        d0, redis, scale = self.cluster.decode[0].url, self.pid("redis"), self.args.schedule_scale
        for at_s, name, proc, sig, until in (
                (8, "D0 killed until healthy again", "decode0", signal.SIGKILL, lambda: _up(d0)),
                (20, "Redis killed until restarted", "redis", signal.SIGKILL,
                 lambda: self.pid("redis") != redis),
                (30, "P0 stopped (SIGSTOP) for 20 s", "prefill0", signal.SIGSTOP, None)):
            while self.client.now() < at_s * scale:
                if self.traffic_done.wait(0.1):
                    return
            start_s = self.client.now()
            self.signal(proc, sig)
            self.windows.append(Window(name, start_s, until))
        try:
            self.traffic_done.wait(20 * scale)
        finally:
            self.signal("prefill0", signal.SIGCONT)
        self.windows[-1].end_s = self.client.now()

    def wait(self, check, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not _ready(check) and time.monotonic() < deadline and not self.closing.wait(0.5):
            pass

    def pressure_phase(self) -> None:
        shape, cluster = self.args.pressure, self.cluster
        engines = {f"P{i}": e.url for i, e in enumerate(cluster.prefill)}
        engines |= {f"D{i}": e.url for i, e in enumerate(cluster.decode)}
        for url in engines.values():
            self.wait(lambda: _up(url), 600)
        self.wait(lambda: _health(self.proxy).startswith("200 ok"), 120)
        self.health_before = _health(self.proxy)
        self.client.max_tokens = shape.max_tokens
        sessions = build_sessions(shape, 0, self.args.vocab_size)
        start = self.client.now()
        self.counters = measure(engines, lambda: run_traffic(
            self.client, sessions, shape, "kv-pressure", f"soak-pressure-{os.getpid()}-{{}}"))
        self.pressure_wall_s = self.client.now() - start

    def run(self) -> None:
        threads = [threading.Thread(target=f, daemon=True) for f in (self.supervise, self.faults)]
        for thread in threads:
            thread.start()
        try:
            with ThreadPoolExecutor(self.args.sessions) as pool:
                list(pool.map(self.session, range(self.args.sessions)))
            self.traffic_done.set()   # faults not yet due are skipped; a stopped P continues
            threads[1].join()
            self.wait(lambda: all(w.end_s is not None for w in self.windows), 600)
            self.pressure_phase()
        finally:
            self.traffic_done.set()
            self.closing.set()
            for thread in threads:
                thread.join(timeout=30)


# =========================================================================== report
def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def summarize_soak(soak: Soak, args) -> tuple[list[str], dict]:
    turns = soak.client.turns
    faults = [t for t in turns if t.phase == "faults"]
    d = next((w for w in soak.windows if w.name.startswith("D0")), None)
    # Running on D0, or sent to it, while it was down (the pressure phase runs after).
    inside = [t for t in faults if not t.ok and d is not None and t.ended_s >= d.start_s
              and (d.end_s is None or t.started_s <= d.end_s)]
    outside = [t for t in turns if not t.ok and all(t is not x for x in inside)]
    wrong = [t for t in turns if t.wrong]
    lat = [t.latency_s for t in faults if t.status == 200]
    missed = [n for n in ("D0", "Redis", "P0") if n not in {w.name.split()[0]
                                                            for w in soak.windows}]
    ps = summarize([t for t in turns if t.phase == "kv-pressure"], soak.counters or {})
    summary = {
        "requests": len(turns), "fault_phase_requests": len(faults),
        "errors_outside_d_window": len(outside), "errors_inside_d_window": len(inside),
        "wrong": len(wrong), "faults_missed": missed,
        "fault_phase": {"latency_p50_s": pct(lat, 0.5), "latency_p99_s": pct(lat, 0.99),
                        "latency_mean_s": statistics.fmean(lat) if lat else None},
        "peak_proxy_rss_mib": round(soak.peak_rss / 2**20),
        "kv_pressure_phase": ps | {"wall_s": round(soak.pressure_wall_s, 1),
                                   "proxy_health_before": soak.health_before},
        "ok": not (outside or wrong or missed or soak.counters is None)}
    shape = args.pressure
    lines = report.table(["measure", "value"], [
        ["engines' dtype", args.dtype],
        ["fault phase: sessions x turns", f"{args.sessions} x {args.turns}"],
        ["KV-pressure phase: sessions x turns",
         f"{shape.sessions} x {shape.concurrent_turns + shape.final_turns}"],
        ["requests", f"{len(turns)} ({len(faults)} + {ps['turns']})"],
        ["client errors outside the D-down window", len(outside)],
        ["client errors inside the D-down window", len(inside)],
        ["wrong answers (token ids differ from the co-located server's)", len(wrong)],
        ["fault phase latency p50 / p99", f"{_s(pct(lat, 0.5))} / {_s(pct(lat, 0.99))}"],
        ["fault phase latency mean", _s(summary["fault_phase"]["latency_mean_s"])],
        ["peak proxy RSS", f"{summary['peak_proxy_rss_mib']} MiB"]])
    lines += ["", "Seconds from the first request. A session whose D was killed sends its "
              "next turn to the other D, so only requests running on the killed D when it "
              "died can fail; they are counted inside the window.", ""]
    lines += report.table(["fault", "from", "to", "/health answers seen"], [
        [w.name, _s(w.start_s), "after the traffic ended" if w.end_s is None else _s(w.end_s),
         "<br>".join(sorted(set(w.health))) or "-"] for w in soak.windows])
    lines += ["", f"KV-pressure phase ({soak.pressure_wall_s:.0f} s; the proxy's /health "
              f"before it: {soak.health_before}): D's KV {shape.decode_kv_cache_gb:g} GiB "
              f"each, {shape.sessions} sessions (`pressure_shape`); counters are P's and D's "
              "deltas over the phase.", "", LEGEND.split(" **poisoned")[0], ""]
    lines += report.table(COLUMNS[:-2], [row(ps)[:-2]]) + ["", details(ps)]
    bad = [t for t in turns if not t.ok or t.wrong]
    lines += ["", "Failed or wrong turns (the JSON has them all):", ""] if bad else []
    lines += [f"- {t.phase} t={t.started_s:.1f}-{t.ended_s:.1f} s session {t.session} turn "
              f"{t.turn}: {f'WRONG {t.divergence}' if t.wrong else f'{t.status} {t.error}'}; "
              f"{t.headers}" for t in bad[:40]]
    if missed:
        lines += ["", f"Faults not reached before the traffic ended: {', '.join(missed)}."]
    if soak.counters is None:
        lines += ["", "The KV-pressure phase did not run to its end."]
    return lines, summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--think-s", type=float, default=5.0,
                   help="pause between turns (agent traces' median is about 5 s)")
    p.add_argument("--schedule-scale", type=float, default=1.0,
                   help="stretch (>1) or shrink the fault schedule")
    p.add_argument("--dtype", default="float32", help="the engines' --dtype")
    p.add_argument("--base-port", type=int, default=0, help="0: any free ports")
    p.add_argument("--quick", action="store_true", help="8 sessions x 8 turns, 2 s apart, "
                   "the schedule at 0.5x; a 6-session x 3-turn pressure phase")
    p.add_argument("--out-dir", type=Path, default=report.OUT_DIR)
    p.add_argument("--no-report", action="store_true", help="print only; write no report")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.think_s, args.schedule_scale = 8, 8, 2.0, 0.5
    args.pressure = pressure_shape(args)
    return args


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    # The supervisor's lines (exited, restarted, healthy) with their times.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("vllm_sessionkv.dev.launch").setLevel(logging.INFO)
    started, meta = time.monotonic(), report.meta("soak.py", raw_argv, {"--out-dir": "OUT_DIR"})
    workdir = Path(tempfile.mkdtemp(prefix="sessionkv-soak-"))
    model, config = tiny_model(workdir)
    args.vocab_size, ports = int(config["vocab_size"]), {}
    if args.base_port:   # engines, the reference and the proxy; UCX's listeners above
        pool = PortPool(args.base_port, args.base_port + 899)
        ports = {"base_port": pool.take(30), "colocated_port": pool.take(),
                 "proxy_port": pool.take()}
        os.environ.setdefault("UCX_TCP_PORT_RANGE", f"{args.base_port + 900}-{args.base_port + 999}")
    cluster = LocalCluster(ClusterSpec(
        model=model, prefill=2, decode=2, colocated=True, redis=True, dtype=args.dtype,
        kv_cache_space_gb=args.pressure.kv_cache_gb, log_dir=workdir / "logs",
        decode_kv_cache_space_gb=args.pressure.decode_kv_cache_gb,
        sessionkv={"host_tier_bytes": 8 * 2**20}, **ports))
    soak = Soak(args, cluster.start())
    log(f"cluster ready in {time.monotonic() - started:.0f} s; logs in {workdir / 'logs'}")
    try:
        soak.run()
    finally:
        cluster.stop()
    meta["wall_s"] = round(time.monotonic() - started, 1)
    lines, summary = summarize_soak(soak, args)
    text = "\n".join(report.head("Load-and-fault soak", meta) + [
        f"{meta['wall_s'] / 60:.1f} min; 2 P + 2 D + Redis + the proxy + a co-located "
        "server.", ""] + lines) + "\n"
    print(text)
    if not args.no_report:
        stem = "soak_quick" if args.quick else "soak"
        report.write(args.out_dir, stem, {
            "meta": meta, "summary": summary, "kv_pressure_counters": soak.counters or {},
            "windows": [{"name": w.name, "start_s": w.start_s, "end_s": w.end_s,
                         "health": sorted(set(w.health))} for w in soak.windows],
            "turns": [t.as_json() for t in sorted(soak.client.turns, key=lambda t: (
                t.phase, t.session, t.turn))]}, text)
        log(f"wrote {args.out_dir / stem}.md and .json")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
