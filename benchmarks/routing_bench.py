"""Cost routing vs round-robin on one real 2P+2D cluster, measured side by side.

One run starts 2 prefill + 2 decode vLLM engines (SessionKVConnector, KV events),
Redis and two proxies on the same engines: ``--policy cost`` (Redis index, KV event
subscribers) and ``--policy round_robin``.  It prints:

1. **Prefill work per arm.**  The same workload goes through each proxy: 8 sessions
   of 6 chat turns, interleaved (every turn, the sessions go in a seeded shuffled
   order, the same in every arm, so round-robin cannot line up with the sessions by
   accident), temperature 0, 100-200 new tokens a turn.  Per arm: prompt tokens the
   engines computed, from the deltas of ``sessionkv_prompt_tokens_total{source=...}``
   summed over all four engines (authoritative), next to the per-request P and D
   accounting headers; then the ratio round_robin / cost.  Between arms every
   engine's prefix cache is reset (``POST /reset_prefix_cache``).  D keeps session
   KV under a lease (120 s), which makes D's reset fail while it runs, so each arm
   also uses its own ``cache_salt``: no arm can hit blocks another arm left behind.
   The salt changes block hashes only, not the tokens or the outputs; the outputs of
   both arms are checked equal.
2. **Proxy-added latency**, ``max_tokens=1``: the same short request through the
   cost proxy (it routes decode-only: the prompt is below the decode-only
   threshold) and directly to the D engine the proxy picked, alternating, after
   warm-up, so both paths do identical engine work (a prefix-cache hit of the same
   prompt on the same engine).  The difference is what the proxy adds: parsing,
   tokenization by a P engine (chat) or none (token-id prompt), index and session
   lookups in Redis, the policy, and the extra HTTP hop.
3. **Routing decision time** (index lookup + session lookup + ``policy.route``) for a
   4096-token prompt (128 blocks of 32) at 10K, 100K and 1M indexed blocks, memory
   and Redis backends (a private redis-server), populated like
   ``benchmarks/index_bench.py``; run after the cluster has stopped.

    PYTHONPATH=.:proxy .venv/bin/python benchmarks/routing_bench.py
    PYTHONPATH=.:proxy .venv/bin/python benchmarks/routing_bench.py --rounds 2 --skip-index
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import requests

REPO = Path(__file__).resolve().parent.parent

from sessionkv_proxy import policy  # noqa: E402
from sessionkv_proxy.index import MemoryIndex  # noqa: E402
from sessionkv_bench.stats import pct  # noqa: E402
from sessionkv_proxy.index.redis import RedisIndex  # noqa: E402
from vllm_sessionkv.wire.hashing import request_keys  # noqa: E402
from vllm_sessionkv.dev.launch import (  # noqa: E402
    ClusterSpec,
    LocalCluster,
    free_port,
    start_process,
    stop_all,
    wait_healthy,
)
from vllm_sessionkv.dev.workload import new_tokens, system_prompt, user_message  # noqa: E402

CHAT = "/v1/chat/completions"
SOURCES = ("local_hit", "pulled_from_peer", "pulled_from_host", "recomputed",
           "refused_by_verification")
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of (cost, round_robin), arm order drawn per round")
    p.add_argument("--latency-pairs", type=int, default=150)
    p.add_argument("--index-sizes", default="10000,100000,1000000")
    p.add_argument("--index-backends", default="memory,redis")
    p.add_argument("--decisions", type=int, default=1000, help="timed decisions per size")
    p.add_argument("--skip-index", action="store_true")
    p.add_argument("--index-only", action="store_true", help="only part 3, no cluster")
    p.add_argument("--model", help="HF model dir (default: generate the tiny Llama)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", help="engine and proxy logs (default: a temp dir)")
    return p.parse_args()


# --------------------------------------------------------------------------- metrics


def prompt_token_metrics(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=30).text
    out = dict.fromkeys(SOURCES, 0.0)
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line)
        if not m or m.group(1) != "sessionkv_prompt_tokens_total":
            continue
        for source in SOURCES:
            if f'source="{source}"' in (m.group(2) or ""):
                out[source] += float(m.group(3))
    return out


def all_metrics(urls: list[str]) -> dict[str, float]:
    total = dict.fromkeys(SOURCES, 0.0)
    for url in urls:
        for k, v in prompt_token_metrics(url).items():
            total[k] += v
    return total


def reset_caches(urls: list[str]) -> dict[str, bool]:
    out = {}
    for url in urls:
        resp = requests.post(url + "/reset_prefix_cache", timeout=30)
        resp.raise_for_status()
        out[url] = bool(resp.json().get("success", False)) if resp.content else True
    return out


def run_arm(proxy: str, model: str, engines: list[str], args, orders: list[list[int]],
            tag: str) -> dict:
    """Drive the interleaved multi-turn workload through ``proxy``."""
    salt = f"routing-bench-{tag}-{uuid.uuid4().hex[:8]}"
    history = {s: [{"role": "system", "content": system_prompt(s)}]
               for s in range(args.sessions)}
    header_sum = {"P": dict.fromkeys(SOURCES, 0), "D": dict.fromkeys(SOURCES, 0)}
    routes: dict[str, int] = {}
    outputs: dict[tuple[int, int], list[int]] = {}
    before = all_metrics(engines)
    started = time.perf_counter()
    http = requests.Session()
    for turn in range(args.turns):
        for s in orders[turn]:
            history[s].append({"role": "user", "content": user_message(s, turn)})
            body = {"model": model, "messages": history[s], "max_tokens": new_tokens(s, turn),
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                    "cache_salt": salt, "prompt_cache_key": f"{tag}-session-{s}"}
            resp = http.post(proxy + CHAT, json=body, timeout=600)
            if resp.status_code != 200:
                raise RuntimeError(f"{tag}: {resp.status_code} {resp.text[:500]}")
            out = resp.json()
            choice = out["choices"][0]
            outputs[(s, turn)] = list(choice.get("token_ids") or [])
            routes[resp.headers.get("x-sessionkv-route", "?")] = \
                routes.get(resp.headers.get("x-sessionkv-route", "?"), 0) + 1
            for side, name in (("P", "x-sessionkv-prefill"), ("D", "x-sessionkv-decode")):
                acct = json.loads(resp.headers.get(name) or "{}")
                for source in SOURCES:
                    header_sum[side][source] += int(acct.get(f"{source}_tokens", 0))
            history[s].append({"role": "assistant",
                               "content": choice["message"]["content"] or ""})
    wall_s = time.perf_counter() - started
    time.sleep(3.0)  # vLLM publishes connector stats with the next scheduler steps
    after = all_metrics(engines)
    delta = {k: after[k] - before[k] for k in SOURCES}
    return {"tag": tag, "wall_s": wall_s, "metrics": delta, "headers": header_sum,
            "routes": routes, "outputs": outputs}


# --------------------------------------------------------------------------- latency
def latency(proxy: str, model: str, decode: list[str], pairs: int, kind: str) -> dict:
    if kind == "chat":
        path = CHAT
        body = {"model": model, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": "kato rimu senlo vaqu zipe " * 10}]}
    else:
        path = "/v1/completions"
        body = {"model": model, "max_tokens": 1, "temperature": 0,
                "prompt": [(7 * i + 3) % 900 + 20 for i in range(64)]}
    http = requests.Session()
    for url in decode:  # warm: the prompt's blocks cached on both D
        for _ in range(3):
            http.post(url + path, json=body, timeout=60).raise_for_status()
    via, direct, routes = [], [], {}
    for i in range(pairs + 5):
        t = time.perf_counter()
        resp = http.post(proxy + path, json=body, timeout=60)
        via_s = time.perf_counter() - t
        resp.raise_for_status()
        d_url = resp.headers["x-sessionkv-decode-engine"]
        route = resp.headers.get("x-sessionkv-route")
        routes[route] = routes.get(route, 0) + 1
        t = time.perf_counter()
        http.post(d_url + path, json=body, timeout=60).raise_for_status()
        direct_s = time.perf_counter() - t
        if i >= 5:
            via.append(via_s)
            direct.append(direct_s)
    return {"kind": kind, "via": via, "direct": direct, "routes": routes}


# --------------------------------------------------------------------------- decisions
async def decision_bench(backend: str, size: int, redis_url: str | None, n: int,
                         seed: int) -> dict:
    from index_bench import populate

    engines = ["http://p0", "http://p1", "http://d0", "http://d1"]
    pargs = SimpleNamespace(engines=4, prompt_blocks=128, shared_blocks=16)
    if backend == "memory":
        index = MemoryIndex(max_blocks_per_slot=None)
    else:
        index = RedisIndex.from_url(redis_url, namespace=f"rbench-{uuid.uuid4().hex}",
                                    max_blocks_per_slot=None)
    rng = random.Random(seed)
    try:
        t0 = time.perf_counter()
        chains = await populate(index, size, pargs, rng)
        populate_s = time.perf_counter() - t0
        # populate() names engines "engine-<slot>"; map them onto 2 P and 2 D.
        rename = {f"engine-{i}": url for i, url in enumerate(engines)}
        workers = [policy.WorkerLoad(url=u, role=policy.Role.PREFILL if "p" in u[7:] else
                                     policy.Role.DECODE, active_requests=i,
                                     active_prefill_blocks=4.0 * i)
                   for i, u in enumerate(engines)]
        params = policy.routing_params_from_config({})
        held = [c for c in chains if len(c) >= 100] or chains
        queries = []
        for _ in range(n):
            chain = rng.choice(held)[:100]
            queries.append(chain + [rng.getrandbits(64) for _ in range(128 - len(chain))])
        for q in queries[:50]:
            await index.lookup(q)
        samples, lookups = [], []
        for q in queries:
            t = time.perf_counter()
            match = await index.lookup(q)
            await index.get_session("no-such-session")
            t_lookup = time.perf_counter()
            match = {rename.get(e, e): tiers for e, tiers in match.items()}
            policy.route(policy.RouteInput(prompt_tokens=128 * 32, block_size=32,
                                           now_s=time.time(),
                                           overlaps=policy.overlaps_from_match(match)),
                         workers, params, rng)
            samples.append(time.perf_counter() - t)
            lookups.append(t_lookup - t)
        blocks = await index.size()
    finally:
        # No clear(): the redis-server is private and killed afterwards, and a
        # clear of 1M entries outlasts the client's read timeout.
        await index.close()
    return {"backend": backend, "blocks": blocks, "populate_s": populate_s,
            "p50_us": pct(samples, 0.5) * 1e6, "p99_us": pct(samples, 0.99) * 1e6,
            "lookup_p50_us": pct(lookups, 0.5) * 1e6}


def index_decisions(args) -> None:
    from index_bench import start_redis

    redis_proc, redis_url, _ = start_redis()
    try:
        print("\n== routing decision: index lookup + session lookup + policy.route, "
              "4096-token prompt (128 blocks), 2P+2D workers ==", flush=True)
        tokens = list(range(128 * 32))
        t = time.perf_counter()
        for _ in range(100):
            request_keys(tokens, 32)
        print(f"(hashing the prompt into request keys, not included: "
              f"{(time.perf_counter() - t) / 100 * 1e6:.0f} us)")
        print(f"{'backend':8} {'blocks':>9} {'populate_s':>10} {'p50 us':>9} "
              f"{'p99 us':>9} {'lookup p50 us':>14}")
        for backend in args.index_backends.split(","):
            for size in (int(s) for s in args.index_sizes.split(",")):
                r = asyncio.run(decision_bench(backend, size, redis_url,
                                               args.decisions, args.seed))
                print(f"{r['backend']:8} {r['blocks']:>9} {r['populate_s']:>10.1f} "
                      f"{r['p50_us']:>9.1f} {r['p99_us']:>9.1f} "
                      f"{r['lookup_p50_us']:>14.1f}", flush=True)
    finally:
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


# --------------------------------------------------------------------------- main
def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.index_only:
        index_decisions(args)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    log_dir = Path(args.log_dir) if args.log_dir else workdir / "logs"
    model = args.model
    if model is None:
        from vllm_sessionkv.dev.tiny_model import generate_tiny_model

        model = str(generate_tiny_model(workdir / "tiny-llama", seed=0))
    rng = random.Random(args.seed)
    orders = []
    for _ in range(args.turns):
        order = list(range(args.sessions))
        rng.shuffle(order)
        orders.append(order)

    t_start = time.perf_counter()
    cluster = LocalCluster(ClusterSpec(model=model, prefill=2, decode=2, redis=True,
                                       policy="cost", log_dir=log_dir))
    rr_proc = None
    try:
        cluster.start()
        engines = [e.url for e in cluster.prefill + cluster.decode]
        rr_port = free_port()
        argv = [sys.executable, "-m", "sessionkv_proxy", "--port", str(rr_port),
                "--policy", "round_robin", "--block-size", str(cluster.spec.block_size)]
        for flag, group in (("--prefill", cluster.prefill), ("--decode", cluster.decode)):
            argv += [a for e in group for a in (flag, e.url)]
        rr_proc = start_process("proxy-round-robin", argv, log_dir)
        rr_url = f"http://127.0.0.1:{rr_port}"
        wait_healthy([(rr_proc, rr_url)], timeout_s=60)
        print(f"cluster up in {time.perf_counter() - t_start:.0f} s: 2 P, 2 D, Redis, "
              f"proxies cost={cluster.proxy_url} round_robin={rr_url}; logs {log_dir}",
              flush=True)
        arms = {"cost": cluster.proxy_url, "round_robin": rr_url}
        print(f"\n== prefill work: {args.sessions} sessions x {args.turns} turns, "
              f"interleaved, {sum(new_tokens(s, t) for s in range(args.sessions) for t in range(args.turns))} "
              "new tokens per arm ==", flush=True)
        results: dict[str, list[dict]] = {"cost": [], "round_robin": []}
        for rnd in range(args.rounds):
            names = list(arms)
            rng.shuffle(names)
            for name in names:
                resets = reset_caches(engines)
                time.sleep(1.0)
                r = run_arm(arms[name], model, engines, args, orders, f"r{rnd}-{name}")
                results[name].append(r)
                m, h = r["metrics"], r["headers"]
                print(f"round {rnd} {name:11}: recomputed {m['recomputed']:7.0f}  "
                      f"local_hit {m['local_hit']:7.0f}  pulled_from_peer "
                      f"{m['pulled_from_peer']:6.0f}  refused {m['refused_by_verification']:4.0f}"
                      f"  (headers: P recomputed {h['P']['recomputed']}, D recomputed "
                      f"{h['D']['recomputed']}, P local_hit {h['P']['local_hit']}, P pulled "
                      f"{h['P']['pulled_from_peer']})  routes {r['routes']}  "
                      f"wall {r['wall_s']:.0f} s  reset ok {sum(resets.values())}/"
                      f"{len(resets)}", flush=True)
        cost_tok = sum(r["metrics"]["recomputed"] for r in results["cost"])
        rr_tok = sum(r["metrics"]["recomputed"] for r in results["round_robin"])
        cost_hdr = sum(r["headers"]["P"]["recomputed"] + r["headers"]["D"]["recomputed"]
                       for r in results["cost"])
        rr_hdr = sum(r["headers"]["P"]["recomputed"] + r["headers"]["D"]["recomputed"]
                     for r in results["round_robin"])
        same = all(a["outputs"] == b["outputs"]
                   for a in results["cost"] for b in results["round_robin"])
        print(f"prefill-computed prompt tokens (metrics): cost {cost_tok:.0f}, "
              f"round_robin {rr_tok:.0f}, ratio round_robin/cost "
              f"{rr_tok / max(cost_tok, 1):.2f}")
        print(f"prefill-computed prompt tokens (headers): cost {cost_hdr}, round_robin "
              f"{rr_hdr}, ratio {rr_hdr / max(cost_hdr, 1):.2f}")
        print(f"wall time per arm: cost {statistics.fmean(r['wall_s'] for r in results['cost']):.0f} s, "
              f"round_robin {statistics.fmean(r['wall_s'] for r in results['round_robin']):.0f} s; "
              f"generated token ids identical across arms: {same}", flush=True)

        print(f"\n== proxy-added latency, max_tokens=1, {args.latency_pairs} alternating "
              "pairs: cost proxy (decode-only) vs the same D directly ==", flush=True)
        for kind in ("chat", "token-ids"):
            lat = latency(cluster.proxy_url, model, [e.url for e in cluster.decode],
                          args.latency_pairs, kind)
            added = [v - d for v, d in zip(lat["via"], lat["direct"])]
            print(f"{kind:9}: direct p50 {pct(lat['direct'], .5) * 1e3:6.2f} ms p99 "
                  f"{pct(lat['direct'], .99) * 1e3:6.2f} | via proxy p50 "
                  f"{pct(lat['via'], .5) * 1e3:6.2f} ms p99 {pct(lat['via'], .99) * 1e3:6.2f} | "
                  f"added p50 {pct(lat['via'], .5) * 1e3 - pct(lat['direct'], .5) * 1e3:5.2f} ms "
                  f"(per-pair difference p50 {pct(added, .5) * 1e3:.2f} ms, p90 "
                  f"{pct(added, .9) * 1e3:.2f} ms)  routes {lat['routes']}",
                  flush=True)

    finally:
        if rr_proc is not None:
            stop_all([rr_proc])
        cluster.stop()
    # After the cluster is gone, so the engines do not share the CPUs with it.
    if not args.skip_index:
        index_decisions(args)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
