"""Whole-request latency of each engine in the launcher's default cluster, straight
to each engine, one request at a time, engines interleaved request by request.

    python benchmarks/engine_latency.py                  # tiny model
    python benchmarks/engine_latency.py --model-dir DIR  # the real model (sessionkv-real-model DIR)

The cluster is what ``examples/local_cluster.py --colocated-port N`` starts (1 P and
1 D with our connector, the proxy, a plain co-located engine; cores ``auto``).  Each
round sends ``--requests`` streamed completions to every engine in turn (P, D, plain;
reversed every other round), in two spacings:

* ``back_to_back``: the next request as soon as the last one ended, whatever engine;
* ``settled``: ``--settle-s`` of quiet before each request, longer than the 1 s a
  plain vLLM engine's worker and engine core spin on their queues after their last
  step, so no engine is measured beside another one's spin.

A request's figure is its whole latency (sent to last byte); an engine's figure pools
its requests over the rounds (``sessionkv_bench.stats.pct``), as a ratio to the plain
engine's; vLLM's own timings of each engine, read between rounds, split it into the
engine core's part, the API server's and the HTTP exchange.  ``--cores`` moves the
engines' model threads (a plain engine's spin costs whoever computes beside it).
``--connector nixl``: vLLM's stock ``NixlConnector`` on P and D (report ``..._nixl``),
what NIXL alone costs an engine, against which our connector's part is read.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from sessionkv_bench import report
from sessionkv_bench.client import completion_bodies, sse_chunks
from sessionkv_bench.metrics import metric_sums
from sessionkv_bench.stats import pct

from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster
from vllm_sessionkv.dev.real_model import SERVED_NAME
from vllm_sessionkv.dev.tiny_model import generate_tiny_model

PLAIN = "plain"
SPACINGS = ("back_to_back", "settled")
# vLLM's own request timings: e2e from the API server's arrival to the last token,
# inference from the engine core's first schedule of the request to it.
ENGINE_TIMES = ("vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count",
                "vllm:request_inference_time_seconds_sum")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", help="the real model's folder (sessionkv-real-model DIR); "
                                       "default: the tests' tiny model")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=8, help="per engine, round and spacing")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--settle-s", type=float, default=1.5)
    p.add_argument("--base-port", type=int, default=0)
    p.add_argument("--cores", default="auto", help="the launcher's --cores (P,D,plain)")
    p.add_argument("--connector", choices=("sessionkv", "nixl"), default="sessionkv",
                   help="P's and D's connector: ours, or vLLM's stock NixlConnector")
    p.add_argument("--out-dir", default=str(report.OUT_DIR))
    return p.parse_args(argv)


async def _latency(session, url: str, body: dict) -> float:
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for _ in sse_chunks(resp):
            pass
    return time.perf_counter() - started


async def measure(urls: dict[str, str], model: str, args, spans: list[dict]) -> list[dict]:
    """The samples; ``spans`` gets each engine's ENGINE_TIMES over each spacing's block."""
    names = list(urls)
    bodies = iter(completion_bodies(model, 100_000, args.prompt_len, args.max_tokens, 1))
    samples: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for name in names * 4:   # warm-up
            await _latency(session, urls[name], {**next(bodies), "model": model})
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            for spacing in SPACINGS:
                before = {n: metric_sums(u, ENGINE_TIMES) for n, u in urls.items()}
                await asyncio.sleep(args.settle_s)
                for _ in range(args.requests):
                    for name in order:
                        if spacing == "settled":
                            await asyncio.sleep(args.settle_s)
                        s = await _latency(session, urls[name], {**next(bodies), "model": model})
                        samples.append({"round": rnd, "spacing": spacing, "engine": name,
                                        "latency_s": s})
                for n, u in urls.items():
                    after = metric_sums(u, ENGINE_TIMES)
                    spans.append({"round": rnd, "spacing": spacing, "engine": n} | {
                        k.split(":")[1]: after.get(k, 0.0) - before[n].get(k, 0.0)
                        for k in ENGINE_TIMES})
    return samples


def summarize(samples: list[dict], names: list[str]) -> dict:
    def latencies(spacing: str, engine: str, rnd: int | None = None) -> list[float]:
        return [r["latency_s"] for r in samples if (r["spacing"], r["engine"]) == (spacing, engine)
                and rnd in (None, r["round"])]

    out: dict = {}
    for spacing in SPACINGS:
        rounds = sorted({r["round"] for r in samples if r["spacing"] == spacing})
        plain = latencies(spacing, PLAIN)
        out[spacing] = {name: {
            "p50_ratio": pct(latencies(spacing, name), 0.5) / pct(plain, 0.5),
            "p99_ratio": pct(latencies(spacing, name), 0.99) / pct(plain, 0.99),
            "rounds": [round(pct(latencies(spacing, name, k), 0.5)
                             / pct(latencies(spacing, PLAIN, k), 0.5), 2) for k in rounds],
            "n": len(latencies(spacing, name))} for name in names}
    return out


def engine_split(samples: list[dict], spans: list[dict], names: list[str]) -> dict:
    """Per spacing and engine, mean seconds: the client's latency, vLLM's e2e and
    inference (ENGINE_TIMES)."""
    out: dict = {}
    for spacing, name in ((sp, n) for sp in SPACINGS for n in names):
        sp = [s for s in spans if s["spacing"] == spacing and s["engine"] == name]
        n = sum(s["e2e_request_latency_seconds_count"] for s in sp) or 1.0
        client = [r["latency_s"] for r in samples if (r["spacing"], r["engine"]) == (spacing, name)]
        out.setdefault(spacing, {})[name] = {
            "client": sum(client) / len(client),
            "e2e": sum(s["e2e_request_latency_seconds_sum"] for s in sp) / n,
            "inference": sum(s["request_inference_time_seconds_sum"] for s in sp) / n}
    return out


def render(result: dict) -> str:
    rows = [[spacing, name, f"{f['p50_ratio']:.2f}x", f"{f['p99_ratio']:.2f}x",
             ", ".join(f"{x:.2f}" for x in f["rounds"])]
            for spacing, fig in result["figures"].items() for name, f in fig.items()]
    lines = report.head(f"Whole-request latency, engine by engine ({result['model']})",
                        result["meta"])
    who = "vLLM's stock NixlConnector" if result.get("connector") == "nixl" else "our connector"
    lines += [f"{result['cores']}. P and D run {who}.", "",
              f"Ratios to the plain co-located engine's figure in the same spacing; "
              f"{result['requests_per_engine']} requests per engine and spacing, pooled "
              f"over {result['rounds']} rounds; {result['max_tokens']} streamed tokens "
              f"after a {result['prompt_len']}-token prompt.", ""]
    lines += report.table(["spacing", "engine", "latency p50", "latency p99", "rounds (p50)"],
                          rows)
    lines += ["", "Where the time goes: means in ms (ratio to the plain engine's). vLLM's e2e "
              "runs from its API server's arrival of the request to its last token, its "
              "inference from the engine core's first schedule of it; e2e less inference is "
              "the API server's and the queue's part, the client's latency less e2e the HTTP "
              "exchange.", ""]
    lines += report.table(["spacing", "engine", "client", "vLLM e2e", "inference",
                           "e2e less inference", "client less e2e"], [
        [spacing, name] + [f"{f[k] * 1e3:.1f} ({f[k] / fig[PLAIN][k]:.2f}x)"
                           for k in ("client", "e2e", "inference")]
        + [f"{(f['e2e'] - f['inference']) * 1e3:.1f}", f"{(f['client'] - f['e2e']) * 1e3:.1f}"]
        for spacing, fig in result["engine_split"].items() for name, f in fig.items()])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    meta = report.meta("engine_latency.py", argv, {"--out-dir": "OUT_DIR",
                                                   "--model-dir": "MODEL_DIR"})
    tmp = Path(tempfile.mkdtemp(prefix="skv-engine-latency-"))
    if args.model_dir:
        model, served = args.model_dir, SERVED_NAME
    else:
        served = "sessionkv-tiny-model"
        model = str(generate_tiny_model(tmp / served))
    cluster = LocalCluster(ClusterSpec(model=model, served_model_name=served, colocated=True,
                                       base_port=args.base_port, log_dir=tmp / "logs",
                                       cores=args.cores, connector=args.connector,
                                       proxy=args.connector == "sessionkv"))
    print(cluster.core_plan.rule, flush=True)
    with cluster.start():
        urls = {"P": cluster.prefill[0].url, "D": cluster.decode[0].url,
                PLAIN: cluster.colocated.url}
        samples = asyncio.run(measure(urls, served, args, spans := []))
    result = {"meta": meta,
              "model": "SmolLM2-135M-Instruct" if args.model_dir else "tiny model",
              "cores": cluster.core_plan.rule, "rounds": args.rounds, "connector": args.connector,
              "requests_per_engine": args.rounds * args.requests,
              "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
              "figures": summarize(samples, list(urls)), "samples": samples,
              "engine_split": engine_split(samples, spans, list(urls)), "spans": spans}
    stem = ("engine_latency_real" if args.model_dir else "engine_latency") + (
        "_nixl" if args.connector == "nixl" else "")
    report.write(Path(args.out_dir), stem, result, render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
