"""Chat goodput: aiperf's multi-turn streamed chat sessions against each target, every
request judged against a TTFT and an ITL SLO (DistServe's goodput: requests per second
meeting both).  The chat and router scenario: load only, aiperf the load generator.

    python benchmarks/chat_goodput.py --quick      # a launcher cluster on the tiny model
    python benchmarks/chat_goodput.py --arms 1-rr,2-ours-coloc,5-vr-cache-coloc,3-nixl-rr,5-vr-rr,5-vr-cache,7-ours,7-ours-pd
    python benchmarks/chat_goodput.py --target ours=http://127.0.0.1:8000 \\
        --target colocated=http://127.0.0.1:8100 --model NAME --tokenizer DIR
    python benchmarks/chat_goodput.py --arms 7-ours,5-vr-rr,5-vr-cache,1-rr,3-nixl-rr \\
        --model-dir MODEL_DIR --rates 0.25,0.5,1 --stem chat_goodput_sweep

Without ``--target`` or ``--arms`` it starts the launcher's default cluster
(``LocalCluster``: Redis, our proxy, 1 P + 1 D with our connector, a plain co-located
engine) on the tiny model and measures ``ours`` (the proxy) and ``colocated``.
``--arms`` names arms of ``sessionkv_bench.arms`` (ours, vllm-router, stock NIXL,
co-located behind the toy round robin, our proxy or vllm-router; not 4-nixl-bidi,
whose proxy serves no chat): their clusters start one at a time (two engines each,
the tiny model or ``--model-dir``), every cache reset before each arm's run, and
each arm's router CPU time per request and the engines' prefix-cache hit rate are
reported beside aiperf's figures.  Each round runs every target (of a cluster) once,
in reverse order every other round; a target's figures pool its requests over the
rounds.  ``--rates`` sweeps the offered request rate (aiperf's ``--request-rate``,
``--concurrency`` its ceiling): every target runs at every rate, and each target's
goodput is its best over the rates (the rate sweep's headline, plotted against the
offered rate).  aiperf runs from its own venv (``sessionkv_bench.aiperf``).  Writes
``docs/benchmarks/chat_goodput.{md,json}`` (``chat_goodput_quick.*`` with ``--quick``;
``--stem`` names others); ``--render-only JSON`` writes the report again from a run's
JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from sessionkv_bench import aiperf, report
from sessionkv_bench import arms as armlib
from sessionkv_bench.sweep import run_name, split_run
from sessionkv_bench.metrics import metric_sums
from sessionkv_bench.runner import PortPool, env_for_bench, interleaved, log
from sessionkv_bench.arms import CORES_HELP

from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster, default_dtype
from vllm_sessionkv.dev.tiny_model import generate_tiny_model

PATH_FLAGS = {"--tokenizer": "TOKENIZER_DIR", "--out-dir": "OUT_DIR", "--render-only": "JSON",
              "--model-dir": "MODEL_DIR"}
HITS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                   help="an OpenAI-compatible server to measure (repeat); none: start the "
                        "launcher's default cluster on the tiny model")
    p.add_argument("--model", help="the model name the targets serve (with --target)")
    p.add_argument("--tokenizer", help="tokenizer directory for aiperf (with --target)")
    p.add_argument("--arms", help="comma-separated arm keys (sessionkv_bench.arms.ARMS) to "
                                   "start and measure")
    p.add_argument("--model-dir", help="with --arms: the model the engines serve (default: "
                                       "the tests' tiny model, generated)")
    p.add_argument("--cores", default="auto", help="with --arms: " + CORES_HELP)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true", help="with --arms: vLLM's")
    p.add_argument("--dtype", help="with --arms: every engine's --dtype (default: the "
                                   "launcher's, float32 on a CPU without native bfloat16)")
    p.add_argument("--blocks", type=int, default=512, help="KV blocks of each engine")
    p.add_argument("--stem", help="the report's file name (default chat_goodput[_quick])")
    p.add_argument("--quick", action="store_true", help="4 sessions x 3 turns, 1 round")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--isl", type=int, default=128, help="new prompt tokens a turn")
    p.add_argument("--osl", type=int, default=32, help="answer tokens a turn")
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--rates", default="",
                   help="comma-separated request rates (requests a second) to sweep, "
                        "--concurrency their ceiling; none: concurrency alone")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--itl-slo-ms", type=float, default=200.0)
    p.add_argument("--base-port", type=int, default=0)
    p.add_argument("--out-dir", default=str(report.OUT_DIR))
    p.add_argument("--render-only", metavar="JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.rounds = 4, 3, 1
        args.isl, args.osl, args.concurrency = 64, 16, 2
    if args.target and not (args.model and args.tokenizer):
        p.error("--target needs --model and --tokenizer")
    if args.target and args.arms:
        p.error("--target and --arms exclude each other")
    try:
        args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rates: not a list of numbers: {args.rates!r}")
    if any(r <= 0 for r in args.rates):
        p.error("--rates: each rate must be above 0")
    return args


def loads_at(base: aiperf.ChatLoad, targets: dict[str, str], rates: list[float]
             ) -> tuple[dict[str, str], dict[str, aiperf.ChatLoad]]:
    """Each target at each rate (or alone): run name -> URL, run name -> its load."""
    urls, loads = {}, {}
    for name, url in targets.items():
        for rate in rates or [None]:
            key = run_name(name, rate)
            urls[key] = url
            loads[key] = dataclasses.replace(base, request_rate=rate)
    return urls, loads


def measure(targets: dict[str, str], model: str, tokenizer: str,
            loads: dict[str, aiperf.ChatLoad], rounds: int, work: Path, around=None) -> dict:
    """Every run (a target at a load: ``loads_at``) once a round (order reversed every
    other round); per run its pooled figures and each round's.  ``around(name, run)``,
    when given, returns the figures of one run (it calls ``run()``, aiperf's summary,
    between its own reads)."""
    def one(name: str, r: int) -> dict:
        out = work / f"{name}-round{r}"
        run = lambda: aiperf.run(targets[name], model, tokenizer,  # noqa: E731
                                 loads[name], out, work / f"{name}-round{r}.log"
                                 ) | {"dir": str(out)}
        try:
            return around(name, run) if around else run()
        except RuntimeError as exc:
            log(f"{name}: {exc}")
            why = "".join(c for c in str(exc).replace(str(work), "<work>")
                          if c.isascii() and c not in "|\n")
            return {"failed": " ".join(why.split())[-400:]}

    per_round = interleaved(targets, rounds, one)
    out = {}
    for name, rs in per_round.items():
        failed = [x["failed"] for x in rs if "failed" in x]
        if failed:
            out[name] = {"failed": failed[0], "rounds": rs}
            continue
        pooled = aiperf.summarize([Path(x.pop("dir")) for x in rs], loads[name])
        for key in ("router_cpu_s", "prefix_hits", "prefix_queries"):
            if key in rs[0]:
                pooled[key] = sum(x[key] for x in rs)
        out[name] = {"pooled": pooled, "rounds": rs}
    return out


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process and its waited-for children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def measure_arms(args, load: aiperf.ChatLoad, work: Path, meta: dict) -> dict:
    """``--arms``: each cluster started in turn, its arms measured (``measure``) with
    every cache reset before each run; the router's CPU time and the engines' prefix
    hits read around it."""
    if args.model_dir:
        model = args.model_dir
        meta["model"] = Path(model).name
    else:
        model = str(generate_tiny_model(work / "tiny-llama", seed=0))
        meta["model"] = "the tests' tiny Llama"
    keys = [k for k in args.arms.split(",") if k]
    unknown = [k for k in keys if k not in armlib.ARM_BY_KEY or k == "4-nixl-bidi"]
    if unknown:
        raise SystemExit(f"--arms: unknown or chat-less arms {unknown}")
    meta["dtype"] = args.dtype or default_dtype(gpus=False)
    opts = armlib.EngineOptions(
        model=model, max_model_len=args.max_model_len, p_blocks=args.blocks,
        d_blocks=args.blocks, coloc_blocks=args.blocks,
        engine_env=armlib.engine_cores_env(args.cores, None),
        extra_args=["--enable-prompt-tokens-details", "--dtype", meta["dtype"]]
        + (["--enforce-eager"] if args.enforce_eager else []))
    ports = PortPool()
    if args.base_port:   # a range of its own: engines and routers, then UCX's listeners
        ports = PortPool(args.base_port, args.base_port + 899)
        os.environ.setdefault("UCX_TCP_PORT_RANGE", f"{args.base_port + 900}-"
                                                    f"{args.base_port + 999}")
    armlib.ensure_side_venv()
    env_for_bench()
    meta["targets"], results = {}, {}
    for cluster in dict.fromkeys(armlib.ARM_BY_KEY[k].cluster for k in keys):
        arms = [armlib.ARM_BY_KEY[k] for k in keys if armlib.ARM_BY_KEY[k].cluster == cluster]
        run = armlib.start_cluster(cluster, arms, opts, ports, work / "logs")
        try:
            for key, why in armlib.warm_up(run, model).items():
                results[key] = {"failed": why}
            engines = [url for _, url in run.engines]

            def around(key: str, one) -> dict:
                note = armlib.reset(run)
                hits0 = [metric_sums(u, HITS) for u in engines]
                pid = run.pids[split_run(key)[0]]
                cpu0 = cpu_seconds(pid)
                res = one()
                res["router_cpu_s"] = cpu_seconds(pid) - cpu0
                hits = [metric_sums(u, HITS) for u in engines]
                for name, field in zip(HITS, ("prefix_hits", "prefix_queries")):
                    res[field] = sum(h.get(name, 0.0) - h0.get(name, 0.0)
                                     for h, h0 in zip(hits, hits0))
                return res | ({"reset_note": note} if note else {})

            targets, loads = loads_at(load, {a.key: run.routers[a.key] for a in arms
                                             if a.key in run.routers}, args.rates)
            results |= measure(targets, model, model, loads, args.rounds, work, around)
            for a in arms:
                meta["targets"][a.key] = a.label
        finally:
            run.stop()
    return results


def best_goodput(results: dict) -> dict[str, tuple[float, float | None]]:
    """Each target's best goodput over its runs and the rate it came at (None: no run
    met the SLOs, or the target ran at no rate)."""
    best: dict[str, tuple[float, float | None]] = {}
    for name, res in results["targets"].items():
        target, rate = split_run(name)
        g = (res["pooled"]["goodput_rps"] or 0.0) if "pooled" in res else 0.0
        if g > best.get(target, (0.0, None))[0] or target not in best:
            best[target] = (g, rate if g > 0 else None)
    return best


def sweep_lines(results: dict) -> list[str]:
    """The rate sweep's headline: each target's best goodput, and ours (every target
    whose key names ours) over the best of the others'."""
    best, names = best_goodput(results), results["meta"].get("targets", {})
    rows = [[t, names.get(t, ""), f"{g:.3f}", "-" if r is None else f"{r:g}"]
            for t, (g, r) in sorted(best.items(), key=lambda kv: -kv[1][0])]
    lines = ["## Goodput by target: the best over the offered rates", "", *report.table(
        ["target", "what", "goodput req/s", "at rate req/s"], rows), ""]
    peer = max(((g, t) for t, (g, _) in best.items() if "ours" not in t), default=None)
    for t, (g, _) in best.items():
        if "ours" in t and peer is not None:
            lines.append(f"- `{t}` / best peer `{peer[1]}`: {g / peer[0]:.2f}x" if peer[0]
                         else f"- `{t}`: {g:.3f} req/s; no peer met the SLOs at any rate")
    return lines + [""]


