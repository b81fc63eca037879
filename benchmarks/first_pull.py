#!/usr/bin/env python3
"""D's first pull from a P it has never talked to, under two UCX error-handling modes.

NIXL's default UCX error handling, ``peer``, rules out UCX's shared-memory transports,
so two engines on one host exchange messages over TCP, and setting up that connection
needs UCX progress on the remote engine.  ``none`` (our CPU default,
``nixl_ucx_error_handling``) lets UCX use shared memory for messages and CMA for reads.

One run, both modes side by side: one D per mode stays up; every round starts a fresh
P per mode (in random order), keeps that mode's D busy with concurrent long decodes,
sends a prompt to P (``do_remote_decode``), then P's handle to D, and times D's
answer: handshake, first read and 8 decode steps.  A second pull from the same P is
timed too (no handshake).  Prints every time, the medians, and their ratio.

    .venv/bin/python benchmarks/first_pull.py --rounds 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests

from vllm_sessionkv.dev.launch import EngineSpec, free_port, start_engine, stop_all, wait_healthy

MODES = ("peer", "none")


def _body(model: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


def _spec(role: str, model: str, mode: str, extra: dict) -> EngineSpec:
    return EngineSpec(role, model, free_port(), side_channel_port=free_port(),
                      sessionkv={**extra, "nixl_ucx_error_handling": mode})


def _keep_busy(url: str, model: str, stop: threading.Event, rng: random.Random) -> None:
    while not stop.is_set():
        prompt = [rng.randrange(20, 900) for _ in range(60)]
        try:
            requests.post(url + "/v1/completions", json=_body(model, prompt, 300), timeout=300)
        except requests.RequestException:
            time.sleep(0.5)


def _pull_s(p_url: str, d_url: str, model: str, rng: random.Random) -> float:
    prompt = [rng.randrange(20, 900) for _ in range(140)]
    fresh = {"do_remote_decode": True, "do_remote_prefill": False}
    params = requests.post(p_url + "/v1/completions",
                           json=_body(model, prompt, 1, kv_transfer_params=fresh),
                           timeout=120).json()["kv_transfer_params"]
    started = time.perf_counter()
    reply = requests.post(d_url + "/v1/completions",
                          json=_body(model, prompt, 8, kv_transfer_params=params), timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model dir (default: generate the tiny test model)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--load", type=int, default=2, help="concurrent decodes on D")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessionkv", default="{}",
                        help="more kv_connector_extra_config.sessionkv keys, as JSON")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="first-pull-"))
    log_dir = Path(args.log_dir) if args.log_dir else work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from vllm_sessionkv.dev.tiny_model import generate_tiny_model

        model = str(generate_tiny_model(work / "tiny-llama", seed=0))

    extra = json.loads(args.sessionkv)
    decodes = {mode: _spec("decode", model, mode, extra) for mode in MODES}
    procs = {mode: start_engine(spec, f"decode-{mode}", log_dir)
             for mode, spec in decodes.items()}
    first: dict[str, list[float]] = {mode: [] for mode in MODES}
    second: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        wait_healthy([(procs[m], decodes[m].url) for m in MODES], timeout_s=600)
        for round_no in range(args.rounds):
            for mode in rng.sample(MODES, len(MODES)):
                prefill = _spec("prefill", model, mode, extra)
                p_proc = start_engine(prefill, f"prefill-{mode}-{round_no}", log_dir)
                stop = threading.Event()
                load = [threading.Thread(target=_keep_busy, daemon=True,
                                         args=(decodes[mode].url, model, stop,
                                               random.Random(rng.random())))
                        for _ in range(args.load)]
                try:
                    wait_healthy([(p_proc, prefill.url)], timeout_s=600)
                    for thread in load:
                        thread.start()
                    time.sleep(1.0)
                    first[mode].append(_pull_s(prefill.url, decodes[mode].url, model, rng))
                    second[mode].append(_pull_s(prefill.url, decodes[mode].url, model, rng))
                    print(f"round {round_no} {mode}: first pull {first[mode][-1]:.2f} s, "
                          f"second {second[mode][-1]:.2f} s", flush=True)
                finally:
                    stop.set()
                    for thread in load:
                        thread.join(timeout=300)
                    stop_all([p_proc])
    finally:
        stop_all(list(procs.values()))

    print(f"\n## D's first pull from a new P, {args.rounds} rounds, "
          f"{args.load} concurrent decodes on D, sessionkv {extra}\n")
    print("| ucx error handling | first pulls (s) | median | max | second pull median |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        times = ", ".join(f"{t:.2f}" for t in first[mode])
        print(f"| {mode} | {times} | {statistics.median(first[mode]):.2f} | "
              f"{max(first[mode]):.2f} | {statistics.median(second[mode]):.2f} |")
    ratio = statistics.median(first["peer"]) / statistics.median(first["none"])
    print(f"\nmedian first pull, peer / none: {ratio:.1f}x")


if __name__ == "__main__":
    main()
