#!/usr/bin/env python3
"""Interference: does splitting P and D beat co-located chunked prefill on this traffic?
``flock /tmp/sessionkv-cluster.lock python benchmarks/interference.py [--quick]``

Victims (short prompts streamed back to back) run while long prompts arrive at a constant
rate: two aiperf runs started together, seeded per rate.  Arms, two servers each: coloc-N
(two co-located engines, chunked prefill budget N, behind our proxy), pd-defaults (1 P +
1 D, our connector and proxy), pd-forced (a second proxy on them, every request via P).
Every step (arm, rate) starts from reset caches; its window is [t0 + warm_s, t0 +
duration_s], t0 the first long prompt's send (rate 0: the first victim's).  Measured:
victims' ITL over the gaps between streamed chunks (aiperf's chunk times) and by the
engines' histogram, long prompts' TTFT, per pool requests, queueing and KV moved; per arm
the goodput (the highest rate at which it and every lower one met both p99 targets); a
verdict.  Fairness (``check_configs``, pure): engines' resolved configs (``/server_info``)
may differ only in the arms' knobs (chunked-prefill budget, KV connector) and per-server
keys, else exit 2 naming the key (say prefix caching on one side only) unless
``--allow-diff KEY``; ``--check-only`` checks only that.  aiperf's prompts must match too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from sessionkv_bench import aiperf, report
from sessionkv_bench import arms as armlib
from sessionkv_bench.metrics import histogram_buckets, histogram_quantile, metric_sums
from sessionkv_bench.runner import PortPool, log
from sessionkv_bench.stats import pct

from vllm_sessionkv.dev.tiny_model import BENCH_MODEL_SIZE, generate_tiny_model

PORTS, UCX_PORTS = (32000, 32899), "32900-32999"   # this bench's own range
FULL = {"max_num_batched_tokens": "256,1024", "rates": "0,0.5,1,1.5", "duration_s": 20.0,
        "warm_s": 4.0, "prompt_tokens": 1536}
QUICK = {"max_num_batched_tokens": "256", "rates": "0,1", "duration_s": 10.0, "warm_s": 3.0,
         "prompt_tokens": 1024}
# startup_slack_s: victims run that much longer than a step, as aiperf's two runs take
# 8-22 s each to start (the injector 17.7 s after the victims in one quick run).
FLAGS = {"victims": 4, "victim_prompt_tokens": 64, "victim_max_tokens": 64,
         "injected_max_tokens": 8, "ttft_target_ms": 3000.0, "itl_target_ms": 100.0,
         "blocks": 512, "max_model_len": 2048, "startup_slack_s": 30.0, "drain_s": 30.0,
         "seed": 0, "dtype": "float32", "cores": "auto", "pd_modes": "defaults,forced",
         "coloc_extra_args": "", "pd_extra_args": "", "gpus": ""}   # gpus: one per engine
PD_ARMS = {"defaults": ("7-ours", "P/D, proxy defaults"),
           "forced": ("7-ours-pd", "P/D, every request via P")}
COUNTERS = ("vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
            "vllm:request_queue_time_seconds_count", "vllm:nixl_bytes_transferred_sum")
ENGINE_ITL = "vllm:inter_token_latency_seconds"   # stamped by the engine core

# Fairness: the keys the arms exist to vary (vLLM derives the encoder budget, the compile
# ranges and a fusion bound from max_num_batched_tokens), and those of one server.
KNOBS = (r"^scheduler_config\.(max_num_batched_tokens|max_num_encoder_input_tokens|"
         r"encoder_cache_size)$", r"^compilation_config\.compile_ranges_endpoints$",
         r"^compilation_config\.pass_config\.rope_kvcache_fusion_max_token_num$",
         r"^kv_transfer_config(\.|$)")
INSTANCE = (r"(^|\.)instance_id$", r"(^|[._])(\w+_)?port(_list)?$", r"endpoint$",
            r"(_host|_ip|_addr)$", r"^env\.VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME$",
            r"^compilation_config\.(compilation_time|encoder_compilation_time|traced_files|"
            r"local_cache_dir|cache_dir)$", r"^env\.VLLM_CPU_OMP_THREADS_BIND$")
SYSTEM_KEYS = ("torch_version", "vllm_version", "cuda_runtime_version",
               "nvidia_driver_version", "nvidia_gpu_models")


class FairnessError(RuntimeError):
    """A fairness rule does not hold; the message names what differs."""


def flatten(server_info: dict) -> dict[str, object]:
    """``/server_info?config_format=json`` -> {dotted key: value}: the vLLM config,
    ``env.VLLM_*`` and ``system.<SYSTEM_KEYS>``."""
    out: dict[str, object] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value
    walk("", server_info.get("vllm_config") or {})
    out |= {f"env.{k}": v for k, v in (server_info.get("vllm_env") or {}).items()}
    system = server_info.get("system_env") or {}
    return out | {f"system.{k}": system.get(k) for k in SYSTEM_KEYS}


def check_configs(configs: dict[str, dict], allow: tuple[str, ...] = ()) -> list[dict]:
    """Every key not the same on all engines (missing counts as None), as knob, instance
    or allowed (named in ``allow``); FairnessError naming every other key and its values."""
    diffs = []
    for key in sorted({k for c in configs.values() for k in c}):
        values = {label: c.get(key) for label, c in configs.items()}
        if len({repr(v) for v in values.values()}) > 1:
            kind = ("knob" if any(re.search(p, key) for p in KNOBS) else "instance"
                    if any(re.search(p, key, re.IGNORECASE) for p in INSTANCE) else
                    "allowed" if key in allow else "forbidden")
            diffs.append({"key": key, "kind": kind, "values": values})
    bad = [f"  {d['key']}: " + ", ".join(f"{k}={v!r}" for k, v in d["values"].items())
           for d in diffs if d["kind"] == "forbidden"]
    if bad:
        raise FairnessError("engine configs differ in keys the arms must share "
                            "(--allow-diff KEY accepts one):\n" + "\n".join(bad))
    return diffs


def requests_of(records: list[dict]) -> list[dict]:
    """aiperf's per-request records -> {start_s, ttft_s, chunks_s (absolute), error}."""
    out = []
    for r in records:
        m = {k: v["value"] for k, v in r.get("metrics", {}).items()}
        start, ttft = r["metadata"]["request_start_ns"] / 1e9, m.get("time_to_first_token")
        chunks = [] if ttft is None else [start + ttft / 1e3]
        for gap_ms in m.get("inter_chunk_latency") or []:
            chunks.append(chunks[-1] + gap_ms / 1e3)
        out.append({"start_s": start, "ttft_s": None if ttft is None else ttft / 1e3,
                    "chunks_s": chunks, "error": bool(r.get("error"))})
    return out


