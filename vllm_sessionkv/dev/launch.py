"""Start and stop local vLLM engines (and the proxy) as a process group.

One piece of code serves ``examples/local_cluster.py``, the test fixtures and the
benchmarks.  It applies the CPU recipe (``cpu-pd-recipe.md``): each engine's model
thread on a core of its own, round robin past the core count (``cores.py``; the
cluster's ``core_plan``), one reserved CPU for vLLM's own binding where that is
kept (else NIXL re-pins the model thread onto the OpenMP thread's core), no NIXL progress
thread (the connector does that), UCX on loopback (for engines on loopback), a block
size that is a multiple of 32, and vLLM's loadable (non-AOT) compile cache.  Every
process runs in its own session and is stopped by PID.

Each process runs on a :class:`Host`: by default this one, on loopback.  A host's
``address`` is where the process listens and where the others reach it (engine HTTP,
NIXL side channel, KV events, early decode, Redis, the proxy); its ``command_prefix``
runs the command there (e.g. ``ip netns exec NS``) and its ``env`` adds to the
process's environment (e.g. ``UCX_TLS``, ``UCX_NET_DEVICES`` for the link between
hosts).  ``ClusterSpec.placement`` maps process names to hosts; the launcher must
reach every host's address (it polls ``/health``).

``LocalCluster.supervise_once()`` is the supervisor: called in a loop, it logs each
child that exited and starts it again with the same command line and ports (an engine
with the same ``EngineSpec``), after a backoff, a bounded number of times in a window,
while the other children keep serving.  Past that bound it gives up on that child and
says so; with ``ClusterSpec.fail_fast`` it raises :class:`ChildExited` instead.
"""

from __future__ import annotations

import enum
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from vllm_sessionkv.dev.cores import CorePlan, plan_cores

__all__ = [
    "ChildEvent",
    "ChildExited",
    "ClusterSpec",
    "EngineSpec",
    "EventKind",
    "Host",
    "LOCAL_HOST",
    "LocalCluster",
    "ManagedProcess",
    "cpu_seconds",
    "engine_command",
    "free_port",
    "kv_transfer_config",
    "parse_placement",
    "process_tree",
    "start_engine",
    "start_process",
    "start_redis",
    "stop_all",
    "wait_healthy",
    "wait_redis",
]

logger = logging.getLogger(__name__)


