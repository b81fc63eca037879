"""The arms a scenario compares, behind one interface: ``start_cluster(name, arms, opts,
ports, log_dir)`` starts a cluster's engines (or uses engines running elsewhere) and
the router of each of its arms, ``reset`` empties every cache between arms,
``warm_up`` sends each router a few requests, ``Running.stop`` stops it all.

Arms (``ARMS``): co-located engines behind the toy round robin, our proxy or
vllm-router; stock NIXL P/D (unidirectional behind the toy proxy, bidirectional
behind a conversation-keyed proxy); vllm-router P/D on our engines; ours (in full,
with pulls off, with P/D forced, with and without the host tier).  Every arm has two
engines.  Arms that share engines run one after the other with every cache reset in
between.  The Python routers other than ours (the toy proxy, vllm-router) run from the
side venv ``benchmarks/.venv-router``.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import requests

from sessionkv_bench.metrics import delta
from sessionkv_bench.metrics import engine_counters as counters
from sessionkv_bench.runner import BENCH_DIR, PortPool, log

from vllm_sessionkv.dev.launch import (ClusterSpec, EngineSpec, Host, LocalCluster, start_engine,
                                       start_process, stop_all, wait_healthy)

SIDE_VENV = BENCH_DIR / ".venv-router"
SIDE_PY = SIDE_VENV / "bin" / "python"
VLLM_ROUTER = SIDE_VENV / "bin" / "vllm-router"
SIDE_PACKAGES = ["vllm-router", "fastapi", "uvicorn[standard]", "httpx", "matplotlib"]
BLOCK_SIZE = 32
SESSION_HEADER = "X-Session-ID"


# =========================================================================== setup
def ensure_side_venv() -> None:
    """Create benchmarks/.venv-router with vllm-router and the toy proxy's stack.

    uvicorn[standard] rather than bare uvicorn: vLLM itself depends on
    fastapi[standard], so the toy proxy normally runs with uvloop and httptools."""
    if VLLM_ROUTER.exists() and SIDE_PY.exists():
        probe = subprocess.run([str(SIDE_PY), "-c", "import fastapi, uvicorn, httpx, "
                                "matplotlib, uvloop"], capture_output=True)
        if probe.returncode == 0:
            return
    log(f"creating {SIDE_VENV} (vllm-router, fastapi, uvicorn, httpx, matplotlib)")
    if not SIDE_PY.exists():
        subprocess.run([sys.executable, "-m", "venv", str(SIDE_VENV)], check=True)
    subprocess.run([str(SIDE_PY), "-m", "pip", "install", "-q", *SIDE_PACKAGES], check=True)


def call_in_side_venv(module: str, func: str, *args: str) -> str | None:
    """``module.func(*args)`` (a benchmark's plot: matplotlib lives in the side venv)
    run by the side venv's python with benchmarks/ as its PYTHONPATH; the error output when
    it failed, else None."""
    out = subprocess.run([str(SIDE_PY), "-c",
                          "import importlib, sys; getattr(importlib.import_module(sys.argv[1]), "
                          "sys.argv[2])(*sys.argv[3:])", module, func, *args],
                         env={**os.environ, "PYTHONPATH": str(BENCH_DIR)},
                         capture_output=True, text=True, check=False)
    return out.stderr[-1500:] if out.returncode else None


class Backend(msgspec.Struct, forbid_unknown_fields=True):
    """One engine as a router is given it: its URL and, for our proxy, its KV-event
    publisher and replay endpoints and D's early-decode inbox (tcp://HOST:PORT each).
    Also an engine of an ``--external`` file (``ExternalCluster``)."""

    url: str
    events: str | None = None
    replay: str | None = None
    early: str | None = None


def router_argv(kind: str, decode: list[Backend], ports: PortPool,
                prefill: list[Backend] | None = None) -> tuple[list[str], int]:
    """The command line of one router and the port it serves on.  ``kind``: ours, toy
    (toy-pd), conv (arm 4's conversation proxy), vr:<policy>, vr-pd[:<policy>]."""
    port = ports.take()
    urls = [b.url for b in decode]
    if kind == "ours":
        argv = [sys.executable, "-m", "sessionkv_proxy", "--host", "127.0.0.1",
                "--port", str(port), "--block-size", str(BLOCK_SIZE)]
        # Extra flags for our proxy, e.g. ROUTER_BENCH_OURS_ARGS="--log-level DEBUG"
        # to see each routing decision in its log.
        argv += shlex.split(os.environ.get("ROUTER_BENCH_OURS_ARGS", ""))
        for flag, group in (("--prefill", prefill or []), ("--decode", decode)):
            for b in group:
                spec = f"url={b.url},events={b.events},replay={b.replay}" + (
                    f",early={b.early}" if b.early else "") if b.events else b.url
                argv += [flag, spec]
        return argv, port
    if kind in ("toy", "toy-pd"):
        return [str(SIDE_PY), str(BENCH_DIR / "toy_proxy.py"), "--port", str(port),
                *_pd_flags(prefill, urls)], port
    if kind == "conv":
        return [sys.executable, str(BENCH_DIR / "conversation_proxy.py"), "--port", str(port),
                *_pd_flags(prefill, urls)], port
    # vllm-router serves Prometheus on its own port (default 29000): keep it in range.
    common = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port),
              "--prometheus-port", str(ports.take())]
    if kind.startswith("vr:"):
        return common + ["--policy", kind[3:], "--worker-urls", *urls], port
    if kind == "vr-pd" or kind.startswith("vr-pd:"):
        # vr-pd:<policy> picks vllm-router's policy (round_robin by default).
        policy = kind.split(":", 1)[1] if ":" in kind else "round_robin"
        return common + ["--vllm-pd-disaggregation", "--policy", policy,
                         "--kv-connector", "nixl", *_pd_flags(prefill, urls)], port
    raise ValueError(kind)