def _pcts(xs: list[float]) -> dict:
    return {f"p{round(q * 100)}": pct(xs, q) for q in (0.5, 0.95, 0.99)}


def summarize_step(victims: list[dict], injected: list[dict], rate: float, warm_s: float,
                   duration_s: float) -> dict:
    """What aiperf saw inside the step's window (the module docstring)."""
    t0 = min(r["start_s"] for r in (injected or victims))
    lo, hi = t0 + warm_s, t0 + duration_s
    gaps = [b - a for r in victims for a, b in zip(r["chunks_s"], r["chunks_s"][1:])
            if a >= lo and b <= hi]
    # Long prompts by their place in the schedule: the i-th is due at t0 + i / rate.
    inj = [r for i, r in enumerate(sorted(injected, key=lambda r: r["start_s"]))
           if warm_s <= i / rate < duration_s]
    return {"rate": rate, "offered_injected_rps": len(inj) / (hi - lo),
            "victim_itl_s": _pcts(gaps), "victim_gaps": len(gaps),
            "victim_ttft_s": _pcts([r["ttft_s"] for r in victims
                                    if lo <= r["start_s"] < hi and r["ttft_s"] is not None]),
            "victim_tokens_per_s": sum(lo <= c <= hi for r in victims for c in r["chunks_s"])
            / (hi - lo),
            "injected": len(inj), "injected_failed": sum(r["ttft_s"] is None for r in inj),
            "injected_ttft_s": _pcts([r["ttft_s"] for r in inj if r["ttft_s"] is not None]),
            "errors": sum(r["error"] for r in victims + inj),
            "victims_cover_window": bool(victims) and min(r["start_s"] for r in victims) <= lo
            and max((r["chunks_s"][-1] for r in victims if r["chunks_s"]), default=0) >= hi}