class Host(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a process runs: the address it listens on and is reached at, the prefix
    that runs its command there, and environment added for it."""

    address: str = "127.0.0.1"
    command_prefix: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self):
        try:
            ip = ipaddress.ip_address(self.address)
        except ValueError:
            raise ValueError(f"address must be an IP address, got {self.address!r}") from None
        if ip.is_unspecified:
            raise ValueError(f"address must be one the other processes can reach, "
                             f"not {self.address!r}")

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback

    def endpoint(self, port: int) -> str:
        """``HOST:PORT``, an IPv6 address in brackets."""
        if ipaddress.ip_address(self.address).version == 6:
            return f"[{self.address}]:{port}"
        return f"{self.address}:{port}"


LOCAL_HOST = Host()


def parse_placement(raw: Any) -> dict[str, Host]:
    """``{process name: {"address", "command_prefix", "env"}}`` from JSON, validated;
    a bad entry raises ValueError naming it (``placement.decode0.address``)."""
    if not isinstance(raw, dict):
        raise ValueError(f"placement must be a JSON object, got {type(raw).__name__}")
    hosts = {}
    for name, entry in raw.items():
        try:
            hosts[name] = msgspec.convert(entry, Host)
        except msgspec.ValidationError as exc:
            raise ValueError(f"placement.{name}: {exc}") from None
    return hosts


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class EngineSpec:
    """One vLLM server.  ``role`` is "prefill", "decode" or "colocated"."""

    role: str
    model: str
    port: int
    side_channel_port: int | None = None
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    block_size: int = 32
    max_model_len: int = 4096
    # vLLM's --dtype; None: ``default_dtype``.  float32 where answers are compared with
    # another engine's (bf16 near-ties flip with how a prefill is split).
    dtype: str | None = None
    kv_cache_space_gb: float = 1.0  # KV cache per engine on CPU
    num_gpu_blocks_override: int | None = None
    # "sessionkv" (ours), "nixl" (stock NixlConnector, bidirectional on: controls).
    connector: str = "sessionkv"
    sessionkv: dict = field(default_factory=dict)
    # Stock NIXL keys for kv_connector_extra_config (e.g. enforce_handshake_compat).
    nixl_extra: dict = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES on GPU hosts
    host: Host = LOCAL_HOST
    # The name it serves the model under (vLLM's --served-model-name), the one requests
    # give as "model"; None: vLLM's default, the --model value.
    served_model_name: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host.endpoint(self.port)}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where a subscriber connects (the engine binds its host's address only,
        ``kv_events_bind``)."""
        return f"tcp://{self.host.endpoint(self.kv_events_port)}" if self.kv_events_port \
            else None

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        return (f"tcp://{self.host.endpoint(self.kv_events_replay_port)}"
                if self.kv_events_replay_port else None)

    @property
    def early_decode_endpoint(self) -> str | None:
        port = self.sessionkv.get("early_decode_port") if self.connector == "sessionkv" else 0
        return f"tcp://{self.host.endpoint(port)}" if port else None

    @property
    def handle_channel_endpoint(self) -> str | None:
        port = self.sessionkv.get("handle_channel_port") if self.connector == "sessionkv" \
            else 0
        return f"tcp://{self.host.endpoint(port)}" if port else None


def kv_transfer_config(spec: EngineSpec) -> dict | None:
    if spec.role == "colocated":
        return None
    role = "kv_producer" if spec.role == "prefill" else "kv_consumer"
    if spec.connector == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": role,
                "kv_load_failure_policy": "recompute",
                "kv_connector_module_path": "vllm_sessionkv.dev.stock_nixl",
                "kv_connector_extra_config": {"bidirectional_kv_xfer": True,
                                              "kv_recompute_threshold": 0, **spec.nixl_extra}}
    return {"kv_connector": "SessionKVConnector",
            "kv_connector_module_path": "vllm_sessionkv.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"sessionkv": dict(spec.sessionkv), **spec.nixl_extra}}


def kv_events_bind(address: str, port: int, replay: bool = False) -> str:
    """The ``--kv-events-config`` endpoint that makes vLLM 0.32 listen on ``address``
    only.  Its publisher binds the PUB endpoint only when it holds ``*`` or ``::``
    (it connects to any other), and binds the replay endpoint as given.  An IPv4
    address written IPv4-mapped, ``tcp://[::ffff:A.B.C.D]:PORT``, holds ``::``, and
    ZMQ binds it as the IPv4 address A.B.C.D; the replay endpoint takes the address
    plainly.  ZMQ binds an IPv6 address only on a socket with its IPV6 option, which
    vLLM sets for neither: on an IPv6 host both stay wildcards (``*``)."""
    if ipaddress.ip_address(address).version == 6:
        return f"tcp://*:{port}"
    return f"tcp://{address}:{port}" if replay else f"tcp://[::ffff:{address}]:{port}"


# /proc/cpuinfo flags of a CPU that computes bfloat16 natively (x86: AVX-512 BF16 or
# AMX, the ones vLLM's CPU backend checks too; aarch64: BF16).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def default_dtype(gpus: bool) -> str:
    """An engine's --dtype when none is asked for: bfloat16 on GPUs and on CPUs that
    compute it natively, float32 on other CPUs, where bfloat16 is converted in software
    and is the slow one (the tiny model answered a 600-token prompt in 0.14 s in
    bfloat16 and 0.07 s in float32 on an AVX2-only AMD EPYC)."""
    if gpus:
        return "bfloat16"
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "bfloat16"
    return "bfloat16" if words & NATIVE_BF16_FLAGS else "float32"


def engine_dtype(spec: EngineSpec) -> str:
    return spec.dtype or default_dtype(spec.gpus is not None)


def engine_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    host = spec.host
    argv = [*host.command_prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", spec.model, "--host", host.address, "--port", str(spec.port),
            "--max-model-len", str(spec.max_model_len), "--dtype", engine_dtype(spec),
            "--block-size", str(spec.block_size), "--enable-prefix-caching",
            "--prefix-caching-hash-algo", "sha256", "--seed", "0"]
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    if spec.num_gpu_blocks_override:
        argv += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks_override)]
    if spec.gpus is None:
        # The flag, not VLLM_CPU_KVCACHE_SPACE: that one takes whole GiB only.
        argv += ["--kv-cache-memory-bytes", str(int(spec.kv_cache_space_gb * 2**30))]
    ktc = kv_transfer_config(spec)
    if ktc is not None:
        argv += ["--kv-transfer-config", json.dumps(ktc)]
    if spec.kv_events_port:
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": kv_events_bind(host.address, spec.kv_events_port),
                  "topic": "kv-events"}
        if spec.kv_events_replay_port:
            events["replay_endpoint"] = kv_events_bind(host.address,
                                                       spec.kv_events_replay_port,
                                                       replay=True)
        argv += ["--kv-events-config", json.dumps(events)]
    argv += spec.extra_args

    env = dict(os.environ)
    # The sha256 block-hash seed must agree across engines and the router; a set
    # PYTHONHASHSEED would override it per process.
    env.pop("PYTHONHASHSEED", None)
    # vLLM's CPU platform lets this legacy variable override --kv-cache-memory-bytes.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",          # /reset_prefix_cache for tests
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        # NIXL's handshake listener binds this address and P and D hand it to each
        # other (remote_host in kv_transfer_params).
        "VLLM_NIXL_SIDE_CHANNEL_HOST": host.address,
        "TOKENIZERS_PARALLELISM": "false",
    })
    if host.is_loopback:
        env["UCX_NET_DEVICES"] = "lo"  # else UCX also listens on the host's other links
    else:
        env["VLLM_HOST_IP"] = host.address  # vLLM's own idea of its node address
    if spec.side_channel_port:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    if spec.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.gpus
    else:
        # vLLM 0.32 on CPU saves its AOT-compiled model but cannot load it back
        # ("'function' object has no attribute 'finalize_loading'"), so every start
        # recompiled with Inductor.  Its older compile cache loads: a tiny model's
        # warm-up drops from about 30 s to 8 s once the cache is warm.
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    env.update(host.env)
    env.update(spec.extra_env)
    return argv, env


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n_lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n_lines:])


