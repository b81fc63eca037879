#!/usr/bin/env python3
"""Load-and-fault soak: concurrent sessions through 2P+2D with Redis while a schedule
kills and restarts a D, restarts Redis and stops a P; then a KV-pressure phase in
which D's KV is too small to hold every session for its next turn.

    flock /tmp/sessionkv-cluster.lock python benchmarks/soak.py --base-port 34000
    python benchmarks/soak.py --quick                # 8 x 8 faults, 6-session pressure phase
    python benchmarks/soak.py --no-kv-pressure       # the fault schedule alone
    python benchmarks/soak.py --model /models/M --gpus 0,1,2,3,4   # GPU host

It starts the cluster itself (``vllm_sessionkv.dev.launch.LocalCluster``, supervised: a
killed engine or Redis is restarted on its ports), plus a co-located plain vLLM
server with the normal KV cache.  Every answer (temperature 0, ``ignore_eos``) is
compared in token ids with the co-located server's answer to the same prompt; for
an answer that differs, the report gives where, and the co-located server's top-5
logprobs there (asked of it alone: on D, logprobs would turn the first-token
handoff off).

**Fault phase.**  ``--sessions`` sessions of ``--turns`` turns each, ``--think-s``
apart; every turn re-sends the whole history as text.  The fault schedule (seconds
after the traffic starts, scaled by ``--schedule-scale``):

* t=8: SIGKILL D0's process group; the supervisor restarts it on its ports;
* t=20: SIGKILL Redis; the supervisor restarts it (empty) on its port;
* t=30: SIGSTOP P0 (and its children) for 20 s, then SIGCONT.

Every engine runs in ``--dtype`` float32: in bfloat16 a plain server's own answer
changes with where a prefix-cache hit splits the prompt (two tokens' logits tie in
bf16 and the tie goes either way), which the comparison would count as wrong.

**KV-pressure phase** (on unless ``--no-kv-pressure``).  Then each D runs with
``--decode-kv-cache-gb`` of KV (0.04 GiB in float32: 655 blocks of 32 tokens of the
tiny model; 393 with ``--quick``) for the whole run, P and the co-located server with
``--kv-cache-gb``, and every engine with an 8 MiB host tier (``host_tier_bytes``;
``--host-tier-mib``).  Once the fault schedule is over and every engine answers
``/health`` again, ``--pressure-sessions`` new sessions (20; 6 with ``--quick``) run
concurrently, in token ids: each opens with a 1,536-2,048-token history, and its
turns alternate large increments (300-500 tokens, above the proxy's 256-token
decode-only bound, so sent through P) with small ones (24-64 tokens; the last turn
is a large one), ``--pressure-max-tokens`` (32) tokens answered each turn.  Their
session holds pin more than ``session_hold_max_kv_fraction`` of D's KV, so D ends
the oldest early (``kv_pressure``) while P pulls from D; the last turn of every
session waits until every session has sent the others, so that it asks for KV whose
hold other sessions' turns have ended.  The phase reports its turns, errors, wrong
answers, the turns in which P pulled from D (P's accounting, which the proxy relays
in ``x-sessionkv-prefill``), and the deltas of every ``sessionkv_*`` and
``vllm:nixl_*`` counter of the P and D engines over the phase: holds ended for
``kv_pressure``, pull-guard fallbacks by reason, the holders' claims, deferred frees,
pull failures, pull decisions, NIXL notifications after expiry.

It prints, and writes to ``docs/benchmarks/soak.md`` and ``.json`` (``--out-dir``;
with ``--quick`` ``soak_quick.*``, and nothing with ``--no-report``): requests,
client errors inside and outside the window in which the killed D was down (the
pressure phase runs after it, so each of its errors is outside), wrong answers,
latency p50/p99, peak proxy RSS, what ``/health`` said during each fault, and every
failed or wrong turn with its proxy request id, route and P's and D's accounting.
Exit status 1 when an error falls outside the D window, any answer differs, a fault
was not reached or the pressure phase did not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import os
import random
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

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

from sessionkv_bench.client import accounting  # noqa: E402
from sessionkv_bench.metrics import counter_deltas, counter_sum, counters_by_label, engine_counters
from sessionkv_bench.report import machine_line
from sessionkv_bench.runner import PortPool
from sessionkv_bench import report  # noqa: E402
from sessionkv_bench.stats import pct  # noqa: E402

OUT_DIR = REPO / "docs" / "benchmarks"
PATH_FLAGS = {"--out-dir": "OUT_DIR", "--model": "MODEL_DIR", "--log-dir": "LOG_DIR"}
SESSION_HEADER = "X-Session-ID"
FIRST_TOKEN_ID = 10      # below: the tiny model's special tokens
MAX_MODEL_LEN = 4096     # the launcher's default, which the engines run with


@dataclass
class Outcome:
    phase: str             # "faults" or "kv-pressure"
    session: int
    turn: int              # 1-based
    started_s: float
    ended_s: float
    status: int            # HTTP status, or 0 for a broken connection
    prompt_tokens: int = 0     # kv-pressure phase (token-id prompts)
    error: str = ""
    mismatch: bool = False
    request_id: str = ""
    route: str = ""
    prefill_engine: str = ""
    decode_engine: str = ""
    prefill: dict = field(default_factory=dict)   # P's accounting (x-sessionkv-prefill)
    decode: dict = field(default_factory=dict)    # D's accounting (x-sessionkv-decode)
    token_ids: list[int] = field(default_factory=list)
    reference_ids: list[int] = field(default_factory=list)
    prompt: str | list[int] = ""     # kept in the JSON for a failed or wrong turn
    # For a wrong answer: where it first differs, and the co-located server's top-5
    # logprobs there (the margin by which its token beat ours, when ours is in them).
    divergence: dict = field(default_factory=dict)

    @property
    def pulled_tokens(self) -> int:
        return int(self.prefill.get("pulled_from_peer_tokens", 0) or 0)


@dataclass
class Window:
    name: str
    start_s: float
    end_s: float | None = None
    health: list[str] = field(default_factory=list)   # /health statuses seen


@dataclass(frozen=True)
class PressureShape:
    sessions: int
    turns: int                        # the last one after every session's others
    prefix_tokens: tuple[int, int] = (1536, 2048)
    small_tokens: tuple[int, int] = (24, 64)
    large_tokens: tuple[int, int] = (300, 500)   # above the proxy's 256-token decode-only bound
    max_tokens: int = 32
    think_s: float = 0.5


def _body(model: str, prompt: str | list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}



def _divergence(ours: list[int], ref: list[int], base: dict) -> dict:
    """Where ``ours`` first differs from ``ref``, with the reference's top-5 there."""
    at = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    tops = ((base.get("logprobs") or {}).get("top_logprobs") or [])
    top = tops[at] if at < len(tops) else {}
    out = {"index": at, "ours": ours[at] if at < len(ours) else None,
           "reference": ref[at] if at < len(ref) else None, "reference_top5": top}
    vals = sorted(top.values(), reverse=True)
    if len(vals) >= 2:
        out["reference_top1_top2_gap"] = round(vals[0] - vals[1], 6)
    mine = top.get(f"token_id:{out['ours']}")   # keys: return_tokens_as_token_ids
    if mine is not None and vals:
        out["ours_below_reference_by"] = round(vals[0] - mine, 6)
    return out


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


