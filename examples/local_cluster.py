#!/usr/bin/env python3
"""Start a local disaggregated deployment: P and D vLLM engines with SessionKVConnector,
KV-event publishers, optional Redis, the sessionkv proxy, and optionally a plain
co-located vLLM server for baselines.

    python examples/local_cluster.py --prefill 1 --decode 1 --proxy-port 8000 \\
        [--redis] [--colocated-port 8300] [--model PATH] [--dtype float32] \\
        [--gpus 0,1] [--kv-cache-gb 1.0] [--decode-kv-cache-gb 0.02] [--cores auto]

Without --model it generates a tiny random Llama (CPU demo) in a temporary folder,
served under a stable name, ``sessionkv-tiny-model`` (``--served-model-name``): the
name requests and ``/v1/models`` use.  When everything is healthy it prints one line

    READY proxy=http://127.0.0.1:8000 colocated=<url or ->

and stays in the foreground; SIGINT or SIGTERM stops every process it started.

On CPU each engine's model thread gets a core of its own (engines in start order:
prefill..., decode..., colocated); with more engines than cores they go round robin
(engine i on core i mod N).  The first line printed says which engine computes on
which core (``--cores`` changes it; ``vllm_sessionkv/dev/cores.py`` gives the reasons).

With --placement each process can run elsewhere: another address (another host, or a
network namespace on this one), a command prefix that runs it there (``ip netns exec
NS``), and environment for it (``UCX_TLS``, ``UCX_NET_DEVICES``)::

    --placement '{"prefill0": {"address": "10.0.0.2", "command_prefix": ["ip", "netns",
                  "exec", "p"], "env": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth1"}}}'

Every address, URL and endpoint the engines, the proxy and Redis are given then uses
that process's address; this script must reach each one (it polls /health).

A child that dies (an engine, the proxy, Redis) is logged and started again on the
same ports while the rest keep serving (``LocalCluster.supervise_once``), with a
growing backoff; after --max-restarts restarts within --restart-window-s it is given
up and left stopped.  --fail-fast instead stops everything and exits 1 when any child
exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from vllm_sessionkv.dev.launch import (
    ChildExited,
    ClusterSpec,
    LocalCluster,
    default_dtype,
    parse_placement,
)

# The generated model's folder name, and the name its engines serve it under.
GENERATED_MODEL_NAME = "sessionkv-tiny-model"


def _parser() -> argparse.ArgumentParser:
    """The launcher's flags (docs/running.md lists each with its default; checked by
    tests/unit/test_docs_options.py)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=int, default=1, help="number of prefill engines")
    p.add_argument("--decode", type=int, default=1, help="number of decode engines")
    p.add_argument("--model", help="HF model directory (default: generate a tiny Llama)")
    p.add_argument("--served-model-name",
                   help="the model's name in requests and /v1/models, on every engine "
                        f"(default: {GENERATED_MODEL_NAME} for the generated model; "
                        "with --model, vLLM's default: the --model value)")
    p.add_argument("--proxy-port", type=int, default=8000)
    p.add_argument("--no-proxy", action="store_true")
    p.add_argument("--colocated-port", type=int,
                   help="also start a plain vLLM server with prefix caching on this port")
    p.add_argument("--redis", action="store_true",
                   help="start redis-server: shared index, sessions and published handles")
    p.add_argument("--policy", choices=["cost", "round_robin"], default="cost")
    p.add_argument("--decode-only-max-uncached-tokens", type=int,
                   help="proxy: serve on D directly below this many uncached prompt tokens "
                        "(-1: always disaggregate)")
    p.add_argument("--base-port", type=int, default=8100,
                   help="engine HTTP, NIXL side-channel and KV-event ports count up from here")
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size in tokens (a multiple of 32 on CPU)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default=None,
                   choices=["bfloat16", "float16", "float32", "auto"],
                   help="every engine's --dtype (the co-located one too); default: "
                        "bfloat16 on GPUs and on CPUs with native bfloat16 (AVX-512 BF16, "
                        "AMX), else float32.  float32 where answers are compared with "
                        "another engine's, since bf16 near-ties flip with how a prefill "
                        "is split")
    p.add_argument("--enforce-eager", action="store_true",
                   help="every engine without torch.compile (vLLM's --enforce-eager): no "
                        "compile warm-up at start, slower steps")
    p.add_argument("--kv-cache-gb", type=float, default=1.0,
                   help="KV cache per engine in GiB on CPU (--kv-cache-memory-bytes)")
    p.add_argument("--decode-kv-cache-gb", type=float,
                   help="KV cache of each D engine in GiB on CPU, in place of --kv-cache-gb "
                        "(P and the co-located server keep that), e.g. a small D whose "
                        "session holds end under KV pressure")
    p.add_argument("--gpus", help="comma-separated CUDA_VISIBLE_DEVICES values, one per engine "
                                  "in order prefill..., decode..., colocated (GPU hosts)")
    p.add_argument("--log-dir", help="engine logs (default: a temporary directory)")
    p.add_argument("--connector", choices=["sessionkv", "nixl"], default="sessionkv",
                   help="'nixl' runs stock NixlConnector (bidirectional) for comparisons")
    p.add_argument("--sessionkv-config", default="{}",
                   help="JSON for kv_connector_extra_config.sessionkv on every engine")
    p.add_argument("--nixl-extra-config", default="{}",
                   help="JSON merged into kv_connector_extra_config (stock NIXL keys)")
    p.add_argument("--no-early-decode", action="store_true",
                   help="send D each disaggregated request after P answers, not while P "
                        "prefills (D engines then open no early-decode socket)")
    p.add_argument("--no-handle-channel", action="store_true",
                   help="D engines send no session handles on a handle channel (without "
                        "--redis, streamed turns then leave the proxy no handle)")
    p.add_argument("--placement", default="{}",
                   help="JSON: process name (prefill0.., decode0.., colocated, redis, proxy) "
                        "-> {address, command_prefix, env}; unnamed ones run here on "
                        "127.0.0.1")
    p.add_argument("--cores", default="auto",
                   help="CPU only: the cores of the engines' model threads. 'auto': one core "
                        "per engine in start order (prefill..., decode..., colocated), round "
                        "robin when there are more engines than cores; 'vllm': vLLM's own "
                        "binding (every engine on the same core here); or one "
                        "VLLM_CPU_OMP_THREADS_BIND value per engine, comma-separated "
                        "('0,1,0'). GPU hosts and --connector nixl keep vLLM's binding. "
                        "The rule applied is printed at start-up")
    p.add_argument("--fail-fast", action="store_true",
                   help="when any child exits, stop everything and exit 1 (no restarts)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one child within --restart-window-s before it is "
                        "given up (0: never restart)")
    p.add_argument("--restart-window-s", type=float, default=600.0)
    p.add_argument("--engine-api-key", metavar="KEY",
                   help="start P and D with vLLM's --api-key KEY; the proxy sends it "
                        "(its engine_api_key)")
    p.add_argument("--api-key", metavar="KEY",
                   help="the proxy asks clients for Authorization: Bearer KEY on /v1/* "
                        "and /metrics (its api_key)")
    p.add_argument("--side-port-secret", metavar="SECRET",
                   help="engines and proxy authenticate the early-decode and handle-"
                        "channel messages with this shared secret (side_port_secret)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    if args.block_size % 32:
        p.error("--block-size must be a multiple of 32 (vLLM's CPU attention)")
    if not args.kv_cache_gb > 0:
        p.error("--kv-cache-gb must be above 0")
    if args.decode_kv_cache_gb is not None and not args.decode_kv_cache_gb > 0:
        p.error("--decode-kv-cache-gb must be above 0")
    if args.max_restarts < 0 or not args.restart_window_s > 0:
        p.error("--max-restarts must be 0 or more and --restart-window-s above 0")
    try:
        placement = parse_placement(json.loads(args.placement))
    except ValueError as exc:  # json.JSONDecodeError is one
        p.error(f"--placement: {exc}")
    # A temporary folder only for what no flag places: the generated model, the logs.
    workdir = None
    if args.model is None or args.log_dir is None:
        workdir = Path(tempfile.mkdtemp(prefix="sessionkv-cluster-"))
    model, served_name = args.model, args.served_model_name
    if model is None:
        from vllm_sessionkv.dev.tiny_model import generate_tiny_model

        model = str(generate_tiny_model(workdir / GENERATED_MODEL_NAME))
        served_name = served_name or GENERATED_MODEL_NAME
    try:
        spec = ClusterSpec(
            model=model, served_model_name=served_name, prefill=args.prefill,
            decode=args.decode,
            colocated=args.colocated_port is not None, colocated_port=args.colocated_port,
            redis=args.redis, proxy=not args.no_proxy, proxy_port=args.proxy_port,
            policy=args.policy, base_port=args.base_port, block_size=args.block_size,
            max_model_len=args.max_model_len, dtype=args.dtype,
            kv_cache_space_gb=args.kv_cache_gb,
            decode_kv_cache_space_gb=args.decode_kv_cache_gb,
            connector=args.connector, sessionkv=json.loads(args.sessionkv_config),
            nixl_extra=json.loads(args.nixl_extra_config),
            engine_extra_args=["--enforce-eager"] if args.enforce_eager else [],
            gpus=args.gpus.split(",") if args.gpus else None,
            early_decode=not args.no_early_decode,
            handle_channel=not args.no_handle_channel, fail_fast=args.fail_fast,
            max_restarts=args.max_restarts, restart_window_s=args.restart_window_s,
            log_dir=Path(args.log_dir) if args.log_dir else workdir / "logs",
            proxy_args=([] if args.decode_only_max_uncached_tokens is None else
                        ["--decode-only-max-uncached-tokens",
                         str(args.decode_only_max_uncached_tokens)]),
            placement=placement, cores=args.cores, engine_api_key=args.engine_api_key,
            api_key=args.api_key, side_port_secret=args.side_port_secret)
    except ValueError as exc:  # a placement naming no process, a bad --cores
        p.error(str(exc))

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    # Where the engines compute, before they start (their start-up takes minutes).
    print(spec.core_plan().rule, flush=True)
    if workdir is not None:
        kept = [what for what, flag in (("the generated model", args.model),
                                         ("the logs", args.log_dir)) if flag is None]
        print(f"work folder (kept after exit): {workdir}: {' and '.join(kept)}", flush=True)
    cluster = LocalCluster(spec)
    started = time.monotonic()
    try:
        cluster.start()
    except Exception as exc:
        print(f"FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    colocated = cluster.colocated.url if cluster.colocated else "-"
    logging.info("healthy after %.0f s; logs in %s; pids %s", time.monotonic() - started,
                 spec.log_dir, cluster.pids)
    # Machine-readable layout for scripts and tests, then the one READY line.
    print("CLUSTER " + json.dumps({
        "proxy": cluster.proxy_url, "redis": cluster.redis_url, "colocated": colocated,
        # The name requests give as "model", and where the engines load it from.
        "model": served_name or model, "model_path": model,
        "dtype": spec.dtype or default_dtype(bool(spec.gpus)),
        "pids": cluster.pids,
        "prefill": [e.url for e in cluster.prefill], "decode": [e.url for e in cluster.decode],
        "kv_events": {e.url: e.kv_events_endpoint for e in cluster.prefill + cluster.decode},
        "early_decode": {e.url: e.early_decode_endpoint for e in cluster.decode
                         if e.early_decode_endpoint},
        "handle_channel": {e.url: e.handle_channel_endpoint for e in cluster.decode
                           if e.handle_channel_endpoint},
        # Engine name -> its model thread's VLLM_CPU_OMP_THREADS_BIND (null: vLLM's).
        "cores": cluster.core_plan.binds,
    }), flush=True)
    print(f"READY proxy={cluster.proxy_url or '-'} colocated={colocated}", flush=True)
    try:
        while not stop.is_set():
            try:
                cluster.supervise_once()
            except ChildExited as exc:  # --fail-fast
                print(exc, file=sys.stderr, flush=True)
                return 1
            stop.wait(1.0)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
