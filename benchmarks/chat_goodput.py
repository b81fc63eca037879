"""Chat goodput: aiperf's multi-turn streamed chat sessions against each target, every
request judged against a TTFT and an ITL SLO (DistServe's goodput: requests per second
meeting both).

    python benchmarks/chat_goodput.py --quick      # a launcher cluster on the tiny model
    python benchmarks/chat_goodput.py --target ours=http://127.0.0.1:8000 \\
        --target colocated=http://127.0.0.1:8100 --model NAME --tokenizer DIR

Without ``--target`` it starts the launcher's default cluster (``LocalCluster``: Redis,
our proxy, 1 P + 1 D with our connector, a plain co-located engine) on the tiny model
and measures ``ours`` (the proxy) and ``colocated``.  Each round runs every target once,
in reverse order every other round; a target's figures pool its requests over the
rounds.  aiperf runs from its own venv (``sessionkv_bench.aiperf``).  Writes
``docs/benchmarks/chat_goodput.{md,json}`` (``chat_goodput_quick.*`` with ``--quick``);
``--render-only JSON`` writes the report again from a run's JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from sessionkv_bench.report import machine_line
from sessionkv_bench.runner import log
from sessionkv_bench import aiperf, report

OUT_DIR = report.REPO / "docs" / "benchmarks"
PATH_FLAGS = {"--tokenizer": "TOKENIZER_DIR", "--out-dir": "OUT_DIR", "--render-only": "JSON"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                   help="an OpenAI-compatible server to measure (repeat); none: start the "
                        "launcher's default cluster on the tiny model")
    p.add_argument("--model", help="the model name the targets serve (with --target)")
    p.add_argument("--tokenizer", help="tokenizer directory for aiperf (with --target)")
    p.add_argument("--quick", action="store_true", help="4 sessions x 3 turns, 1 round")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--isl", type=int, default=128, help="new prompt tokens a turn")
    p.add_argument("--osl", type=int, default=32, help="answer tokens a turn")
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--itl-slo-ms", type=float, default=200.0)
    p.add_argument("--base-port", type=int, default=0)
    p.add_argument("--out-dir", default=str(OUT_DIR))
    p.add_argument("--render-only", metavar="JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.rounds = 4, 3, 1
        args.isl, args.osl, args.concurrency = 64, 16, 2
    if args.target and not (args.model and args.tokenizer):
        p.error("--target needs --model and --tokenizer")
    return args


def measure(targets: dict[str, str], model: str, tokenizer: str, load: aiperf.ChatLoad,
            rounds: int, work: Path) -> dict:
    """Every target once a round (order reversed every other round); per target its
    pooled figures and each round's."""
    runs: dict[str, list[Path]] = {name: [] for name in targets}
    per_round: dict[str, list[dict]] = {name: [] for name in targets}
    names = list(targets)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            out = work / f"{name}-round{r}"
            log(f"round {r + 1}/{rounds}: {name} ({targets[name]})")
            per_round[name].append(aiperf.run(targets[name], model, tokenizer, load, out,
                                              work / f"{name}-round{r}.log"))
            runs[name].append(out)
    return {name: {"pooled": aiperf.summarize(runs[name], load), "rounds": per_round[name]}
            for name in targets}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def render(results: dict) -> str:
    meta, load = results["meta"], results["load"]
    lines = [
        "# Chat goodput (aiperf multi-turn sessions)", "",
        f"{meta['date']}, commit {meta['commit']}. Machine: {meta['machine']}.",
        f"Command: `{meta['command']}`.", "",
        f"aiperf {meta['aiperf_version']}: {load['conversations']} chat sessions x "
        f"{load['turns']} turns, {load['isl']} new prompt tokens and {load['osl']} answer "
        f"tokens a turn (`ignore_eos`, temperature 0), {load['concurrency']} sessions at "
        f"once, session header `{load['session_header']}`; {meta['rounds']} round(s), each "
        "target once a round, pooled. A request is good when its TTFT is at most "
        f"{load['ttft_slo_ms']:g} ms and its ITL (decode time over answer tokens less one) "
        f"at most {load['itl_slo_ms']:g} ms; goodput is good requests per second of "
        "aiperf's benchmark duration, summed over rounds. Percentiles: nearest rank over "
        "the pooled requests. Targets: " + ", ".join(
            f"`{n}` ({d})" for n, d in meta["targets"].items()) + ".", "",
        "| target | requests | errors | good | goodput req/s (aiperf's) | TTFT p50 / p99 ms "
        "| ITL p50 / p99 ms | latency p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results["targets"].items():
        s = res["pooled"]
        lines.append(
            f"| {name} | {s['requests']} | {s['errors']} | {s['good_requests']} | "
            f"{s['goodput_rps']:.2f} ({s['aiperf_goodput_rps']:.2f}) | "
            f"{_ms(s['ttft_p50_s'])} / {_ms(s['ttft_p99_s'])} | "
            f"{_ms(s['itl_p50_s'])} / {_ms(s['itl_p99_s'])} | "
            f"{_ms(s['latency_p50_s'])} / {_ms(s['latency_p99_s'])} |")
    return "\n".join(lines) + "\n"


def write(results: dict, out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(render(results))
    log(f"wrote {out_dir / stem}.md")


def _launcher_cluster(args, work: Path):
    from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster
    from vllm_sessionkv.dev.tiny_model import generate_tiny_model

    model = str(generate_tiny_model(work / "tiny-llama", seed=0))
    spec = ClusterSpec(model=model, served_model_name="tiny", colocated=True, redis=True,
                       base_port=args.base_port, log_dir=work / "logs")
    return LocalCluster(spec), model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stem = "chat_goodput_quick" if args.quick else "chat_goodput"
    if args.render_only:
        path = Path(args.render_only)
        write(json.loads(path.read_text()), Path(args.out_dir), path.stem)
        return 0
    aiperf.ensure_venv()
    load = aiperf.ChatLoad(args.conversations, args.turns, args.isl, args.osl,
                           args.concurrency, args.ttft_slo_ms, args.itl_slo_ms)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": report.commit(), "machine": machine_line(), "rounds": args.rounds,
            "command": report.public_command("chat_goodput.py", sys.argv[1:], PATH_FLAGS)}
    with tempfile.TemporaryDirectory(prefix="chat-goodput-") as tmp:
        work = Path(tmp)
        if args.target:
            targets = dict(t.split("=", 1) for t in args.target)
            meta["targets"] = {n: "given by URL" for n in targets}
            results = measure(targets, args.model, args.tokenizer, load, args.rounds, work)
        else:
            cluster, model = _launcher_cluster(args, work)
            with cluster:
                targets = {"ours": cluster.proxy_url, "colocated": cluster.colocated.url}
                meta["targets"] = {
                    "ours": "our proxy over 1 P + 1 D with our connector, Redis, the "
                            "launcher's defaults",
                    "colocated": "a plain vLLM engine of the same cluster"}
                meta["model"] = "the tests' tiny Llama"
                results = measure(targets, "tiny", model, load, args.rounds, work)
    first = next(iter(results.values()))["pooled"]
    meta["aiperf_version"] = first["aiperf_version"]
    out = {"meta": meta, "load": load.__dict__, "targets": results}
    write(out, Path(args.out_dir), stem)
    bad = [n for n, r in results.items() if r["pooled"]["errors"] or not r["pooled"]["requests"]]
    if bad:
        log(f"requests failed or none ran: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