def _pd_flags(prefill, decode_urls: list[str]) -> list[str]:
    """``--prefill URL ... --decode URL ...``: the P/D flags of the toy proxy, the
    conversation proxy and vllm-router."""
    return [*(x for b in prefill or [] for x in ("--prefill", b.url)),
            *(x for url in decode_urls for x in ("--decode", url))]


@dataclass(frozen=True)
class Arm:
    key: str          # short id used in files and plots
    label: str        # the table's name
    cluster: str      # coloc | stock | bidi | nopull | ours
    router: str       # router_argv kind, "cluster" (the cluster's proxy of ours), "cluster-pd"


ARMS = [
    Arm("1-rr", "1 co-located + round robin", "coloc", "toy"),
    Arm("2-ours-coloc", "2 co-located + our proxy", "coloc", "ours"),
    Arm("3-nixl-rr", "3 stock NIXL P/D + round robin", "stock", "toy-pd"),
    Arm("4-nixl-bidi", "4 stock bidirectional NIXL + conversation proxy", "bidi", "conv"),
    Arm("5-vr-rr", "5 vllm-router P/D round_robin", "ours", "vr-pd:round_robin"),
    Arm("5-vr-cache", "5 vllm-router P/D cache_aware", "ours", "vr-pd:cache_aware"),
    Arm("6-ours-nopull", "6 ours, D->P pulls off", "nopull", "cluster"),
    Arm("7-ours", "7 ours in full", "ours", "cluster"),
    # The chat mode only (forced P/D): a second proxy of ours on the same
    # engines and Redis, every turn P then D (decode_only_max_uncached_tokens -1, which
    # turns the load-aware decode-only rule off too).
    Arm("7-ours-pd", "7 ours, P/D forced on every turn", "ours", "cluster-pd"),
    # Mooncake replay and chat_goodput only: vllm-router over the co-located pair.
    Arm("5-vr-cache-coloc", "5 vllm-router cache_aware (co-located)", "coloc", "vr:cache_aware"),
    Arm("5-vr-rr-coloc", "5 vllm-router round_robin (co-located)", "coloc", "vr:round_robin"),
    # The host-tier workload only: ours with a short session lease and a small D, with
    # and without the host tier.
    Arm("8-ours-nohost", "8 ours, short lease, no host tier", "hostless", "cluster"),
    Arm("8-ours-host", "8 ours, short lease, host tier", "host", "cluster"),
    # chat_pressure only (EngineOptions.pressure); 9-vr-cache on our connector sans tiers.
    Arm("9-ours", "9 ours in full: retention by value, host + disk tiers", "pressure", "cluster"),
    Arm("9-ours-age", "9 ours, fixed lease (by age), host + disk", "pressure-age", "cluster"),
    Arm("9-vr-cache", "9 vllm-router P/D cache_aware", "pressure-vr", "vr-pd:cache_aware"),
    Arm("9-coloc", "9 co-located + our proxy, P's + D's KV", "pcoloc", "ours"),
]
ARM_BY_KEY = {a.key: a for a in ARMS}
PRESSURE_ARMS = ("9-ours", "9-ours-age", "9-vr-cache", "9-coloc")
CLUSTERS = ("coloc", "stock", "bidi", "nopull", "ours", "hostless", "host", "pressure",
            "pressure-age", "pressure-vr", "pcoloc")

