#!/usr/bin/env python3
"""Interference: does splitting P and D beat co-located chunked prefill on this
traffic?  One command:

    flock /tmp/skv-cluster.lock .venv/bin/python benchmarks/interference.py
    flock /tmp/skv-cluster.lock .venv/bin/python benchmarks/interference.py --quick

Victims (a fixed pool of short streaming requests) run while an injector sends long
prompts at a constant rate, replayed from an arrival file.  Arms, with the same
number of servers each:

* ``coloc-N``: two co-located vLLM engines with chunked prefill at
  ``max_num_batched_tokens`` N (one arm per ``--max-num-batched-tokens`` value),
  behind our proxy with no prefill pool (it balances on load);
* ``pd-defaults``: one P and one D with our connector, behind our proxy with its
  defaults (a short uncached prompt goes to D alone: conditional disaggregation);
* ``pd-forced``: the same engines behind a second proxy that sends every request
  through P (``--decode-only-max-uncached-tokens -1``).

Each arm runs every ``--rates`` step (long prompts per second); each step resets the
prefix caches, runs ``--duration-s`` of load and counts what follows the first
``--warm-s``.  Reported per step: victims' ITL p50/p95/p99 (gaps between streamed
chunks), long prompts' TTFT p50/p95/p99, the offered load, routes, and per pool the
queueing delay, prefix-cache hit rate and KV transfers (``vllm:nixl_*``,
``sessionkv_sync_load_wait_seconds``); per arm the goodput (the highest rate at which
both ``--ttft-target-ms`` and ``--itl-target-ms`` hold); and a verdict.

Fairness is enforced (``interfere/fairness.py``): the same number of servers and the
same arrival file in every arm, prefix caches reset before every step, and every
engine's resolved config read back from the engine (``/server_info``) and compared:
a difference other than the arms' knobs (the chunked-prefill budget, the KV
connector) and per-server keys (ports, cores) stops the run, naming the key, unless
``--allow-diff KEY``.  ``--check-only`` starts each arm and checks only that.

On CPU each engine's model thread is pinned to a core of its own (``--cores``, by
default engine i on core i: ``VLLM_CPU_OMP_THREADS_BIND``), in both arms.

GPU engines launched by the bench: ``--model /models/X --gpus 0,1 --max-model-len
32768 --blocks N``.  Engines already running (``--external FILE --model NAME``), in
``agent_workload.py``'s format: ``{"coloc": {"engines": [{"url": ...}, {"url": ...}]},
"ours": {"prefill": {"url", "events", "replay"}, "decode": {"url", "events", "replay",
"early"}}}``; engines run with ``VLLM_SERVER_DEV_MODE=1`` (config dump, cache reset)
and ``--block-size 32``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

from sessionkv_bench import arms as armlib  # noqa: E402
from sessionkv_bench.arms import SIDE_PY, call_in_side_venv, ensure_side_venv
from sessionkv_bench.metrics import histogram_buckets, metric_sums
from sessionkv_bench.report import machine_line
from sessionkv_bench.runner import PortPool, env_for_bench, log  # noqa: E402
from interfere import fairness, load, report  # noqa: E402

# This bench's ports (its own range; UCX's listeners in the last hundred).
PORTS = (32000, 32899)
UCX_PORTS = "32900-32999"
COLOC_ARM = armlib.ARM_BY_KEY["2-ours-coloc"]   # two co-located engines + our proxy
PD_ARM = armlib.ARM_BY_KEY["7-ours"]            # 1P + 1D + our proxy (LocalCluster's)
FORCE_DISAGG = ["--decode-only-max-uncached-tokens", "-1"]

FULL = {"mnbt": "256,1024", "rates": "0,0.5,1,1.5", "duration_s": 20.0, "warm_s": 4.0,
        "prompt_tokens": 1536}
QUICK = {"mnbt": "256", "rates": "0,1", "duration_s": 10.0, "warm_s": 3.0,
         "prompt_tokens": 1024}


@dataclass(frozen=True)
class ArmPlan:
    key: str
    label: str
    kind: str                  # coloc | pd
    cluster: str               # the cluster (engines) it runs on
    proxy: str = ""            # pd: defaults | forced


@dataclass(frozen=True)
class ClusterPlan:
    key: str
    kind: str                  # coloc | pd (agentload cluster "coloc" or "ours")
    extra_args: tuple[str, ...]
    arms: tuple[ArmPlan, ...]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: one co-located budget, "
                   "two rates, short steps")
    p.add_argument("--check-only", action="store_true",
                   help="start each arm, read back and compare the engine configs, stop")
    p.add_argument("--model", help="HF model directory (default: generate the bench model)")
    p.add_argument("--tiny-model", action="store_true",
                   help="generate the tests' tiny model instead of the bench model")
    p.add_argument("--max-num-batched-tokens", dest="mnbt",
                   help="co-located arms' chunked-prefill budgets, comma-separated "
                        f"(default {FULL['mnbt']}; quick {QUICK['mnbt']})")
    p.add_argument("--pd-max-num-batched-tokens", type=int,
                   help="the P/D engines' budget (default: vLLM's)")
    p.add_argument("--pd-modes", default="defaults,forced",
                   help="P/D arms: our proxy's defaults, and/or every request through P")
    p.add_argument("--rates", help="injector rates, long prompts per second "
                                   f"(default {FULL['rates']}; quick {QUICK['rates']})")
    p.add_argument("--duration-s", type=float, help="load per step")
    p.add_argument("--warm-s", type=float, help="first seconds of each step not counted")
    p.add_argument("--drain-s", type=float, default=30.0,
                   help="after the load stops, how long long prompts may still take to "
                        "start answering before they count as unfinished")
    p.add_argument("--victims", type=int, default=4, help="concurrent victim streams")
    p.add_argument("--victim-prompt-tokens", type=int, default=64)
    p.add_argument("--victim-max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, help="long prompts' length (generated file)")
    p.add_argument("--injected-max-tokens", type=int, default=8)
    p.add_argument("--arrivals", help="arrival file (JSONL: t_s, prompt, max_tokens) "
                                      "instead of a generated one")
    p.add_argument("--ttft-target-ms", type=float, default=3000.0,
                   help="long prompts' TTFT p99 target")
    p.add_argument("--itl-target-ms", type=float, default=100.0,
                   help="victims' ITL p99 target")
    p.add_argument("--blocks", type=int, default=512,
                   help="KV blocks (32 tokens) of every engine, the same in every arm")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--dtype", default="float32",
                   help="engines' --dtype (float32: the bench model's measured prefill "
                        "rate in docs/benchmarks/agent_workload.md)")
    p.add_argument("--cores", default="auto", help=armlib.CORES_HELP)
    p.add_argument("--gpus", help="comma-separated CUDA_VISIBLE_DEVICES, one per engine")
    p.add_argument("--coloc-extra-args", default="",
                   help="extra vLLM arguments for the co-located engines")
    p.add_argument("--pd-extra-args", default="",
                   help="extra vLLM arguments for the P/D engines")
    p.add_argument("--allow-diff", action="append", default=[], metavar="KEY",
                   help="accept engines whose configs differ in KEY (reported)")
    p.add_argument("--external", metavar="JSON",
                   help="engines already running: coloc (two engines) and ours (P, D)")
    p.add_argument("--seed", type=int, default=0, help="cluster and arm order")
    p.add_argument("--out-dir", default=str(REPO / "docs" / "benchmarks"))
    p.add_argument("--log-dir", help="engine and proxy logs (default: a temp dir)")
    p.add_argument("--render-only", metavar="JSON",
                   help="write the report and plot of an earlier run's JSON, run nothing")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    for name in ("mnbt", "rates", "duration_s", "warm_s", "prompt_tokens"):
        if getattr(args, name) is None:
            setattr(args, name, base[name])
    args.rate_list = sorted({float(r) for r in str(args.rates).split(",") if r})
    if not args.rate_list or args.rate_list[0] < 0:
        raise SystemExit("--rates: non-negative numbers, comma-separated")
    if not 0 <= args.warm_s < args.duration_s:
        raise SystemExit("--warm-s must be below --duration-s")
    args.mnbt_list = [int(x) for x in str(args.mnbt).split(",") if x]
    args.pd_mode_list = [m for m in args.pd_modes.split(",") if m]
    if set(args.pd_mode_list) - {"defaults", "forced"}:
        raise SystemExit("--pd-modes: defaults and/or forced")
    args.external_clusters = armlib.load_external(args.external) if args.external else {}
    if args.external_clusters and not args.model:
        raise SystemExit("--external needs --model: the model the engines serve")
    return args


def plan(args) -> list[ClusterPlan]:
    """The clusters and their arms, in a shuffled order (``--seed``)."""
    coloc_extra = tuple(shlex.split(args.coloc_extra_args))
    pd_extra = tuple(shlex.split(args.pd_extra_args))
    clusters = []
    if "coloc" in args.external_clusters:
        clusters.append(ClusterPlan("coloc", "coloc", (), (
            ArmPlan("coloc", "co-located (external)", "coloc", "coloc"),)))
    elif not args.external_clusters:
        for n in args.mnbt_list:
            key = f"coloc-{n}"
            clusters.append(ClusterPlan(key, "coloc",
                                        ("--max-num-batched-tokens", str(n), *coloc_extra),
                                        (ArmPlan(key, f"co-located, chunked prefill {n}",
                                                 "coloc", key),)))
    if "ours" in args.external_clusters or not args.external_clusters:
        pd_args = pd_extra
        if args.pd_max_num_batched_tokens:
            pd_args = ("--max-num-batched-tokens", str(args.pd_max_num_batched_tokens),
                       *pd_extra)
        labels = {"defaults": "P/D, proxy defaults", "forced": "P/D, every request via P"}
        clusters.append(ClusterPlan("pd", "pd", pd_args, tuple(
            ArmPlan(f"pd-{m}", labels[m], "pd", "pd", m) for m in args.pd_mode_list)))
    rng = random.Random(args.seed)
    rng.shuffle(clusters)
    return clusters


def engine_options(args, model: str, extra: tuple[str, ...]) -> armlib.EngineOptions:
    engine_env = armlib.engine_cores_env(args.cores, args.gpus)
    return armlib.EngineOptions(
        model=model, max_model_len=args.max_model_len, p_blocks=args.blocks,
        d_blocks=args.blocks, coloc_blocks=args.blocks, kv_cache_gb=args.kv_cache_gb,
        gpus=args.gpus.split(",") if args.gpus else None,
        extra_args=["--dtype", args.dtype, *extra], external=args.external_clusters,
        engine_env=engine_env)


def engine_configs(cluster: str, run: armlib.Running) -> dict[str, dict]:
    """Each engine's resolved config, flattened, by ``cluster/role<i>``."""
    import requests

    out = {}
    for i, (role, url) in enumerate(run.engines):
        resp = requests.get(url + "/server_info", params={"config_format": "json"},
                            timeout=60)
        if resp.status_code != 200:
            raise fairness.FairnessError(
                f"{url}/server_info answered {resp.status_code}: the engines must run "
                "with VLLM_SERVER_DEV_MODE=1 so their configs can be compared")
        out[f"{cluster}/{role}{i}"] = fairness.flatten(resp.json())
    return out