def pools(engines: list[tuple[str, str]], before: list[dict], after: list[dict]) -> dict:
    """Counter deltas per pool (coloc, P, D): requests, mean queueing, KV bytes moved."""
    d: dict[str, dict[str, float]] = {}
    for (role, _), b, a in zip(engines, before, after):
        for k in COUNTERS:
            d.setdefault(role, dict.fromkeys(COUNTERS, 0.0))[k] += a.get(k, 0.0) - b.get(k, 0.0)
    return {role: {"requests": x[COUNTERS[0]], "kv_bytes": x[COUNTERS[3]],
                   "queue_mean_s": x[COUNTERS[1]] / x[COUNTERS[2]] if x[COUNTERS[2]] else None}
            for role, x in d.items()}


def goodput(steps: dict, ttft_s: float, itl_s: float) -> float:
    """The highest rate at which that step and every lower one met both targets."""
    best = 0.0
    for s in sorted(steps.values(), key=lambda s: s["rate"]):
        itl, ttft = s["victim_itl_s"]["p99"], s["injected_ttft_s"]["p99"]
        if (s["errors"] or s["injected_failed"] or itl is None or itl > itl_s
                or (s["injected"] and (ttft is None or ttft > ttft_s))):
            break
        best = s["rate"]
    return best


def _trio(d: dict) -> str:
    return "/".join(report.ms(d.get(k)) for k in ("p50", "p95", "p99"))


def verdict(arms: dict, ttft_s: float, itl_s: float) -> dict:
    """Best co-located arm against best P/D arm by goodput, then by victims' ITL p99
    under injection (mean over the rates); inconclusive when one misses the ITL target
    with no long prompts at all (then its failures are not interference)."""
    under = {k: statistics.mean(xs) if (xs := [s["victim_itl_s"]["p99"] for s in a["steps"]
             .values() if s["rate"] > 0 and s["victim_itl_s"]["p99"] is not None]) else None
             for k, a in arms.items()}
    good = {k: goodput(a["steps"], ttft_s, itl_s) for k, a in arms.items() if a["steps"]}
    c, d = (max((k for k in good if arms[k]["kind"] == kind), default=None,
                key=lambda k: (good[k], -(under[k] or math.inf))) for kind in ("coloc", "pd"))
    out = {"goodput": good, "itl_p99_under_injection_s": under, "best_coloc": c, "best_pd": d}
    if c is None or d is None:
        return out | {"decision": "inconclusive", "why": "an arm did not run"}
    why = (f"goodput {good[c]:g} req/s of long prompts co-located ({c}), {good[d]:g} P/D "
           f"({d}); victims' ITL p99 under injection {report.ms(under[c])} against "
           f"{report.ms(under[d])} ms")
    for key in (c, d):
        base = (arms[key]["steps"].get("0") or {}).get("victim_itl_s", {}).get("p99")
        if base is not None and base > itl_s:
            return out | {"decision": "inconclusive", "why": f"{key} misses the victims' ITL "
                          f"target with no long prompts at all (p99 {report.ms(base)} ms at "
                          f"rate 0), so its misses are not interference; {why}"}
    return out | {"why": why, "decision": "disaggregate" if good[d] > good[c] else
                  "stay co-located" if good[d] < good[c] else "inconclusive"}