@dataclass
class EngineOptions:
    model: str
    max_model_len: int
    p_blocks: int
    d_blocks: int
    coloc_blocks: int
    kv_cache_gb: float = 1.0
    gpus: list[str] | None = None
    ours_sessionkv: dict = field(default_factory=dict)
    # The host-tier arms (clusters "hostless" and "host"): D's KV blocks, the session
    # lease (shorter than the workload's tool delays) and the host tier's bytes.
    host_d_blocks: int = 160   # 5,120 tokens: above a 4,096-token max_model_len
    # Above the handle expiry margins (10 s by default): a restore for P's pull gives a
    # handle P can still use.
    host_lease_s: float = 15.0
    host_tier_bytes: int = 256 << 20
    # Arms 9: {"d_blocks": N, "sessionkv": {...}}, set by agent_workload.pressure_sizing.
    pressure: dict = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=lambda: ["--enable-prompt-tokens-details"])
    # Cluster name -> engines already running elsewhere (``--external``): nothing is
    # launched for that cluster, only its routers.
    external: dict[str, ExternalCluster] = field(default_factory=dict)
    # Environment added per engine, in start order (coloc0, coloc1; P, D), e.g. a
    # VLLM_CPU_OMP_THREADS_BIND each so that two engines do not compute on one core.
    engine_env: list[dict[str, str]] = field(default_factory=list)


CORES_HELP = ("CPU only: VLLM_CPU_OMP_THREADS_BIND per engine in start order "
              "(coloc0,coloc1 / P,D), comma-separated; 'auto': engine i on core i; "
              "'vllm': vLLM's own binding")


def engine_cores_env(cores: str, gpus: str | None) -> list[dict[str, str]]:
    """``EngineOptions.engine_env`` for ``--cores`` (``CORES_HELP``).  With the
    launcher's one reserved CPU, vLLM's auto binding puts every engine's model thread
    on core 0 of a 2-core machine, so two engines of an arm compute on one core."""
    if gpus or cores == "vllm" or (cores == "auto" and (os.cpu_count() or 1) < 2):
        return []
    bind = ["0", "1"] if cores == "auto" else cores.split(",")
    return [{"VLLM_CPU_OMP_THREADS_BIND": c} for c in bind]


# Clusters on the stock NixlConnector.  Its worker moves the model thread onto the
# last core of each NUMA node as it is built (``_vllm.nixl_agent.keep_thread_affinity`` says
# where), whatever binding the engine was started with, so ``--cores`` cannot give
# these engines a core each.  Pinned explicitly anyway (P to core 0, D to core 1), the
# first P->D read never completed in a run here: P released the blocks after their
# lease "retrieved by 0 remote worker(s)" and D waited on them until the RPC timeout.
# They keep vLLM's binding, under which both model threads end on the last core.
STOCK_NIXL_CLUSTERS = ("stock", "bidi")


class ExternalCluster(msgspec.Struct, forbid_unknown_fields=True):
    """Engines started outside the bench.  ``coloc``: two engines; the P/D clusters: one
    prefill and one decode engine (for our proxy's arms, with events and replay)."""

    engines: list[Backend] = []
    prefill: Backend | None = None
    decode: Backend | None = None
    # ours/nopull: the Redis the engines publish session handles to (their
    # ``redis_url``); without it a streamed answer's handle never reaches the proxy.
    redis_url: str | None = None