def _spawn(name: str, argv: Sequence[str], env: dict[str, str], log_dir: Path | None
           ) -> ManagedProcess:
    log_path = None
    stdout = subprocess.DEVNULL
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        stdout = open(log_path, "wb")  # noqa: SIM115 - the child owns it
    popen = subprocess.Popen(list(argv), env=env, stdout=stdout, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    if log_path is not None:
        stdout.close()
    logger.info("started %s pid=%d", name, popen.pid)
    return ManagedProcess(name=name, popen=popen, log_path=log_path)


def start_engine(spec: EngineSpec, name: str, log_dir: Path | None = None) -> ManagedProcess:
    argv, env = engine_command(spec)
    return _spawn(name, argv, env, log_dir)


def start_process(name: str, argv: Sequence[str], log_dir: Path | None = None,
                  env: dict[str, str] | None = None) -> ManagedProcess:
    return _spawn(name, argv, dict(env or os.environ), log_dir)


def process_tree(pids: Sequence[int]) -> list:
    """Each live process of ``pids`` with its descendants, once (``psutil.Process``)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return list({p.pid: p for p in procs}.values())


def cpu_seconds(procs: Sequence) -> float:
    """User plus system CPU seconds the processes have used (those still alive)."""
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _answers_health(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _kill_group(pid: int) -> None:
    """SIGKILL what is left of a child's process group (vLLM's EngineCore outlives a
    killed API server otherwise, holding the ports its restart needs)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_healthy(procs: Sequence[tuple[ManagedProcess, str]], timeout_s: float = 300.0,
                 poll_s: float = 0.5) -> None:
    """Wait until every ``GET url/health`` answers 200; raise with the log tail if a
    process dies or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        still = []
        for proc, url in pending:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n"
                                   f"{proc.log_tail()}")
            if not _answers_health(url, timeout_s=2.0):
                still.append((proc, url))
        pending = still
        if pending:
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p, _ in pending)
                raise TimeoutError(f"not healthy after {timeout_s:.0f}s: {names}\n"
                                   + "\n".join(p.log_tail(15) for p, _ in pending))
            time.sleep(poll_s)


def stop_all(procs: Sequence[ManagedProcess], grace_s: float = 15.0) -> None:
    """SIGTERM each process group, then SIGKILL what is left after ``grace_s``."""
    for proc in procs:
        if proc.alive():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        # The group, not just the leader: vLLM's EngineCore and workers are children.
        _kill_group(proc.pid)
        try:
            proc.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("%s pid=%d did not exit", proc.name, proc.pid)


def start_redis(port: int, log_dir: Path | None = None, host: Host = LOCAL_HOST
                ) -> ManagedProcess:
    """A throw-away redis-server on ``host`` (loopback by default), no persistence.

    Off loopback it takes clients from other hosts, with no password: it is for a
    private network of the launcher's own (protected mode would refuse them)."""
    argv = [*host.command_prefix, "redis-server", "--port", str(port),
            "--bind", host.address, "--save", "", "--appendonly", "no",
            "--protected-mode", "yes" if host.is_loopback else "no"]
    return _spawn("redis", argv, {**os.environ, **host.env}, log_dir)