def start_forced_proxy(run: armlib.Running, ports: PortPool, log_dir: Path) -> str:
    """A second proxy on the P/D engines, the first's command line with every request
    sent through P."""
    from vllm_sessionkv.dev.launch import start_process, wait_healthy

    argv = shlex.split(run.commands[PD_ARM.key])
    port = ports.take()
    argv[argv.index("--port") + 1] = str(port)
    argv += FORCE_DISAGG
    proc = start_process("proxy-forced", argv, log_dir)
    run.procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_healthy([(proc, url)], timeout_s=120)
    run.commands["pd-forced"] = " ".join(argv)
    return url


def run_arm_step(run: armlib.Running, url: str, arm: ArmPlan, rate: float, arrivals,
                 args, model: str) -> dict:
    note = armlib.reset(run)
    if note:
        raise fairness.FairnessError(f"{arm.key}: prefix caches not reset: {note}")
    before = [metric_sums(u, report.COUNTERS) for _, u in run.engines]
    itl_before = [histogram_buckets(u, report.ENGINE_ITL) for _, u in run.engines]
    injections = load.schedule(arrivals, rate, args.duration_s, args.step_starts[rate])
    streams = asyncio.run(load.run_step(
        url, model, injections, victims=args.victims,
        victim_prompt_tokens=args.victim_prompt_tokens,
        victim_max_tokens=args.victim_max_tokens, duration_s=args.duration_s,
        drain_s=args.drain_s, seed=args.seed))
    time.sleep(1.0)   # the engines' stat loggers catch up with the last step
    after = [metric_sums(u, report.COUNTERS) for _, u in run.engines]
    itl_after = [histogram_buckets(u, report.ENGINE_ITL) for _, u in run.engines]
    step = report.summarize_step(streams, rate, args.warm_s, args.duration_s,
                                 report.pools(run.engines, before, after),
                                 report.engine_itl(itl_before, itl_after))
    log(f"{arm.key} @ {rate:g}/s: victims ITL p50/p95/p99 "
        f"{report.pcts_ms(step['victim_itl_s'])} ms ({step['victim_gaps']} gaps; engines' "
        f"{report.pcts_ms(step['engine_itl_s'])} ms), long TTFT "
        f"p50/p95/p99 {report.pcts_ms(step['injected_ttft_s'])} ms ({step['injected']} sent, "
        f"{step['injected_unfinished']} unfinished), routes {step['routes']}, errors "
        f"{step['errors']}")
    return step


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def write_report(results: dict, out_dir: Path, stem: str) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(results, indent=1, default=str))
    text = report.render(results)
    if stem != "interference":
        text = text.replace("(interference.png)", f"({stem}.png)")
    print(text)
    (out_dir / f"{stem}.md").write_text(text + "\n")
    if not SIDE_PY.exists():
        return ["no plot: the side venv (matplotlib) is missing"]
    err = call_in_side_venv("interfere.report", "plot", str(json_path),
                            str(out_dir / f"{stem}.png"))
    if err:
        log(f"plot failed: {err}")
        return ["plot failed"]
    return []


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    stem = "interference_quick" if args.quick else "interference"
    if args.render_only:
        path = Path(args.render_only)
        results = json.loads(path.read_text())
        meta = results["meta"]
        results["verdict"] = report.verdict(results["arms"], meta["rates"],
                                            meta["ttft_target_s"], meta["itl_target_s"])
        write_report(results, out_dir, path.stem)
        return 0
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, _interrupt)
    os.environ.setdefault("UCX_TCP_PORT_RANGE", UCX_PORTS)
    env_for_bench()
    failures: list[str] = []
    if not args.check_only:
        try:
            ensure_side_venv()
        except (subprocess.CalledProcessError, OSError) as exc:
            failures.append(f"side venv (matplotlib): {exc!r}")
    workdir = Path(tempfile.mkdtemp(prefix="interference-"))
    log_dir = Path(args.log_dir) if args.log_dir else workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs in {log_dir}")
    model = args.model
    if model is None:
        from vllm_sessionkv.dev.tiny_model import BENCH_MODEL_SIZE, generate_tiny_model

        size = {} if args.tiny_model else BENCH_MODEL_SIZE
        model = str(generate_tiny_model(workdir / "bench-model", seed=0, **size))
    if args.arrivals:
        arrivals_path = Path(args.arrivals)
    else:
        n = sum(math.ceil(args.duration_s * r) + 1 for r in args.rate_list) + 1
        arrivals_path = load.write_arrivals(workdir / "arrivals.jsonl", n, 1.0,
                                            args.prompt_tokens, args.injected_max_tokens,
                                            seed=args.seed)
    arrivals = load.read_arrivals(arrivals_path)
    # Refuses a file too short now, not after the first arm.
    args.step_starts = load.step_starts(arrivals, args.rate_list, args.duration_s)
    digest = fairness.file_digest(arrivals_path)
    clusters = plan(args)
    prompt_lens = sorted({len(a.prompt) if isinstance(a.prompt, list) else -1
                          for a in arrivals})
    results: dict = {
        "meta": {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine_line(), "argv": sys.argv, "quick": args.quick,
                 "model": "tests' tiny model" if args.tiny_model else (
                     args.model or "bench model (vllm_sessionkv.dev.tiny_model."
                                   "BENCH_MODEL_SIZE)"),
                 "dtype": args.dtype, "max_model_len": args.max_model_len,
                 "blocks": args.blocks, "victims": args.victims,
                 "victim_prompt_tokens": args.victim_prompt_tokens,
                 "victim_max_tokens": args.victim_max_tokens,
                 "injected_prompt_tokens": prompt_lens[0] if len(prompt_lens) == 1
                 else f"{prompt_lens[0]}-{prompt_lens[-1]}",
                 "injected_max_tokens": arrivals[0].max_tokens,
                 "rates": args.rate_list, "duration_s": args.duration_s,
                 "warm_s": args.warm_s, "drain_s": args.drain_s,
                 "ttft_target_s": args.ttft_target_ms / 1e3,
                 "itl_target_s": args.itl_target_ms / 1e3,
                 "arrivals": "generated" if not args.arrivals else str(arrivals_path),
                 "order": [c.key for c in clusters], "cores": "-"},
        "fairness": {"servers": {}, "arrival_sha256": digest, "arrivals_by_arm": {},
                     "cache_policy": "every engine's prefix cache reset (our proxy's "
                                     "/admin/reset, else /reset_prefix_cache) before every "
                                     "step of every arm; each step's first --warm-s "
                                     "seconds are its identical warm-up",
                     "config_diffs": []},
        "arms": {}, "commands": {}, "notes": [], "failures": failures}
    configs: dict[str, dict] = {}
    refused = None
    try:
        for cp in clusters:
            name = "coloc" if cp.kind == "coloc" else "ours"
            router_arm = COLOC_ARM if cp.kind == "coloc" else PD_ARM
            log(f"=== cluster {cp.key}: arms {[a.key for a in cp.arms]}")
            ports = PortPool(*PORTS)
            run = armlib.start_cluster(name, [router_arm],
                                       engine_options(args, model, cp.extra_args),
                                       ports, log_dir / cp.key)
            try:
                configs.update(engine_configs(cp.key, run))
                for a in cp.arms:
                    results["fairness"]["servers"][a.key] = len(run.engines)
                    results["fairness"]["arrivals_by_arm"][a.key] = digest
                fairness.check_server_counts(results["fairness"]["servers"])
                fairness.check_same_arrivals(results["fairness"]["arrivals_by_arm"])
                diffs = fairness.check_configs(configs, tuple(args.allow_diff))
                results["fairness"]["config_diffs"] = [
                    {"key": d.key, "kind": d.kind, "values": d.values} for d in diffs]
                if args.check_only:
                    continue
                urls = {a.key: run.routers[router_arm.key] for a in cp.arms
                        if a.proxy != "forced"}
                if any(a.proxy == "forced" for a in cp.arms):
                    urls["pd-forced"] = start_forced_proxy(run, ports, log_dir / cp.key)
                results["commands"].update(run.commands)
                for key, why in armlib.warm_up(run, model).items():
                    raise RuntimeError(f"{cp.key}: warm-up through {key} failed: {why}")
                order = list(cp.arms)
                random.Random(args.seed + 1).shuffle(order)
                for arm in order:
                    entry = results["arms"].setdefault(arm.key, {
                        "label": arm.label, "kind": arm.kind, "engines": run.engines,
                        "router": urls[arm.key], "steps": {}})
                    for rate in args.rate_list:
                        entry["steps"][f"{rate:g}"] = run_arm_step(
                            run, urls[arm.key], arm, rate, arrivals, args, model)
            finally:
                run.stop()
    except fairness.FairnessError as exc:
        refused = str(exc)
        failures.append(f"refused: {exc}")
        log(f"REFUSED: {exc}")
    except KeyboardInterrupt:
        failures.append("interrupted")
    binds = {label: c.get("env.VLLM_CPU_OMP_THREADS_BIND") for label, c in configs.items()}
    results["meta"]["cores"] = (
        ", ".join(f"{label} {b}" for label, b in binds.items())
        + " (VLLM_CPU_OMP_THREADS_BIND: the core of each engine's model thread; the "
          "proxy, the client and each engine's API-server and engine-core processes "
          "run unpinned)") if binds else "-"
    for d in results["fairness"]["config_diffs"]:
        if d["kind"] != "instance":
            log(f"config diff ({d['kind']}) {d['key']}: {d['values']}")
    n_engines = max(results["fairness"]["servers"].values(), default=0)
    if not args.gpus and not args.external_clusters and (os.cpu_count() or 1) < 2 * n_engines:
        results["notes"].append(
            f"This machine has {os.cpu_count()} cores for {n_engines} engines.  Each "
            "engine's model thread has a core of its own, but the API servers, the engine "
            "cores, the proxy, Redis and this client have none: their CPU time comes out "
            "of the engines' cores in both arms and shows as gaps in the streams even "
            "with no long prompts (the rate-0 rows; the engines' own ITL leaves the "
            "client's and proxy's share out).  A verdict from such a machine is weak.")
    results["meta"]["wall_s"] = time.perf_counter() - started
    if args.check_only or refused:
        print(json.dumps(results["fairness"], indent=1, default=str)[:4000])
        return 2 if refused else 0
    results["verdict"] = report.verdict(results["arms"], args.rate_list,
                                        args.ttft_target_ms / 1e3, args.itl_target_ms / 1e3)
    failures += write_report(results, out_dir, stem)
    log(f"report in {out_dir / (stem + '.md')}, wall {results['meta']['wall_s']:.0f} s")
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