# =========================================================================== the soak
class Soak:
    def __init__(self, args, cluster) -> None:
        self.args, self.cluster = args, cluster
        self.model = cluster.spec.served_model_name or cluster.spec.model
        self.proxy = cluster.proxy_url
        self.colocated = cluster.colocated.url
        self.outcomes: list[Outcome] = []
        self.windows: list[Window] = []
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.traffic_done = threading.Event()   # the fault phase's sessions are done
        self.closing = threading.Event()        # the whole run is over
        self.peak_rss = 0
        self.pressure: dict = {}
        self.faults_end_s: float | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ one turn
    def send(self, out: Outcome, sid: str, prompt: str | list[int], max_tokens: int
             ) -> dict | None:
        """One turn through the proxy, checked against the co-located server; the
        proxy's answer (None when it failed)."""
        body = _body(self.model, prompt, max_tokens)
        out.prompt = prompt
        got = None
        try:
            resp = requests.post(self.proxy + "/v1/completions", json=body,
                                 headers={SESSION_HEADER: sid}, timeout=300)
            out.status = resp.status_code
            out.request_id = resp.headers.get("x-sessionkv-request-id", "")
            out.route = resp.headers.get("x-sessionkv-route", "")
            out.prefill_engine = resp.headers.get("x-sessionkv-prefill-engine", "")
            out.decode_engine = resp.headers.get("x-sessionkv-decode-engine", "")
            out.prefill = accounting(resp.headers.get("x-sessionkv-prefill"))
            out.decode = accounting(resp.headers.get("x-sessionkv-decode"))
            if resp.status_code != 200:
                out.error = resp.text[:300]
            else:
                got = resp.json()["choices"][0]
        except (requests.RequestException, ValueError, KeyError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:300]
        out.ended_s = self.now()
        if got is not None:
            out.token_ids = list(got.get("token_ids") or [])
            try:
                # Logprobs from the reference only: on D they would change the path
                # under test (no first-token handoff with logprobs).
                base = requests.post(self.colocated + "/v1/completions",
                                     json={**body, "logprobs": 5,
                                           "return_tokens_as_token_ids": True},
                                     timeout=300).json()["choices"][0]
                out.reference_ids = list(base.get("token_ids") or [])
                out.mismatch = out.token_ids != out.reference_ids
                if out.mismatch:
                    out.divergence = _divergence(out.token_ids, out.reference_ids, base)
            except (requests.RequestException, ValueError, KeyError) as exc:
                out.error = f"co-located server: {type(exc).__name__}: {exc}"[:300]
        with self.lock:
            self.outcomes.append(out)
        return got

    # ------------------------------------------------------------------ fault phase
    def session(self, i: int) -> None:
        args = self.args
        history = f"soak session {i}: the kato is of rimu and senlo. " * args.prefix_repeats
        sid = f"soak-{os.getpid()}-{i}"
        time.sleep(i * args.think_s / max(1, args.sessions))   # staggered starts
        for turn in range(args.turns):
            history += f" step {turn}: what of the vaqu and the dramon?"
            started = self.now()
            got = self.send(Outcome("faults", i, turn + 1, started, started, 0), sid,
                            history, args.max_tokens)
            if got is not None:
                history += got["text"]
            time.sleep(args.think_s)

    def supervise(self) -> None:
        while not self.closing.is_set():
            self.cluster.supervise_once()
            try:
                proxy_pid = _pid_listening(int(self.proxy.rsplit(":", 1)[1]))
                self.peak_rss = max(self.peak_rss, psutil.Process(proxy_pid).memory_info().rss)
            except (RuntimeError, psutil.Error):
                pass
            for window in self.windows:
                if window.end_s is None:
                    window.health.append(_health(self.proxy))
            self.closing.wait(0.5)

    def _at(self, t: float) -> bool:
        """Wait until ``t`` seconds (scaled) into the run; False if the traffic ended."""
        while self.now() < t * self.args.schedule_scale:
            if self.traffic_done.wait(0.1):
                return False
        return not self.traffic_done.is_set()

    def _wait_healthy(self, url: str, timeout_s: float = 600.0) -> bool:
        """Until ``url`` answers /health with 200 (True), or the run ends (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            if self.closing.wait(0.5):
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
        while not self.closing.wait(0.2):
            try:
                _pid_listening(port)
                break
            except RuntimeError:
                pass
        window.end_s = self.now() if not self.closing.is_set() else None

    def stop_prefill(self) -> None:
        """t=30: SIGSTOP P0 and its children for 20 s."""
        url = self.cluster.prefill[0].url
        if not self._at(30):
            return
        window = self._open("P0 stopped (SIGSTOP) for 20 s")
        p0 = _pid_listening(int(url.rsplit(":", 1)[1]))
        _signal_tree(p0, signal.SIGSTOP)
        try:
            self.traffic_done.wait(20 * self.args.schedule_scale)
        finally:
            _signal_tree(p0, signal.SIGCONT)
        window.end_s = self.now()

    # ------------------------------------------------------------------ pressure phase
    def _engines(self) -> dict[str, str]:
        named = {f"P{i}": e.url for i, e in enumerate(self.cluster.prefill)}
        named.update({f"D{i}": e.url for i, e in enumerate(self.cluster.decode)})
        return named

    def _settle(self, timeout_s: float = 300.0) -> str:
        """Until every engine answers /health and the proxy says ok; what it said last."""
        for url in self._engines().values():
            self._wait_healthy(url, timeout_s)
        deadline = time.monotonic() + 120
        said = _health(self.proxy)
        while not said.startswith("200 ok") and time.monotonic() < deadline:
            if self.closing.wait(1.0):
                break
            said = _health(self.proxy)
        return said

    def pressure_phase(self) -> None:
        args, shape = self.args, self.args.pressure
        rec: dict = {"shape": dataclasses.asdict(shape)}
        self.pressure = rec
        rec["proxy_health_before"] = self._settle()
        engines = self._engines()
        rng_vocab = args.vocab_size
        sessions = []
        for i in range(shape.sessions):
            rng = random.Random(f"soak-pressure/{args.seed}/{i}")

            def ids(lo_hi: tuple[int, int]) -> list[int]:
                return [rng.randrange(FIRST_TOKEN_ID, rng_vocab)
                        for _ in range(rng.randint(*lo_hi))]

            adds = [ids(shape.prefix_tokens) + ids(shape.small_tokens)]
            for k in range(2, shape.turns + 1):
                large = k % 2 == 0 or k == shape.turns   # the last one goes through P
                adds.append(ids(shape.large_tokens if large else shape.small_tokens))
            sessions.append(adds)
        histories: dict[int, list[int]] = {}
        sid = f"soak-pressure-{os.getpid()}-{{}}"
        alive = set(range(shape.sessions))

        def turn(i: int, k: int) -> bool:
            prompt = histories.get(i, []) + sessions[i][k - 1]
            started = self.now()
            out = Outcome("kv-pressure", i, k, started, started, 0, prompt_tokens=len(prompt))
            got = self.send(out, sid.format(i), prompt, shape.max_tokens)
            if got is None:
                alive.discard(i)   # a session stops at its first failed turn
                return False
            histories[i] = prompt + out.token_ids   # kept as answered, as an agent does
            return True

        def early(i: int) -> None:
            time.sleep(i * shape.think_s / max(1, shape.sessions))
            for k in range(1, shape.turns):
                if not turn(i, k):
                    return
                time.sleep(shape.think_s)

        def last(i: int) -> None:
            if i in alive:
                turn(i, shape.turns)

        before = {name: engine_counters(url) for name, url in engines.items()}
        rec["start_s"] = self.now()
        with ThreadPoolExecutor(shape.sessions) as pool:
            list(pool.map(early, range(shape.sessions)))
        with ThreadPoolExecutor(shape.sessions) as pool:
            list(pool.map(last, range(shape.sessions)))
        rec["end_s"] = self.now()
        time.sleep(2.0)   # the engines' stat loggers catch up with the last turn
        after = {name: engine_counters(url) for name, url in engines.items()}
        rec["counters"] = {name: counter_deltas(before[name], after[name])
                           for name in engines}
        rec["negative"] = sorted(f"{name} {k}" for name, c in rec["counters"].items()
                                 for k, v in c.items() if v < 0)   # an engine restarted

    def run(self) -> None:
        supervisor = threading.Thread(target=self.supervise, daemon=True)
        faults = [threading.Thread(target=f, daemon=True)
                  for f in (self.kill_decode, self.kill_redis, self.stop_prefill)]
        supervisor.start()
        for fault in faults:
            fault.start()
        try:
            with ThreadPoolExecutor(self.args.sessions) as pool:
                list(pool.map(self.session, range(self.args.sessions)))
            self.traffic_done.set()   # faults not yet due are skipped; a stopped P continues
            for thread in faults:
                thread.join(timeout=600)
            self.faults_end_s = self.now()
            if self.args.pressure is not None:
                self.pressure_phase()
        finally:
            self.traffic_done.set()
            self.closing.set()
            for thread in (*faults, supervisor):
                thread.join(timeout=30)


# =========================================================================== report
def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _turn_line(o: Outcome) -> str:
    what = "WRONG" if o.mismatch else f"{o.status} {o.error}".strip()
    if o.divergence:
        dv = o.divergence
        what += (f" from answer token {dv['index']} (ours {dv['ours']}, the reference's "
                 f"{dv['reference']}; there the reference's top-1/top-2 logprob gap is "
                 f"{dv.get('reference_top1_top2_gap', float('nan')):.4f}, ours "
                 + (f"{dv['ours_below_reference_by']:.4f} below its top-1"
                    if "ours_below_reference_by" in dv else "not in its top 5") + ")")
    acct = []
    if o.prefill:
        acct.append(f"P {json.dumps(o.prefill, sort_keys=True)}")
    if o.decode:
        acct.append(f"D {json.dumps(o.decode, sort_keys=True)}")
    return (f"- {o.phase} t={o.started_s:.1f}-{o.ended_s:.1f} s session {o.session} turn "
            f"{o.turn}: {what}; request {o.request_id or '-'}, route {o.route or '-'}, "
            f"P {o.prefill_engine or '-'}, D {o.decode_engine or '-'}"
            + (f"; {'; '.join(acct)}" if acct else ""))


def summarize(soak: Soak, args) -> tuple[str, dict, bool]:
    faults = [o for o in soak.outcomes if o.phase == "faults"]
    pressure = [o for o in soak.outcomes if o.phase == "kv-pressure"]
    d_window = next((w for w in soak.windows if w.name.startswith("D0")), None)

    def in_d_window(o: Outcome) -> bool:
        # A fault-phase request that was running on D0, or was sent to it, while it
        # was down.  The pressure phase starts after D0 is back: never inside.
        return o.phase == "faults" and d_window is not None and o.ended_s >= d_window.start_s \
            and (d_window.end_s is None or o.started_s <= d_window.end_s)

    errors = [o for o in soak.outcomes if o.status != 200 or o.error]
    error_ids = {id(o) for o in errors}
    inside = [o for o in errors if in_d_window(o)]
    outside = [o for o in errors if not in_d_window(o)]
    wrong = [o for o in soak.outcomes if o.mismatch]

    def lat(os_: list[Outcome]) -> list[float]:
        return [o.ended_s - o.started_s for o in os_ if o.status == 200]

    lf, lp = lat(faults), lat(pressure)
    summary = {
        "requests": len(soak.outcomes), "fault_phase_requests": len(faults),
        "errors_outside_d_window": len(outside), "errors_inside_d_window": len(inside),
        "wrong": len(wrong),
        "fault_phase": {"requests": len(faults),
                        "errors": sum(id(o) in error_ids for o in faults),
                        "wrong": sum(o.mismatch for o in faults),
                        "latency_p50_s": pct(lf, 0.5), "latency_p99_s": pct(lf, 0.99),
                        "latency_mean_s": statistics.fmean(lf) if lf else None},
        "peak_proxy_rss_mib": round(soak.peak_rss / 2**20),
    }
    lines = [
        "| measure | value |", "|---|---|",
        f"| engines' dtype | {args.dtype} |",
        f"| fault phase: sessions x turns | {args.sessions} x {args.turns} |",
    ]
    pr = soak.pressure
    if args.pressure is not None:
        shape = args.pressure
        lines.append(f"| KV-pressure phase: sessions x turns | "
                     f"{shape.sessions} x {shape.turns} |")
    lines += [
        f"| requests | {len(soak.outcomes)} ({len(faults)} + {len(pressure)}) |",
        f"| client errors outside the D-down window | {len(outside)} |",
        f"| client errors inside the D-down window | {len(inside)} |",
        f"| wrong answers (token ids differ from the co-located server's) | {len(wrong)} |",
        f"| fault phase latency p50 / p99 | {_secs(pct(lf, 0.5))} / {_secs(pct(lf, 0.99))} |",
        f"| fault phase latency mean | {statistics.fmean(lf) if lf else float('nan'):.2f} s |",
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
    missed_pressure = args.pressure is not None and "counters" not in pr
    if args.pressure is not None and pr:
        counters = pr.get("counters", {})
        p_sum: dict[str, float] = {}
        d_sum: dict[str, float] = {}
        for name, c in counters.items():
            target = p_sum if name.startswith("P") else d_sum
            for k, v in c.items():
                target[k] = target.get(k, 0.0) + v
        pulled = [o for o in pressure if o.pulled_tokens > 0]
        routes: dict[str, int] = {}
        for o in pressure:
            routes[o.route or "-"] = routes.get(o.route or "-", 0) + 1
        fallbacks = counters_by_label({**p_sum}, "sessionkv_pull_guard_fallbacks_total")
        d_fallbacks = counters_by_label(d_sum, "sessionkv_pull_guard_fallbacks_total")
        for k, v in d_fallbacks.items():
            fallbacks[k] = fallbacks.get(k, 0.0) + v
        released = counters_by_label(d_sum, "sessionkv_session_holds_released_total")
        claims = counters_by_label(d_sum, "sessionkv_guard_claims_total")      # D as holder
        p_claims = counters_by_label(p_sum, "sessionkv_guard_claims_total")    # P as holder
        decisions = counters_by_label(p_sum, "sessionkv_pull_decisions_total")
        perr = [o for o in pressure if id(o) in error_ids]
        nz = lambda d: ", ".join(f"{k} {v:g}" for k, v in sorted(d.items()) if v) or "0"  # noqa: E731
        psum = {
            "sessions": args.pressure.sessions, "turns": len(pressure),
            "errors": len(perr), "wrong": sum(o.mismatch for o in pressure),
            "pulled_turns": len(pulled),
            "pulled_tokens": sum(o.pulled_tokens for o in pressure),
            "routes": routes,
            "kv_pressure_releases": released.get("kv_pressure", 0.0),
            "holds_released": released,
            "guard_fallbacks": fallbacks,
            "guard_claims_on_d": claims, "guard_claims_on_p": p_claims,
            "guard_deferred_frees": counter_sum(d_sum, "sessionkv_guard_deferred_frees")
            + counter_sum(p_sum, "sessionkv_guard_deferred_frees"),
            "pull_failures": counter_sum(p_sum, "sessionkv_pull_failures"),
            "pull_decisions_p": decisions,
            "nixl_notifications_after_expiry":
                counter_sum(p_sum, "nixl_num_notifications_after_expiry")
                + counter_sum(d_sum, "nixl_num_notifications_after_expiry"),
            "host_restored_blocks": counter_sum(d_sum, "sessionkv_host_restored_blocks")
            + counter_sum(p_sum, "sessionkv_host_restored_blocks"),
            "latency_p50_s": pct(lp, 0.5), "latency_p99_s": pct(lp, 0.99),
            "wall_s": round(pr.get("end_s", 0) - pr.get("start_s", 0), 1),
            "negative_deltas": pr.get("negative", []),
        }
        summary["kv_pressure_phase"] = psum
        shape = args.pressure
        lines += [
            "", "KV-pressure phase (after the fault schedule, every engine healthy again; "
            f"D's KV {args.decode_kv_cache_gb:g} GiB each, host tier "
            f"{args.host_tier_mib:g} MiB per engine; {shape.sessions} sessions opening with "
            f"{shape.prefix_tokens[0]:,}-{shape.prefix_tokens[1]:,} tokens, increments "
            f"alternating {shape.large_tokens[0]}-{shape.large_tokens[1]} and "
            f"{shape.small_tokens[0]}-{shape.small_tokens[1]} tokens, {shape.max_tokens} "
            f"tokens answered; counters are the P and D engines' deltas over the phase):",
            "", "| measure | value |", "|---|---|",
            f"| turns | {psum['turns']} in {psum['wall_s']:.0f} s |",
            f"| errors | {psum['errors']} |",
            f"| wrong answers | {psum['wrong']} |",
            f"| routes | {nz(routes)} |",
            f"| turns in which P pulled from D (P's accounting) | {psum['pulled_turns']} "
            f"({psum['pulled_tokens']:,} tokens) |",
            f"| P's pull decisions | {nz(decisions)} |",
            f"| D's holds ended, by reason | {nz(released)} |",
            f"| of them for kv_pressure | {psum['kv_pressure_releases']:g} |",
            f"| pull-guard fallbacks to recompute, by reason | {nz(fallbacks)} |",
            f"| guard claims D answered (D holding, P reading) | {nz(claims)} |",
            f"| guard claims P answered (P holding, D reading) | {nz(p_claims)} |",
            f"| guard deferred frees | {psum['guard_deferred_frees']:g} |",
            f"| pull failures | {psum['pull_failures']:g} |",
            f"| NIXL notifications after expiry | {psum['nixl_notifications_after_expiry']:g} |",
            f"| host-tier blocks restored | {psum['host_restored_blocks']:g} |",
            f"| latency p50 / p99 | {psum['latency_p50_s']:.2f} s / "
            f"{psum['latency_p99_s']:.2f} s |",
        ]
        if psum["negative_deltas"]:
            lines += ["", "Counters that went down (an engine restarted during the phase): "
                      + ", ".join(psum["negative_deltas"])]
        if pr.get("proxy_health_before", "").split(":")[0] != "200 ok":
            lines += ["", f"The proxy's /health before the phase: {pr['proxy_health_before']}"]
    bad = [o for o in soak.outcomes if id(o) in error_ids or o.mismatch]
    if bad:
        lines += ["", "Failed or wrong turns:", ""]
        lines += [_turn_line(o) for o in bad[:40]]
        if len(bad) > 40:
            lines.append(f"- ... and {len(bad) - 40} more (in the JSON)")
    reached = {w.name.split(" ")[0] for w in soak.windows}
    missed = [name for name in ("D0", "Redis", "P0") if name not in reached]
    if missed:
        lines += ["", f"Faults not reached before the traffic ended: {', '.join(missed)} "
                      "(raise --turns or --think-s, or lower --schedule-scale)."]
    if missed_pressure:
        lines += ["", "The KV-pressure phase did not run to its end."]
    summary["faults_missed"] = missed
    ok = not outside and not wrong and not missed and not missed_pressure
    summary["ok"] = ok
    return "\n".join(lines), summary, ok


def _free_run(start: int, n: int, last: int) -> int:
    """The first port from ``start`` at which ``n`` consecutive ports up to ``last``
    are free on loopback."""
    for first in range(start, last - n + 2):
        if all(PortPool._free(p) for p in range(first, first + n)):
            return first
    raise RuntimeError(f"no {n} consecutive free ports in {start}-{last}")


def _cluster(local_cluster, spec, decode_kv_gb: float | None):
    """``LocalCluster(spec)``; with ``decode_kv_gb``, its D engines get that KV (for a
    launcher whose ClusterSpec has no ``decode_kv_cache_space_gb``)."""
    if decode_kv_gb is None:
        return local_cluster(spec)

    class SmallDecode(local_cluster):
        def _engine(self, role, index, name):
            engine = super()._engine(role, index, name)
            if role == "decode":
                engine.kv_cache_space_gb = decode_kv_gb
            return engine

    return SmallDecode(spec)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    p.add_argument("--no-kv-pressure", action="store_true",
                   help="skip the KV-pressure phase (D keeps --kv-cache-gb, no host tier)")
    p.add_argument("--pressure-sessions", type=int,
                   help="KV-pressure phase sessions (default 20; 6 with --quick)")
    p.add_argument("--pressure-turns", type=int,
                   help="KV-pressure phase turns per session (default 5; 3 with --quick)")
    p.add_argument("--pressure-max-tokens", type=int, default=32)
    p.add_argument("--decode-kv-cache-gb", type=float,
                   help="each D's KV cache in GiB with the KV-pressure phase (default: 655 "
                        "blocks, 393 with --quick: 0.04 / 0.024 GiB in float32, half in "
                        "bfloat16)")
    p.add_argument("--host-tier-mib", type=float, default=8.0,
                   help="host_tier_bytes of every engine with the KV-pressure phase (0: off)")
    p.add_argument("--seed", type=int, default=0, help="the pressure phase's token ids")
    p.add_argument("--model", help="model directory (default: a tiny random Llama)")
    p.add_argument("--gpus", help="CUDA_VISIBLE_DEVICES per engine, comma-separated")
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--dtype", default="float32",
                   help="engines' --dtype.  float32 by default: in bfloat16 on this CPU "
                        "build a plain vLLM server's answer depends on where a prefix-cache "
                        "hit splits the prompt (a tie between two tokens' bf16 logits goes "
                        "either way), so a comparison with the reference could not tell "
                        "wrong KV from noise")
    p.add_argument("--base-port", type=int, default=0,
                   help="engines count up from the first 30 free ports from here, the "
                        "co-located server and the proxy at the first free port from +400 "
                        "and +500, UCX's listeners within +900..+999 (0: any free ports)")
    p.add_argument("--quick", action="store_true",
                   help="8 sessions x 8 turns, 2 s apart, the schedule at 0.5x; a 6-session "
                        "x 3-turn pressure phase on a 393-block D")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR,
                   help="where soak.md and soak.json go (soak_quick.* with --quick)")
    p.add_argument("--no-report", action="store_true", help="print only; write no report")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.think_s, args.schedule_scale = 8, 8, 2.0, 0.5
    if args.no_kv_pressure:
        args.pressure = None
    else:
        args.pressure = PressureShape(
            sessions=args.pressure_sessions or (6 if args.quick else 20),
            turns=args.pressure_turns or (3 if args.quick else 5),
            max_tokens=args.pressure_max_tokens)
        shape = args.pressure
        if shape.turns < 2 or shape.sessions < 1:
            p.error("--pressure-turns must be 2 or more and --pressure-sessions 1 or more")
        longest = (shape.prefix_tokens[1] + shape.turns * shape.max_tokens
                   + sum((shape.large_tokens if k % 2 == 0 or k == shape.turns
                          else shape.small_tokens)[1] for k in range(1, shape.turns + 1)))
        if longest > MAX_MODEL_LEN:
            p.error(f"the pressure phase's last prompt and answer may reach {longest} "
                    f"tokens, over the engines' {MAX_MODEL_LEN}: fewer --pressure-turns "
                    "or --pressure-max-tokens")
        if args.decode_kv_cache_gb is None:
            # 655 blocks of the tiny model (393 with --quick), whatever the dtype.
            per_token = 2 if args.dtype in ("float32", "float") else 1
            args.decode_kv_cache_gb = (0.012 if args.quick else 0.02) * per_token
    return args


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)

    from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster

    # The supervisor's lines (exited, restarted, healthy) with their times.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("vllm_sessionkv.dev.launch").setLevel(logging.INFO)

    started = time.monotonic()
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": report.git("rev-parse", "--short=12", "HEAD"),
            # Files the run loads that differed from that commit (others' edits).
            "uncommitted": report.git("status", "--porcelain", "--", "vllm_sessionkv",
                                "proxy").splitlines(),
            "machine": machine_line(),
            "command": report.public_command("soak.py", raw_argv, PATH_FLAGS)}
    workdir = Path(tempfile.mkdtemp(prefix="sessionkv-soak-"))
    model = args.model
    if model is None:
        from vllm_sessionkv.dev.tiny_model import generate_tiny_model

        model = str(generate_tiny_model(workdir / "tiny-llama", seed=0))
    args.vocab_size = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    sessionkv: dict = {}
    kw: dict = {}
    if args.pressure is not None:
        if args.host_tier_mib > 0:
            sessionkv["host_tier_bytes"] = int(args.host_tier_mib * 2**20)
        kw["decode_kv_cache_space_gb"] = args.decode_kv_cache_gb
    if args.base_port:
        os.environ.setdefault("UCX_TCP_PORT_RANGE",
                              f"{args.base_port + 900}-{args.base_port + 999}")
    if "decode_kv_cache_space_gb" in kw and not hasattr(ClusterSpec, "decode_kv_cache_space_gb"):
        decode_kv = kw.pop("decode_kv_cache_space_gb")   # a launcher without the option
    else:
        decode_kv = None
    for attempt in range(3):
        if args.base_port:
            # Other processes' outgoing connections take ephemeral ports in this range
            # too: start where a run of free ports is, and again further on if a bind
            # still lost the race.
            kw.update(base_port=_free_run(args.base_port + 20 * attempt, 30,
                                          args.base_port + 399),
                      colocated_port=_free_run(args.base_port + 400, 1, args.base_port + 499),
                      proxy_port=_free_run(args.base_port + 500, 1, args.base_port + 599))
        spec = ClusterSpec(model=model, prefill=2, decode=2, colocated=True, redis=True,
                           kv_cache_space_gb=args.kv_cache_gb, log_dir=workdir / "logs",
                           sessionkv=sessionkv, engine_extra_args=["--dtype", args.dtype],
                           gpus=args.gpus.split(",") if args.gpus else None, **kw)
        cluster = _cluster(LocalCluster, spec, decode_kv)
        try:
            cluster.start()
            break
        except Exception as exc:  # noqa: BLE001 - a port taken under us: try once more
            if attempt == 2 or not args.base_port:
                raise
            print(f"cluster did not start ({type(exc).__name__}: {str(exc)[:200]}); "
                  "again on other ports", flush=True)
    print(f"cluster ready in {time.monotonic() - started:.0f} s; logs in {spec.log_dir}",
          flush=True)
    soak = Soak(args, cluster)
    try:
        soak.run()
    finally:
        cluster.stop()
    meta["wall_s"] = round(time.monotonic() - started, 1)
    table, summary, ok = summarize(soak, args)
    print(table)
    print(f"wall {meta['wall_s'] / 60:.1f} min; logs in {spec.log_dir}")
    if not args.no_report:
        stem = "soak_quick" if args.quick else "soak"
        args.out_dir.mkdir(parents=True, exist_ok=True)
        dirty = (f"  Files under vllm_sessionkv/ and proxy/ that differed from that commit "
                 f"when it ran: {', '.join(x[3:] for x in meta['uncommitted'])}."
                 if meta["uncommitted"] else "")
        (args.out_dir / f"{stem}.md").write_text(
            "# Load-and-fault soak\n\n"
            f"`{meta['command']}`, {meta['date']}, commit {meta['commit']}, "
            f"{meta['wall_s'] / 60:.1f} min; 2 P + 2 D + Redis + the proxy + a co-located "
            f"server. Machine: {meta['machine']}.{dirty}\n\n" + table + "\n")
        data = {"meta": meta, "summary": summary,
                "windows": [dataclasses.asdict(w) | {"health": sorted(set(w.health))}
                            for w in soak.windows],
                "kv_pressure_counters": soak.pressure.get("counters", {}),
                "turns": [{k: v for k, v in dataclasses.asdict(o).items()
                           if v not in ("", [], {}) and k not in ("token_ids",
                                                                  "reference_ids", "prompt")}
                          | ({"token_ids": o.token_ids, "reference_ids": o.reference_ids}
                             if o.mismatch else {})
                          | ({"prompt": o.prompt} if o.mismatch or o.status != 200
                             or o.error else {})
                          for o in sorted(soak.outcomes,
                                          key=lambda o: (o.phase, o.session, o.turn))]}
        (args.out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.out_dir / stem}.md and .json")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