def wait_redis(port: int, timeout_s: float = 20.0, address: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"redis on port {port} did not answer PING")


@dataclass
class ClusterSpec:
    """A local deployment: N prefill and M decode engines, optional baseline, Redis and
    proxy.  Ports are laid out from ``base_port`` unless 0, then picked free."""

    model: str
    # The model's name on every engine, the co-located one too (a client sends one name
    # to the proxy and to the baseline); None: vLLM's default, ``model``.
    served_model_name: str | None = None
    prefill: int = 1
    decode: int = 1
    colocated: bool = False
    redis: bool = False
    proxy: bool = True
    policy: str = "cost"
    base_port: int = 0
    proxy_port: int | None = None
    colocated_port: int | None = None
    block_size: int = 32
    max_model_len: int = 4096
    dtype: str | None = None  # every engine's, the co-located one too (EngineSpec.dtype)
    kv_cache_space_gb: float = 1.0  # KV cache per engine on CPU
    # D engines only, when set: their KV cache on CPU (e.g. a small D that must end
    # session holds under KV pressure); P and the co-located engine keep the above.
    decode_kv_cache_space_gb: float | None = None
    num_gpu_blocks_override: int | None = None
    # P engines only, when set (e.g. a P pool with less KV than D's).
    prefill_num_gpu_blocks_override: int | None = None
    connector: str = "sessionkv"
    sessionkv: dict = field(default_factory=dict)
    nixl_extra: dict = field(default_factory=dict)
    engine_extra_args: list[str] = field(default_factory=list)
    gpus: list[str] | None = None
    log_dir: Path | None = None
    proxy_args: list[str] = field(default_factory=list)
    # Security (docs/operations.md#security).  engine_api_key: P and D start with
    # vLLM's --api-key and the proxy sends it (SESSIONKV_ENGINE_API_KEY); api_key: the
    # proxy asks clients for it (SESSIONKV_PROXY_API_KEY); side_port_secret: engines and
    # proxy sign and check the side ports' messages (SESSIONKV_SIDE_PORT_SECRET).  The
    # proxy and engines get them in their environments, not on their command lines
    # (vLLM's --api-key aside).
    engine_api_key: str | None = None
    api_key: str | None = None
    side_port_secret: str | None = None
    # D engines take P's parameters on an early-decode socket, and the proxy sends
    # them each disaggregated request while P prefills (see early_decode.py).
    early_decode: bool = True
    # D engines send their session handles on a handle channel the proxy subscribes
    # to, so streamed turns keep D->P reuse without Redis (handle_channel.py).
    handle_channel: bool = True
    # Supervision (LocalCluster.supervise_once).  fail_fast: any child's exit is an
    # error (ChildExited), nothing is restarted.  Otherwise a child that exits is
    # started again after restart_backoff_s, doubling with each restart in the last
    # restart_window_s up to max_restart_backoff_s; once max_restarts restarts fall
    # in that window, the next exit gives that child up (0: never restart).
    fail_fast: bool = False
    max_restarts: int = 5
    restart_window_s: float = 600.0
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0
    # Where each process runs, by name ("prefill0", "decode0", "colocated", "redis",
    # "proxy"); a process not named runs here, on loopback (LOCAL_HOST).
    placement: dict[str, Host] = field(default_factory=dict)
    # CPU cores of the engines' model threads (``cores.plan_cores``): "auto" (one
    # core each, round robin past the core count), "vllm" (vLLM's own binding), or a
    # VLLM_CPU_OMP_THREADS_BIND value per engine in start order ("0,1,0").
    cores: str = "auto"

    def engine_names(self) -> list[str]:
        """The engines, in start order."""
        names = [f"prefill{i}" for i in range(self.prefill)]
        names += [f"decode{i}" for i in range(self.decode)]
        return names + (["colocated"] if self.colocated else [])

    def process_names(self) -> list[str]:
        optional = (("redis", self.redis), ("proxy", self.proxy))
        return self.engine_names() + [name for name, started in optional if started]

    def core_plan(self, cores: list[int] | None = None) -> CorePlan:
        """Where each engine's model thread computes; ``cores``: those this process
        may run on (default: its affinity)."""
        if cores is None:
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else list(range(os.cpu_count() or 1))
        return plan_cores(self.engine_names(), cores, self.cores,
                          gpus=self.gpus is not None, stock_nixl=self.connector == "nixl")

    def __post_init__(self):
        unknown = sorted(set(self.placement) - set(self.process_names()))
        if unknown:
            raise ValueError(f"placement: no process named {', '.join(unknown)} in this "
                             f"cluster; expected some of {self.process_names()}")
        self.core_plan()  # a bad ``cores`` raises ValueError naming it

    def host(self, name: str) -> Host:
        return self.placement.get(name, LOCAL_HOST)