def load_external(path: str) -> dict[str, ExternalCluster]:
    """The ``--external`` file: ``{"coloc": {"engines": [{"url": ...}, ...]}, "ours":
    {"prefill": {...}, "decode": {...}}, ...}``; refused naming the bad key."""
    raw = Path(path).read_bytes()
    try:
        out = msgspec.json.decode(raw, type=dict[str, ExternalCluster])
    except msgspec.ValidationError as exc:
        raise SystemExit(f"--external {path}: {exc}") from None
    for name, c in out.items():
        if name not in CLUSTERS:
            raise SystemExit(f"--external {path}: unknown cluster {name!r}; known: {CLUSTERS}")
        if name == "coloc" and len(c.engines) != 2:
            raise SystemExit(f"--external {path}: coloc needs two engines")
        if name != "coloc" and (c.prefill is None or c.decode is None):
            raise SystemExit(f"--external {path}: {name} needs prefill and decode")
        if name in ("ours", "nopull"):
            for role, e in (("prefill", c.prefill), ("decode", c.decode)):
                if not (e.events and e.replay):
                    raise SystemExit(f"--external {path}: {name}.{role} needs events and "
                                     "replay (our proxy follows its KV events)")
    return out


@dataclass
class Running:
    """A started cluster: its engines (role, url), routers per arm, processes."""

    name: str
    engines: list[tuple[str, str]]
    routers: dict[str, str] = field(default_factory=dict)   # arm key -> base URL
    admin: str | None = None    # our proxy: /admin/reset resets sessions and engines
    # Further proxies of ours on the same engines: each drops its own sessions on reset.
    more_admins: list[str] = field(default_factory=list)
    procs: list = field(default_factory=list)
    cluster: object = None
    commands: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)      # arm key -> its router's pid

    def stop(self) -> None:
        stop_all(list(reversed(self.procs)))
        if self.cluster is not None:
            self.cluster.stop()


def start_cluster(name: str, arms: list[Arm], opts: EngineOptions, ports: PortPool,
                  log_dir: Path) -> Running:
    """Cluster ``name``'s engines (none where ``opts.external`` names it: they run
    elsewhere) and the router of each of ``arms``; all stopped again when one fails."""
    t0 = time.perf_counter()
    run = Running(name, [])
    try:
        if name in opts.external:
            _start_external(run, arms, opts, ports, log_dir)
        elif name in ("coloc", "pcoloc"):
            _start_coloc(run, arms, opts, ports, log_dir)
        else:
            _start_pd(run, arms, opts, ports, log_dir)
    except BaseException:
        run.stop()
        raise
    log(f"cluster {name}: external engines {run.engines}" if name in opts.external
        else f"cluster {name} healthy after {time.perf_counter() - t0:.0f}s")
    return run


def _start_coloc(run: Running, arms: list[Arm], opts: EngineOptions, ports: PortPool,
                 log_dir: Path) -> None:
    """Two co-located engines, then each arm's router over both."""
    name = run.name
    blocks = opts.coloc_blocks if name == "coloc" else \
        (opts.p_blocks + opts.pressure["d_blocks"]) // 2
    backends = []
    for i in range(2):
        base = ports.take(3)
        spec = EngineSpec(role="colocated", model=opts.model, port=base,
                          kv_events_port=base + 1, kv_events_replay_port=base + 2,
                          block_size=BLOCK_SIZE, max_model_len=opts.max_model_len,
                          kv_cache_space_gb=opts.kv_cache_gb, num_gpu_blocks_override=blocks,
                          extra_args=list(opts.extra_args),
                          extra_env=dict(opts.engine_env[i]) if opts.engine_env else {},
                          gpus=opts.gpus[i % len(opts.gpus)] if opts.gpus else None)
        run.procs.append(start_engine(spec, f"{name}{i}", log_dir))
        run.engines.append(("coloc", spec.url))
        backends.append(Backend(spec.url, spec.kv_events_endpoint, spec.kv_events_replay_endpoint))
    wait_healthy([(p, u) for p, (_, u) in zip(run.procs, run.engines)], timeout_s=900)
    _serve(run, {a.key: router_argv(a.router, backends, ports) for a in arms}, log_dir)


