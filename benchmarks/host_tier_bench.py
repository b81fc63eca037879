#!/usr/bin/env python3
"""Restore-from-host-DRAM against recompute, side by side, at several context lengths.

Starts one vLLM engine with SessionKVConnector and a host-DRAM tier (tiny generated
model unless --model).  For each context length and round, in random order:

* **recompute**: a fresh prompt of that length (in no cache), ``max_tokens=1``;
* **restore**: a prompt of that length whose session turn was offloaded to host DRAM
  and then dropped from the engine's KV cache (``/reset_prefix_cache``), again with
  ``max_tokens=1``: everything but the last block comes back from host.

It prints medians of the request latency and their ratio, plus the engine's own
``sessionkv_host_restore_seconds``.  Absolute times on a shared 2-core machine are
noise; the ratio, measured in one run, is the figure.

    python benchmarks/host_tier_bench.py [--contexts 256 1024 2048 3584] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

from sessionkv_bench.metrics import metric_sum  # noqa: E402

from vllm_sessionkv.dev.launch import EngineSpec, free_port, start_engine, stop_all, wait_healthy  # noqa: E402


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1000) for _ in range(n)]


def _complete(url: str, model: str, prompt: list[int], session: str | None = None) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if session:
        body["kv_transfer_params"] = {"sessionkv": {"session_id": session}}
        body["session_id"] = session
    started = time.perf_counter()
    resp = requests.post(url + "/v1/completions", json=body, timeout=300)
    elapsed = time.perf_counter() - started
    resp.raise_for_status()
    return elapsed


def _reset_device_cache(url: str, lease_s: float) -> None:
    time.sleep(lease_s + 0.3)           # the session turn's device hold lapses
    for _ in range(50):
        resp = requests.post(url + "/reset_prefix_cache", timeout=30)
        if resp.status_code == 200:
            return
        time.sleep(0.2)
    raise RuntimeError(f"reset_prefix_cache kept failing: {resp.status_code} {resp.text}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048, 3584])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--host-gb", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)

    workdir = Path(tempfile.mkdtemp(prefix="sessionkv-host-bench-"))
    model = args.model
    if model is None:
        from vllm_sessionkv.dev.tiny_model import generate_tiny_model

        model = str(generate_tiny_model(workdir / "tiny-llama"))
    lease_s = 0.5
    spec = EngineSpec(role="decode", model=model, port=free_port(),
                      side_channel_port=free_port(),
                      sessionkv={"host_tier_bytes": int(args.host_gb * 2**30),
                                 "session_lease_s": lease_s, "superseded_hold_grace_s": 0.1})
    proc = start_engine(spec, "engine", workdir / "logs")
    try:
        wait_healthy([(proc, spec.url)], timeout_s=400)
        url = spec.url
        _complete(url, model, _ids(0, 64))  # warm-up: first-request compilation
        results: dict[int, dict[str, list[float]]] = {
            c: {"recompute": [], "restore": []} for c in args.contexts}
        restore_s_before = metric_sum(url, "sessionkv_host_restore_seconds_sum")
        restore_n_before = metric_sum(url, "sessionkv_host_restore_seconds_count")
        for rnd in range(args.rounds):
            order = [(c, arm) for c in args.contexts for arm in ("recompute", "restore")]
            rng.shuffle(order)
            for ctx, arm in order:
                prompt = _ids(1000 * rnd + ctx + (0 if arm == "recompute" else 7), ctx)
                if arm == "recompute":
                    results[ctx][arm].append(_complete(url, model, prompt))
                    continue
                session = f"bench-{rnd}-{ctx}"
                # The session's turn: prompt minus its last block is offloaded at the end.
                _complete(url, model, prompt[:-32], session)
                _reset_device_cache(url, lease_s)
                results[ctx][arm].append(_complete(url, model, prompt))
        restore_s = metric_sum(url, "sessionkv_host_restore_seconds_sum") - restore_s_before
        restore_n = metric_sum(url, "sessionkv_host_restore_seconds_count") - restore_n_before
        restored_tokens = metric_sum(url, 'sessionkv_prompt_tokens_total{engine="0",'
                                       f'model_name="{model}",source="pulled_from_host"}}')
    finally:
        stop_all([proc])

    print(f"host-DRAM restore vs recompute, tiny Llama (1,024 KV bytes/token), "
          f"{args.rounds} rounds, medians of request latency (max_tokens=1)")
    print(f"{'context':>8} {'recompute ms':>13} {'restore ms':>11} {'restore/recompute':>18}")
    for ctx in args.contexts:
        rec = statistics.median(results[ctx]["recompute"]) * 1e3
        res = statistics.median(results[ctx]["restore"]) * 1e3
        print(f"{ctx:>8} {rec:>13.1f} {res:>11.1f} {res / rec:>18.2f}")
    if restore_n:
        print(f"engine-side host copy: {restore_n:.0f} restores, mean "
              f"{restore_s / restore_n * 1e3:.2f} ms; {restored_tokens:.0f} tokens restored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