class EventKind(enum.Enum):
    EXITED = "exited"        # found dead; its process group was killed
    RESTARTED = "restarted"  # started again, same command line and ports
    HEALTHY = "healthy"      # a restarted child answered GET /health
    GAVE_UP = "gave_up"      # too many restarts in the window: left stopped


@dataclass(frozen=True)
class ChildEvent:
    """One thing the supervisor did, logged as ``supervisor event=... process=...``."""

    kind: EventKind
    process: str
    pid: int
    exit_code: int | None = None
    attempt: int = 0  # restarts of this child so far (1 = the first restart)
    detail: str = ""

    def __str__(self) -> str:
        text = (f"supervisor event={self.kind.value} process={self.process} pid={self.pid} "
                f"exit_code={self.exit_code} attempt={self.attempt}")
        return f"{text} {self.detail}" if self.detail else text


class ChildExited(RuntimeError):
    """A child exited under ``fail_fast``; ``exited`` holds (name, exit code) pairs."""

    def __init__(self, exited: list[tuple[str, int | None]]):
        self.exited = exited
        super().__init__("process exited: " + ", ".join(f"{n} (exit code {c})"
                                                        for n, c in exited))


@dataclass
class _Child:
    """A supervised process and how to start it again."""

    name: str
    start: Callable[[], ManagedProcess]
    proc: ManagedProcess
    health_url: str | None = None
    restarts: int = 0
    restart_times_s: list[float] = field(default_factory=list)
    exit_code: int | None = None
    restart_at_s: float | None = None  # due restart; None when running or given up
    restarted_at_s: float | None = None  # awaiting /health since then
    gave_up: bool = False