# ======================================================================= running it
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one co-located budget, rates 0,1")
    p.add_argument("--check-only", action="store_true", help="start, compare configs, stop")
    p.add_argument("--model", help="HF model directory (default: generate the bench model)")
    p.add_argument("--tiny-model", action="store_true", help="generate the tests' tiny model")
    p.add_argument("--allow-diff", action="append", default=[], metavar="KEY")
    p.add_argument("--out-dir", default=str(report.OUT_DIR))
    p.add_argument("--log-dir", help="engine, proxy and aiperf logs (default: a temp dir)")
    for name, default in {**FLAGS, **FULL}.items():   # FULL's: --quick's when not given
        p.add_argument("--" + name.replace("_", "-"), type=type(default),
                       default=None if name in FULL else default)
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    args.rate_list = sorted({float(r) for r in args.rates.split(",") if r})
    if not args.rate_list or args.rate_list[0] < 0 or not 0 <= args.warm_s < args.duration_s:
        p.error("--rates: non-negative numbers; --warm-s below --duration-s")
    if set(args.pd_modes.split(",")) - set(PD_ARMS):
        p.error("--pd-modes: defaults and/or forced")
    return args


def engine_configs(cluster: str, run: armlib.Running) -> dict[str, dict]:
    """Each engine's resolved config, flattened, by ``cluster/role<i>``."""
    out = {}
    for i, (role, url) in enumerate(run.engines):
        resp = requests.get(url + "/server_info", params={"config_format": "json"}, timeout=60)
        if resp.status_code != 200:
            raise FairnessError(f"{url}/server_info answered {resp.status_code}: engines "
                                "must run with VLLM_SERVER_DEV_MODE=1 to be compared")
        out[f"{cluster}/{role}{i}"] = flatten(resp.json())
    return out


def run_step(run: armlib.Running, url: str, rate: float, a, model: str, work: Path,
             seed: int) -> dict:
    """Reset every cache, run the victims and (rate > 0) the injector, summarize."""
    if note := armlib.reset(run):
        raise FairnessError(f"prefix caches not reset: {note}")
    loads = {"victims": (a.victim_prompt_tokens, a.victim_max_tokens, a.duration_s +
                         a.startup_slack_s, ["--concurrency", str(a.victims)], 300)}
    if rate:   # aiperf's first send is 1/rate after its start: t0 + duration_s is covered
        loads["injected"] = (a.prompt_tokens, a.injected_max_tokens, a.duration_s + 1 / rate,
                             ["--request-rate", f"{rate:g}", "--arrival-pattern", "constant"],
                             math.ceil(rate * a.duration_s) + 3)
    read = lambda: [(metric_sums(u, COUNTERS), histogram_buckets(u, ENGINE_ITL))  # noqa: E731
                    for _, u in run.engines]
    before, procs = read(), {}
    for name, (isl, osl, duration_s, load, entries) in loads.items():
        argv = [str(aiperf.executable()), "profile", "--url", url, "--endpoint-type",
                "completions", "--streaming", "--model", model, "--tokenizer", model, *load,
                "--prompt-input-tokens-mean", str(isl), "--prompt-input-tokens-stddev", "0",
                "--prompt-output-tokens-mean", str(osl), "--prompt-output-tokens-stddev", "0",
                "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
                "--benchmark-duration", f"{duration_s:g}", "--benchmark-grace-period",
                f"{a.drain_s:g}", "--num-dataset-entries", str(entries), "--random-seed",
                str(seed), "--output-artifact-dir", str(work / name), "--ui-type", "none",
                "--no-server-metrics", "--no-gpu-telemetry"]
        with open(work / f"{name}.log", "w") as out:
            procs[name] = subprocess.Popen(argv, env=aiperf.environment(), stdout=out, stderr=out)
    for name, proc in procs.items():
        if proc.wait():
            tail = (work / f"{name}.log").read_text(errors="replace").splitlines()[-8:]
            raise RuntimeError(f"aiperf ({name}) exited {proc.returncode}: " + " | ".join(tail))
    time.sleep(1.0)   # the engines' stat loggers catch up with the last requests
    after, itl = read(), {}
    for (_, b), (_, x) in zip(before, after):
        for le, n in x.items():
            itl[le] = itl.get(le, 0.0) + n - b.get(le, 0.0)
    got = {n: requests_of([json.loads(x) for x in (work / n / aiperf.RECORDS).read_text()
                           .splitlines() if x.strip()]) for n in procs}
    return summarize_step(got["victims"], got.get("injected", []), rate, a.warm_s,
                          a.duration_s) | {
        "engine_itl_s": {f"p{round(q * 100)}": histogram_quantile(itl, q) for q in (.5, .95, .99)},
        "pools": pools(run.engines, [b for b, _ in before], [x for x, _ in after]),
        "aiperf_inputs_sha256": {n: hashlib.sha256((work / n / "inputs.json").read_bytes())
                                 .hexdigest()[:16] for n in procs},
        "aiperf_version": json.loads((work / "victims" / aiperf.SUMMARY).read_text())
        .get("aiperf_version")}