def _start_pd(run: Running, arms: list[Arm], opts: EngineOptions, ports: PortPool,
              log_dir: Path) -> None:
    """1 P + 1 D (a ``LocalCluster``; ours with its proxy and Redis), then the routers."""
    name = run.name
    # Ours with Redis: D publishes each session's handle there, the only way the proxy
    # learns it when the client streams (a streamed answer carries no handle back).
    # Without it P never has D's blocks to pull, and no D->P pull can happen.
    ours = name in ("ours", "nopull", "hostless", "host", "pressure", "pressure-age")
    spec_kw: dict = {"connector": "sessionkv", "proxy": ours, "redis": ours}
    d_blocks = opts.d_blocks
    if name == "stock":
        spec_kw.update(connector="nixl", nixl_extra={"bidirectional_kv_xfer": False})
    elif name == "bidi":
        # Stock bidirectional with its stock recompute threshold (64 tokens).
        spec_kw.update(connector="nixl", nixl_extra={"kv_recompute_threshold": 64})
    elif name == "nopull":
        spec_kw.update(sessionkv={**opts.ours_sessionkv, "session_pulls": False})
    elif name in ("hostless", "host"):
        d_blocks = opts.host_d_blocks
        spec_kw.update(sessionkv={**opts.ours_sessionkv, "session_lease_s": opts.host_lease_s,
                                  "host_tier_bytes": opts.host_tier_bytes if name == "host"
                                  else 0})
    elif name.startswith("pressure"):
        d_blocks = opts.pressure["d_blocks"]
        tiers = {} if name == "pressure-vr" else dict(
            opts.pressure["sessionkv"], retention="age" if name == "pressure-age" else "value",
            disk_tier_dir=f"{opts.pressure['sessionkv']['disk_tier_dir']}/{name}")
        spec_kw.update(sessionkv={**opts.ours_sessionkv, **tiers})
    else:
        spec_kw.update(sessionkv=dict(opts.ours_sessionkv))
    run.cluster = cluster = LocalCluster(ClusterSpec(
        model=opts.model, prefill=1, decode=1, base_port=ports.take(12),
        block_size=BLOCK_SIZE, max_model_len=opts.max_model_len,
        kv_cache_space_gb=opts.kv_cache_gb, num_gpu_blocks_override=d_blocks,
        prefill_num_gpu_blocks_override=opts.p_blocks,
        engine_extra_args=list(opts.extra_args), gpus=opts.gpus, log_dir=log_dir / name,
        fail_fast=True, placement={proc: Host(env=env) for proc, env in zip(
            ("prefill0", "decode0"), [] if name in STOCK_NIXL_CLUSTERS else opts.engine_env)},
        **spec_kw))
    cluster.start(timeout_s=900)
    p, d = Backend(cluster.prefill[0].url), Backend(cluster.decode[0].url)
    run.engines = [("P", p.url), ("D", d.url)]
    if cluster.proxy_url:
        run.admin = cluster.proxy_url
    routers = {}
    for a in arms:
        if a.router == "cluster":
            run.routers[a.key] = cluster.proxy_url
            run.commands[a.key] = " ".join(cluster.procs[-1].popen.args)
            run.pids[a.key] = cluster.procs[-1].pid
        elif a.router == "cluster-pd":
            # Arm 7-ours-pd: the cluster's proxy command (same engines, events, early
            # decode, handle channels and Redis) on another port, every turn P then D.
            port = ports.take()
            argv = list(cluster.procs[-1].popen.args)
            argv[argv.index("--port") + 1] = str(port)
            routers[a.key] = argv + ["--decode-only-max-uncached-tokens", "-1"], port
            run.more_admins.append(f"http://127.0.0.1:{port}")
        else:
            routers[a.key] = router_argv(a.router, [d], ports, [p])
    _serve(run, routers, log_dir)


def _start_external(run: Running, arms: list[Arm], opts: EngineOptions, ports: PortPool,
                    log_dir: Path) -> None:
    """Routers only, over engines that run elsewhere (GPU servers, a real model)."""
    ext = opts.external[run.name]
    if run.name == "coloc":
        run.engines = [("coloc", e.url) for e in ext.engines]
        _serve(run, {a.key: router_argv(a.router, ext.engines, ports) for a in arms}, log_dir)
        return
    assert ext.prefill is not None and ext.decode is not None
    run.engines = [("P", ext.prefill.url), ("D", ext.decode.url)]
    routers = {}
    for a in arms:
        argv, port = routers[a.key] = router_argv("ours" if a.router == "cluster" else a.router,
                                                  [ext.decode], ports, [ext.prefill])
        if a.router == "cluster":   # our proxy, started here: the engines' model and Redis
            argv += ["--policy", "cost", "--tokenizer", opts.model] + (
                ["--redis-url", ext.redis_url] if ext.redis_url else [])
    _serve(run, routers, log_dir)