class LocalCluster:
    """Starts a :class:`ClusterSpec`'s processes, supervises them, stops them.

    Every child is registered with how to start it again (:meth:`manage`), so
    :meth:`supervise_once` can restart it with the same command line and ports.
    """

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.prefill: list[EngineSpec] = []
        self.decode: list[EngineSpec] = []
        self.colocated: EngineSpec | None = None
        self.redis_url: str | None = None
        self.proxy_url: str | None = None
        self.core_plan: CorePlan = spec.core_plan()
        self._next = spec.base_port
        self._children: list[_Child] = []

    def _port(self) -> int:
        if not self.spec.base_port:
            return free_port()
        self._next += 1
        return self._next - 1

    def _engine(self, role: str, index: int, name: str) -> EngineSpec:
        spec = self.spec
        host = spec.host(name)
        sessionkv = dict(spec.sessionkv)
        if self.redis_url:
            sessionkv.setdefault("redis_url", self.redis_url)
        if sessionkv.get("disk_tier_dir"):
            # One disk-tier directory per engine (each locks its own), under the given one.
            sessionkv["disk_tier_dir"] = os.path.join(sessionkv["disk_tier_dir"], name)
        port = self._port()
        if spec.connector == "sessionkv":
            sessionkv.setdefault("advertise_url", f"http://{host.endpoint(port)}")
            if role == "decode" and spec.early_decode:
                sessionkv.setdefault("early_decode_port", self._port())
                sessionkv.setdefault("early_decode_bind_host", host.address)
            if role == "decode" and spec.handle_channel:
                sessionkv.setdefault("handle_channel_port", self._port())
                sessionkv.setdefault("handle_channel_bind_host", host.address)
        gpus = None
        if spec.gpus:
            gpus = spec.gpus[index % len(spec.gpus)]
        extra_args = list(spec.engine_extra_args)
        if spec.engine_api_key:
            extra_args += ["--api-key", spec.engine_api_key]
        extra_env = ({"SESSIONKV_SIDE_PORT_SECRET": spec.side_port_secret}
                     if spec.side_port_secret else {})
        return EngineSpec(role=role, model=spec.model, port=port,
                          served_model_name=spec.served_model_name,
                          side_channel_port=self._port(), kv_events_port=self._port(),
                          kv_events_replay_port=self._port(), block_size=spec.block_size,
                          max_model_len=spec.max_model_len, dtype=spec.dtype,
                          kv_cache_space_gb=(
                              spec.decode_kv_cache_space_gb
                              if role == "decode" and spec.decode_kv_cache_space_gb
                              else spec.kv_cache_space_gb),
                          num_gpu_blocks_override=(
                              spec.prefill_num_gpu_blocks_override
                              if role == "prefill" and spec.prefill_num_gpu_blocks_override
                              else spec.num_gpu_blocks_override),
                          connector=spec.connector, sessionkv=sessionkv,
                          nixl_extra=dict(spec.nixl_extra), extra_args=extra_args,
                          extra_env=extra_env, gpus=gpus, host=host)

    def manage(self, name: str, start: Callable[[], ManagedProcess],
               health_url: str | None = None) -> ManagedProcess:
        """Start a child with ``start()`` and supervise it; ``start`` is called again
        for each restart.  ``health_url`` (its ``GET /health``) is polled after one."""
        proc = start()
        self._children.append(_Child(name=name, start=start, proc=proc,
                                     health_url=health_url))
        return proc

    @property
    def procs(self) -> list[ManagedProcess]:
        """The current process of every child, in start order (the proxy last)."""
        return [c.proc for c in self._children]

    def start(self, timeout_s: float = 600.0) -> LocalCluster:
        if self._children:
            # A second start would launch a second set of engines beside the first
            # (``with cluster.start():`` did, its __enter__ starting again).
            raise RuntimeError("LocalCluster.start: already started")
        spec = self.spec
        log_dir = spec.log_dir
        try:
            if spec.redis:
                redis_port = self._port()
                redis_host = spec.host("redis")
                self.manage("redis", lambda: start_redis(redis_port, log_dir, redis_host))
                wait_redis(redis_port, address=redis_host.address)
                self.redis_url = f"redis://{redis_host.endpoint(redis_port)}/0"
            self.prefill = [self._engine("prefill", i, f"prefill{i}")
                            for i in range(spec.prefill)]
            self.decode = [self._engine("decode", spec.prefill + i, f"decode{i}")
                           for i in range(spec.decode)]
            named = [(f"prefill{i}", e) for i, e in enumerate(self.prefill)]
            named += [(f"decode{i}", e) for i, e in enumerate(self.decode)]
            if spec.colocated:
                self.colocated = self._colocated_engine()
                named.append(("colocated", self.colocated))
            logger.info("%s", self.core_plan.rule)
            for name, e in named:
                e.extra_env.update(self.core_plan.env(name))
            engines = [(self.manage(name, self._engine_starter(e, name), e.url), e.url)
                       for name, e in named]
            wait_healthy(engines, timeout_s=timeout_s)
            if spec.proxy:
                port = spec.proxy_port or self._port()
                proxy_host = spec.host("proxy")
                argv = self._proxy_argv(port, proxy_host)
                env = {**os.environ, **proxy_host.env, **self._proxy_secrets()}
                self.proxy_url = f"http://{proxy_host.endpoint(port)}"
                proxy = self.manage("proxy",
                                    lambda: start_process("proxy", argv, log_dir, env),
                                    self.proxy_url)
                wait_healthy([(proxy, self.proxy_url)], timeout_s=60)
        except BaseException:
            self.stop()
            raise
        return self

    def _colocated_engine(self) -> EngineSpec:
        """The plain co-located server: no connector, the cluster's default KV."""
        spec = self.spec
        return EngineSpec(
            role="colocated", model=spec.model, port=spec.colocated_port or self._port(),
            served_model_name=spec.served_model_name,
            block_size=spec.block_size, max_model_len=spec.max_model_len, dtype=spec.dtype,
            kv_cache_space_gb=spec.kv_cache_space_gb, extra_args=list(spec.engine_extra_args),
            gpus=spec.gpus[-1] if spec.gpus else None, host=spec.host("colocated"))

    def _engine_starter(self, engine: EngineSpec, name: str) -> Callable[[], ManagedProcess]:
        return lambda: start_engine(engine, name, self.spec.log_dir)

    def _proxy_secrets(self) -> dict[str, str]:
        spec = self.spec
        secrets = {"SESSIONKV_ENGINE_API_KEY": spec.engine_api_key,
                   "SESSIONKV_PROXY_API_KEY": spec.api_key,
                   "SESSIONKV_SIDE_PORT_SECRET": spec.side_port_secret}
        return {name: value for name, value in secrets.items() if value}

    def _proxy_argv(self, port: int, host: Host) -> list[str]:
        spec = self.spec
        argv = [*host.command_prefix, sys.executable, "-m", "sessionkv_proxy",
                "--host", host.address, "--port", str(port),
                "--policy", spec.policy, "--block-size", str(spec.block_size)]
        for flag, group in (("--prefill", self.prefill), ("--decode", self.decode)):
            for e in group:
                engine = (f"url={e.url},events={e.kv_events_endpoint},"
                          f"replay={e.kv_events_replay_endpoint}")
                if e.early_decode_endpoint:
                    engine += f",early={e.early_decode_endpoint}"
                if e.handle_channel_endpoint:
                    engine += f",handles={e.handle_channel_endpoint}"
                argv += [flag, engine]
        if self.redis_url:
            argv += ["--redis-url", self.redis_url]
        if (Path(spec.model) / "tokenizer.json").is_file() and \
                "--tokenizer" not in spec.proxy_args:
            # The engines' own tokenizer files: text prompts are tokenized in
            # the proxy (checked against the engines' /tokenize at start-up).
            argv += ["--tokenizer", spec.model]
        return argv + spec.proxy_args

    def supervise_once(self, now_s: float | None = None) -> list[ChildEvent]:
        """One pass of the supervisor; call it every second or so.  Returns (and logs)
        what it did.

        A child found dead has its process group killed and its exit logged.  Under
        ``fail_fast`` that raises :class:`ChildExited` (once; the child stays stopped).  Otherwise the child is started
        again by the ``start`` it was registered with, once its backoff has passed; a
        restarted child with a health URL is reported healthy when ``/health`` first
        answers.  When ``max_restarts`` restarts already fall within
        ``restart_window_s``, the child is given up (left stopped) and the rest keep
        running.  A restarted engine's log goes to ``<name>.log`` again; the log of
        the run that ended is kept as ``<name>.log.<n>`` (n = 1 for the first run).
        ``now_s`` (``time.monotonic()`` by default) lets tests step the clock.
        """
        spec = self.spec
        now_s = time.monotonic() if now_s is None else now_s
        events: list[ChildEvent] = []
        exited: list[tuple[str, int | None]] = []
        for child in self._children:
            if child.gave_up or child.restart_at_s is not None:
                if child.restart_at_s is not None and now_s >= child.restart_at_s:
                    self._restart(child, now_s, events)
                continue
            if child.proc.alive():
                if child.restarted_at_s is not None and child.health_url and \
                        _answers_health(child.health_url):
                    events.append(ChildEvent(
                        EventKind.HEALTHY, child.name, child.proc.pid, attempt=child.restarts,
                        detail=f"after_s={now_s - child.restarted_at_s:.1f}"))
                    child.restarted_at_s = None
                continue
            # Dead: take its orphans down with it and decide what comes next.
            child.exit_code = child.proc.popen.returncode
            child.restarted_at_s = None
            _kill_group(child.proc.pid)
            exited.append((child.name, child.exit_code))
            events.append(ChildEvent(EventKind.EXITED, child.name, child.proc.pid,
                                     child.exit_code, child.restarts))
            if spec.fail_fast:
                child.gave_up = True  # raised once below; left stopped
            else:
                self._schedule(child, now_s, events)
        for event in events:
            level = {EventKind.GAVE_UP: logging.ERROR,
                     EventKind.EXITED: logging.WARNING}.get(event.kind, logging.INFO)
            logger.log(level, "%s", event)
        if spec.fail_fast and exited:
            raise ChildExited(exited)
        return events

    def _schedule(self, child: _Child, now_s: float, events: list[ChildEvent]) -> None:
        """Set a stopped child's restart time, or give it up."""
        spec = self.spec
        child.restart_times_s = [t for t in child.restart_times_s
                                 if now_s - t < spec.restart_window_s]
        recent = len(child.restart_times_s)
        if recent >= spec.max_restarts:
            child.gave_up = True
            events.append(ChildEvent(
                EventKind.GAVE_UP, child.name, child.proc.pid, child.exit_code,
                child.restarts, f"restarts_in_window={recent} "
                                f"window_s={spec.restart_window_s:g}"))
            return
        backoff_s = min(spec.restart_backoff_s * 2 ** recent, spec.max_restart_backoff_s)
        child.restart_at_s = now_s + backoff_s

    def _restart(self, child: _Child, now_s: float, events: list[ChildEvent]) -> None:
        old = child.proc
        child.restart_at_s = None
        child.restarts += 1
        child.restart_times_s.append(now_s)
        if old.log_path is not None and old.log_path.exists():
            old.log_path.rename(old.log_path.with_name(f"{old.log_path.name}.{child.restarts}"))
        try:
            child.proc = child.start()
        except OSError as exc:  # e.g. the executable went away: counts as an attempt
            events.append(ChildEvent(EventKind.EXITED, child.name, old.pid, child.exit_code,
                                     child.restarts, f"start_failed={exc!r}"))
            self._schedule(child, now_s, events)
            return
        child.restarted_at_s = now_s
        events.append(ChildEvent(EventKind.RESTARTED, child.name, child.proc.pid,
                                 child.exit_code, child.restarts, f"old_pid={old.pid}"))

    def given_up(self) -> list[str]:
        """Names of the children the supervisor gave up on."""
        return [c.name for c in self._children if c.gave_up]

    def stop(self) -> None:
        # Proxy first (it holds connections to the engines), engines, Redis last.
        stop_all(list(reversed(self.procs)))
        self._children = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __enter__(self) -> LocalCluster:
        """Starts the cluster unless started already (``with cluster.start(...):``)."""
        return self if self._children else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