def measure(run: armlib.Running, cluster: str, arms: dict, args, model: str, work: Path,
            res: dict) -> None:
    """Every arm of a started cluster at every rate; a step whose victims did not cover
    its window is a failure, other prompts than another arm's a refusal."""
    for key, why in armlib.warm_up(run, model).items():
        raise RuntimeError(f"warm-up through {key} failed: {why}")
    for arm, (arm_key, label) in arms.items():
        entry = res["arms"][arm] = {"label": label, "steps": {},
                                    "kind": "coloc" if cluster == "coloc" else "pd"}
        for i, rate in enumerate(args.rate_list):
            step_dir = work / arm / f"{rate:g}"
            step_dir.mkdir(parents=True)
            s = entry["steps"][f"{rate:g}"] = run_step(run, run.routers[arm_key], rate, args,
                                                       model, step_dir, args.seed * 100 + i)
            res["meta"]["aiperf_version"] = s["aiperf_version"]
            seen = res["fairness"]["aiperf_inputs"].setdefault(f"{rate:g}", {})
            seen[arm] = s["aiperf_inputs_sha256"]
            if len({json.dumps(x, sort_keys=True) for x in seen.values()}) > 1:
                raise FairnessError(f"aiperf sent other prompts at {rate:g}/s: {seen}")
            if not s["victims_cover_window"]:
                res["failures"].append(f"{arm} at {rate:g}/s: the victims did not run through "
                                       "the whole window (raise --startup-slack-s)")
            log(f"{arm} @ {rate:g}/s: victims' ITL p50/p95/p99 {_trio(s['victim_itl_s'])} ms, "
                f"long TTFT {_trio(s['injected_ttft_s'])} ms, {s['errors']} errors")