def _serve(run: Running, routers: dict[str, tuple[list[str], int]], log_dir: Path) -> None:
    """Start each arm's router (its command line and port), wait until every /health
    is 200, and record them in ``run``; a proxy of ours is also the cluster's admin."""
    started = []
    for key, (argv, port) in routers.items():
        proc = start_process(re.sub(r"[^A-Za-z0-9_.-]+", "_", key), argv, log_dir,
                             env=dict(os.environ))
        run.procs.append(proc)
        started.append((key, f"http://127.0.0.1:{port}", proc, argv))
    wait_healthy([(proc, url) for _, url, proc, _ in started], timeout_s=120)
    for key, url, proc, argv in started:
        run.routers[key], run.commands[key], run.pids[key] = url, " ".join(argv), proc.pid
        if ARM_BY_KEY[key].router in ("ours", "cluster"):
            run.admin = url


def reset(run: Running) -> str:
    """Empty every cache of the cluster (our proxy's sessions too); returns a note
    when an engine refused (stock bidirectional D keeps a conversation's last blocks
    until its TTL, and they cannot be freed)."""
    for admin in run.more_admins:   # their own sessions; the engines are reset below
        requests.post(admin + "/admin/reset", params={"timeout_s": "30"}, timeout=60)
    note = ""
    if run.admin:
        resp = requests.post(run.admin + "/admin/reset", params={"timeout_s": "30"}, timeout=60)
        if resp.status_code == 200:
            return ""
        note = f"admin reset answered {resp.status_code}: {resp.text[:200]}"
    for _, url in run.engines:
        # 5 s: blocks a finished run's transfers held are free by then; stock
        # bidirectional D's are not before their TTL, however long this waits.
        for _ in range(25):
            resp = requests.post(url + "/reset_prefix_cache",
                                 params={"reset_external": "true"}, timeout=30)
            if resp.status_code == 200 and resp.json().get("success") is True:
                break
            time.sleep(0.2)
        else:
            note += f" {url} refused the prefix-cache reset (blocks held)"
    return note.strip()


def engine_counters(run: Running) -> list[dict[str, float]]:
    return [counters(url, ("vllm:", "sessionkv_")) for _, url in run.engines]


def warm_up(run: Running, model: str) -> dict[str, str]:
    """First requests of a fresh engine pay compilation and NIXL wiring: a few short
    requests through every router of the cluster.  A router that cannot serve them is
    dropped from ``run.routers``; returns arm key -> why."""
    rng = random.Random(7)
    failed: dict[str, str] = {}
    for key, url in list(run.routers.items()):
        for n in (300, 40):
            body = {"model": model, "prompt": [rng.randrange(16, 1000) for _ in range(n)],
                    "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            try:
                resp = requests.post(url + "/v1/completions", json=body,
                                     headers={SESSION_HEADER: f"warm-{key}-{n}"}, timeout=600)
                ok, why = resp.status_code == 200, f"{resp.status_code} {resp.text[:300]}"
            except requests.RequestException as exc:
                ok, why = False, repr(exc)[:300]
            if not ok:
                failed[key] = f"warm-up request failed: {why}"
                del run.routers[key]
                break
    return failed


def prefill_seconds_per_1k(url: str, model: str, n_tokens: int = 2000, reps: int = 3) -> dict:
    """Prefill time of ``n_tokens`` distinct tokens on one engine (``max_tokens=1``),
    from the engine's own prefill-time histogram and from the client."""
    rng = random.Random(11)
    before = counters(url, ("vllm:request_prefill",))
    t0 = time.perf_counter()
    for _ in range(reps):
        body = {"model": model, "prompt": [rng.randrange(16, 1000) for _ in range(n_tokens)],
                "max_tokens": 1, "temperature": 0}
        requests.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
    client_s = (time.perf_counter() - t0) / reps
    time.sleep(0.5)
    d = delta(counters(url, ("vllm:request_prefill",)), before)
    n = d.get("vllm:request_prefill_time_seconds_count", 0.0)
    engine_s = d.get("vllm:request_prefill_time_seconds_sum", 0.0) / n if n else None
    return {"tokens": n_tokens, "client_s_per_1k": client_s / n_tokens * 1000,
            "engine_s_per_1k": engine_s / n_tokens * 1000 if engine_s else None}