def render(results: dict) -> str:
    meta, load = results["meta"], results["load"]
    rates = load.get("rates") or []
    arms = any("router_cpu_s" in r.get("pooled", {}) or "failed" in r
               for r in results["targets"].values())
    pacing = (f"requests paced at each of {', '.join(f'{r:g}' for r in rates)} a second "
              f"(aiperf's `--request-rate`), at most {load['concurrency']} at once"
              if rates else f"{load['concurrency']} sessions at once")
    lines = report.head("Chat goodput (aiperf multi-turn sessions)", meta) + [
        f"aiperf {meta['aiperf_version']}: {load['conversations']} chat sessions x "
        f"{load['turns']} turns, {load['isl']} new prompt tokens and {load['osl']} answer "
        f"tokens a turn (`ignore_eos`, temperature 0), {pacing}, session header "
        f"`{load['session_header']}`; {meta['rounds']} round(s), each "
        "target once a round, pooled. A request is good when its TTFT is at most "
        f"{load['ttft_slo_ms']:g} ms and its ITL (decode time over answer tokens less one) "
        f"at most {load['itl_slo_ms']:g} ms; goodput is good requests per second of "
        "aiperf's benchmark duration, summed over rounds. Percentiles: nearest rank over "
        "the pooled requests. Targets: " + ", ".join(
            f"`{n}` ({d})" for n, d in meta["targets"].items()) + "."
        + (f" Engines in {meta['dtype']}." if meta.get("dtype") else ""), "",
    ]
    if rates:
        lines += sweep_lines(results)
    rows = []
    for name, res in results["targets"].items():
        target, rate = split_run(name)
        head = [target] + ([f"{rate:g}"] if rates else [])
        if "failed" in res:
            rows.append(head + [f"failed: {res['failed'][:200]}"])
            continue
        s = res["pooled"]
        rows.append(head + [s["requests"], s["errors"], s["good_requests"],
                            f"{s['goodput_rps']:.2f} ({s['aiperf_goodput_rps']:.2f})"] + [
            f"{report.ms(s[k + '_p50_s'])} / {report.ms(s[k + '_p99_s'])}"
            for k in ("ttft", "itl", "latency")] + ([
                f"{s['router_cpu_s'] / max(s['requests'], 1) * 1e3:.1f}",
                f"{s['prefix_hits'] / s['prefix_queries'] if s['prefix_queries'] else 0:.1%}"]
                if arms else []))
    lines += report.table(["target"] + (["rate req/s"] if rates else [])
                          + ["requests", "errors", "good", "goodput req/s (aiperf's)",
                             "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "latency p50 / p99 ms"]
                          + (["router CPU ms / request", "prefix hits"] if arms else []), rows)
    if arms:
        lines += ["", "Router CPU: the router process's user and system time over the "
                  "requests, all rounds. Prefix hits: the engines' prefix-cache hits over "
                  "the prompt tokens they were asked for (vLLM's counters), all rounds; "
                  "every cache is reset before each arm's run."]
    return "\n".join(lines) + "\n"


def write(results: dict, out_dir: Path, stem: str) -> None:
    swept = bool(results["load"].get("rates"))
    report.write(out_dir, stem, results, render(results),
                 plot=("sessionkv_bench.sweep", "plot") if swept else None)
    log(f"wrote {out_dir / stem}.md")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stem = args.stem or ("chat_goodput_quick" if args.quick else "chat_goodput")
    if args.render_only:
        path = Path(args.render_only)
        write(json.loads(path.read_text()), Path(args.out_dir), path.stem)
        return 0
    aiperf.ensure_venv()
    load = aiperf.ChatLoad(args.conversations, args.turns, args.isl, args.osl,
                           args.concurrency, args.ttft_slo_ms, args.itl_slo_ms)
    meta = report.meta("chat_goodput.py", sys.argv[1:], PATH_FLAGS) | {"rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="chat-goodput-") as tmp:
        work = Path(tmp)
        if args.target:
            given = dict(t.split("=", 1) for t in args.target)
            meta["targets"] = {n: "given by URL" for n in given}
            targets, loads = loads_at(load, given, args.rates)
            results = measure(targets, args.model, args.tokenizer, loads, args.rounds, work)
        elif args.arms:
            results = measure_arms(args, load, work, meta)
        else:   # the launcher's default cluster on the tiny model
            model = str(generate_tiny_model(work / "tiny-llama", seed=0))
            with LocalCluster(ClusterSpec(model=model, served_model_name="tiny", colocated=True,
                                          redis=True, base_port=args.base_port,
                                          log_dir=work / "logs")) as cluster:
                targets, loads = loads_at(load, {"ours": cluster.proxy_url,
                                                 "colocated": cluster.colocated.url}, args.rates)
                meta["targets"] = {
                    "ours": "our proxy over 1 P + 1 D with our connector, Redis, the "
                            "launcher's defaults",
                    "colocated": "a plain vLLM engine of the same cluster"}
                meta["model"] = "the tests' tiny Llama"
                results = measure(targets, "tiny", model, loads, args.rounds, work)
    first = next((r["pooled"] for r in results.values() if "pooled" in r), {})
    meta["aiperf_version"] = first.get("aiperf_version")
    out = {"meta": meta, "load": load.__dict__ | {"rates": args.rates}, "targets": results}
    write(out, Path(args.out_dir), stem)
    bad = [n for n, r in results.items()
           if "failed" in r or r["pooled"]["errors"] or not r["pooled"]["requests"]]
    if bad:
        log(f"requests failed or none ran: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