def render(res: dict) -> str:
    m, fair, v = res["meta"], res["fairness"], res["verdict"]
    pool = lambda s, key, f: ", ".join(  # noqa: E731
        f"{r} {f(p[key])}" for r, p in sorted(s["pools"].items()) if p[key] is not None) or "-"
    return "\n".join(report.head("Interference: P/D against co-located chunked prefill", m) + [
        f"aiperf {m.get('aiperf_version')}, streamed completions (`ignore_eos`, temperature 0). "
        f"Victims: {m['victims']} streams of {m['victim_prompt_tokens']}-token prompts, "
        f"{m['victim_max_tokens']} tokens each, back to back; long prompts of "
        f"{m['prompt_tokens']} tokens and {m['injected_max_tokens']} output tokens at constant "
        f"intervals. Each step {m['duration_s']:g} s from the first long prompt, the first "
        f"{m['warm_s']:g} s not counted; nearest-rank percentiles. Targets: long prompts' TTFT "
        f"p99 <= {m['ttft_target_ms']:g} ms, victims' ITL p99 <= {m['itl_target_ms']:g} ms. "
        f"Model: {m['model']}, {m['dtype']}, {m['blocks']} KV blocks of 32 tokens per engine. "
        f"Cores: {m['cores']}. The two aiperf processes run on this machine beside the engines "
        "in every arm; aiperf costs about half a core at 8.5 req/s here (docs/measurements.md).",
        "", f"**Verdict: {v['decision']}.** {v['why']}.", ""] + report.table(
        ["arm", "goodput (long prompts req/s)", "victims' ITL p99 under injection (ms)"],
        [[a["label"], v["goodput"].get(k), report.ms(v["itl_p99_under_injection_s"][k])]
         for k, a in res["arms"].items()]) + [
        "", "Requests per pool (P's: those through P), queueing and KV moved from the engines' "
        "counters; engines' ITL from `vllm:inter_token_latency_seconds` (without the API "
        "server's, proxy's and client's delays).", ""] + report.table(
        ["arm", "rate (offered) req/s", "long sent (failed)", "victims' ITL p50/p95/p99 ms",
         "engines' ITL p50/p95/p99 ms", "victims' TTFT p50/p95/p99 ms",
         "long TTFT p50/p95/p99 ms", "victims tok/s", "requests", "queue mean ms", "KV MB"],
        [[a["label"], f"{s['rate']:g} ({s['offered_injected_rps']:.2f})",
          f"{s['injected']} ({s['injected_failed']})", _trio(s["victim_itl_s"]),
          _trio(s["engine_itl_s"]), _trio(s["victim_ttft_s"]), _trio(s["injected_ttft_s"]),
          f"{s['victim_tokens_per_s']:.1f}", pool(s, "requests", lambda x: f"{x:.0f}"),
          pool(s, "queue_mean_s", report.ms),
          f"{sum(p['kv_bytes'] for p in s['pools'].values()) / 1e6:.1f}"]
         for a in res["arms"].values() for s in a["steps"].values()]) + [
        "", "## Fairness", "", f"Servers per arm: {fair['servers']}. aiperf's prompts (sha256 "
        "of its inputs.json) per rate, the same in every arm: " + "; ".join(
            f"{r}/s " + ", ".join(f"{n} {d}" for n, d in next(iter(arms.values())).items())
            for r, arms in fair["aiperf_inputs"].items()) + ". Every engine's prefix cache and "
        "our proxies' sessions reset before every step. Engine configs (`/server_info`) differ "
        "in (knob: what the arms vary; allowed: `--allow-diff`; per-server keys and the "
        "connector's other keys left out):", ""] + report.table(["key", "kind", "values"], [
            [f"`{d['key']}`", d["kind"], "; ".join(f"{k}: `{json.dumps(x)[:60]}`"
                                                   for k, x in d["values"].items())]
            for d in fair["config_diffs"]]) + [
        f"\n## {t}\n\n" + "\n".join(f"- {x}" for x in res[k])
        for t, k in (("Notes", "notes"), ("Failures", "failures")) if res[k]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    args, started = parse_args(argv), time.perf_counter()
    os.environ.setdefault("UCX_TCP_PORT_RANGE", UCX_PORTS)
    if not args.check_only:
        aiperf.ensure_venv()
    work = Path(tempfile.mkdtemp(prefix="interference-"))
    log_dir = Path(args.log_dir) if args.log_dir else work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs in {log_dir}")
    model, model_name = args.model, Path(args.model).name if args.model else ""
    if model is None:
        model = str(generate_tiny_model(work / "model", seed=0,
                                        **({} if args.tiny_model else BENCH_MODEL_SIZE)))
        model_name = "the tests' tiny model" if args.tiny_model else "the bench model"
    meta = report.meta("interference.py", sys.argv[1:] if argv is None else argv, {
        "--model": "MODEL_DIR", "--out-dir": "OUT_DIR", "--log-dir": "LOG_DIR"}) | {
        k: getattr(args, k) for k in [*FLAGS, *FULL]} | {"model": model_name}
    fair: dict = {"servers": {}, "config_diffs": [], "aiperf_inputs": {}}
    res: dict = {"meta": meta, "fairness": fair, "arms": {}, "notes": [], "failures": []}
    clusters = [(f"coloc-{n}", "coloc", ["--max-num-batched-tokens", n,
                                         *shlex.split(args.coloc_extra_args)],
                 {f"coloc-{n}": ("2-ours-coloc", f"co-located, chunked prefill {n}")})
                for n in args.max_num_batched_tokens.split(",") if n]
    clusters.append(("pd", "ours", shlex.split(args.pd_extra_args),
                     {f"pd-{m}": PD_ARMS[m] for m in args.pd_modes.split(",") if m}))
    random.Random(args.seed).shuffle(clusters)
    configs: dict[str, dict] = {}
    opts = dict(model=model, max_model_len=args.max_model_len, p_blocks=args.blocks,
                d_blocks=args.blocks, coloc_blocks=args.blocks, gpus=args.gpus.split(",")
                if args.gpus else None, engine_env=armlib.engine_cores_env(args.cores, args.gpus))
    try:
        for key, cluster, extra, arms in clusters:
            log(f"=== cluster {key}: arms {list(arms)}")
            run = armlib.start_cluster(
                cluster, [armlib.ARM_BY_KEY[k] for k, _ in arms.values()], armlib.EngineOptions(
                    **opts, extra_args=["--dtype", args.dtype, *extra]), PortPool(*PORTS),
                log_dir / key)
            try:
                configs |= engine_configs(key, run)
                fair["servers"] |= {arm: len(run.engines) for arm in arms}
                if len(set(fair["servers"].values())) > 1:
                    raise FairnessError(f"arms run on different servers: {fair['servers']}")
                diffs = check_configs(configs, tuple(args.allow_diff))
                fair["config_diffs"] = [d for d in diffs if re.search(   # the cores, the knobs
                    r"THREADS_BIND|\.kv_connector$|\.kv_role$", d["key"]) or (
                    d["kind"] != "instance" and not d["key"].startswith("kv_transfer_config."))]
                if not args.check_only:
                    measure(run, cluster, arms, args, model, work, res)
            finally:
                run.stop()
    except FairnessError as exc:
        log(f"REFUSED: {exc}")
        return 2
    except RuntimeError as exc:
        res["failures"].append(" ".join(str(exc).replace(str(work), "<work>").split())[-600:])
        log(f"FAILED: {exc}")
    if args.check_only:
        log(f"fair: the engines differ in {[d['key'] for d in fair['config_diffs']]} (shown)")
        return 1 if res["failures"] else 0
    meta["cores"] = ", ".join(f"{k} {c.get('env.VLLM_CPU_OMP_THREADS_BIND')}" for k, c in
                              configs.items()) + " (VLLM_CPU_OMP_THREADS_BIND: each engine's " \
        "model thread; API servers, engine cores, proxy and aiperf unpinned)"
    if not args.gpus and (os.cpu_count() or 1) < 4:
        res["notes"].append(f"{os.cpu_count()} cores for 2 engines: the API servers, engine "
                            "cores, proxy and aiperf take CPU from the engines' cores in every "
                            "arm, seen as stream gaps even with no long prompts (rate 0). A "
                            "verdict from such a machine is weak.")
    meta["wall_s"] = round(time.perf_counter() - started)
    res["verdict"] = verdict(res["arms"], args.ttft_target_ms / 1e3, args.itl_target_ms / 1e3)
    stem = "interference_quick" if args.quick else "interference"
    report.write(Path(args.out_dir), stem, res, render(res))
    log(f"wrote {stem}.md, wall {meta['wall_s']} s, failures {res['failures']}")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
