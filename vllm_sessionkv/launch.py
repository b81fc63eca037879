"""Start and stop local vLLM engines (and the proxy) as a process group.

One piece of code serves ``examples/local_cluster.py``, the test fixtures and the
benchmarks.  It applies the CPU recipe (``cpu-pd-recipe.md``): one reserved CPU
(else NIXL re-pins the model thread onto the OpenMP thread's core), no NIXL progress
thread (the connector does that), UCX on loopback, a block size that is a multiple
of 32, and vLLM's loadable (non-AOT) compile cache.  Every process runs in its own
session and is stopped by PID.
"""

from __future__ import annotations

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ClusterSpec",
    "EngineSpec",
    "LocalCluster",
    "ManagedProcess",
    "engine_command",
    "free_port",
    "kv_transfer_config",
    "start_engine",
    "start_process",
    "start_redis",
    "stop_all",
    "wait_healthy",
]

logger = logging.getLogger(__name__)


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

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.kv_events_port}" if self.kv_events_port else None

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        return (f"tcp://127.0.0.1:{self.kv_events_replay_port}"
                if self.kv_events_replay_port else None)

    @property
    def early_decode_endpoint(self) -> str | None:
        port = self.sessionkv.get("early_decode_port") if self.connector == "sessionkv" else 0
        return f"tcp://127.0.0.1:{port}" if port else None


def kv_transfer_config(spec: EngineSpec) -> dict | None:
    if spec.role == "colocated":
        return None
    role = "kv_producer" if spec.role == "prefill" else "kv_consumer"
    if spec.connector == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": role,
                "kv_load_failure_policy": "recompute",
                "kv_connector_module_path": "vllm_sessionkv.stock_nixl",
                "kv_connector_extra_config": {"bidirectional_kv_xfer": True,
                                              "kv_recompute_threshold": 0, **spec.nixl_extra}}
    return {"kv_connector": "SessionKVConnector",
            "kv_connector_module_path": "vllm_sessionkv.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"sessionkv": dict(spec.sessionkv), **spec.nixl_extra}}


def engine_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", spec.model, "--host", "127.0.0.1", "--port", str(spec.port),
            "--max-model-len", str(spec.max_model_len), "--dtype", "bfloat16",
            "--block-size", str(spec.block_size), "--enable-prefix-caching",
            "--prefix-caching-hash-algo", "sha256", "--seed", "0"]
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
                  "endpoint": f"tcp://*:{spec.kv_events_port}", "topic": "kv-events"}
        if spec.kv_events_replay_port:
            events["replay_endpoint"] = f"tcp://*:{spec.kv_events_replay_port}"
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
        "UCX_NET_DEVICES": "lo",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "TOKENIZERS_PARALLELISM": "false",
    })
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
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        continue
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
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
        try:
            # The group, not just the leader: vLLM's EngineCore and workers are children.
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("%s pid=%d did not exit", proc.name, proc.pid)


def start_redis(port: int, log_dir: Path | None = None) -> ManagedProcess:
    """A throw-away redis-server on loopback, no persistence."""
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--protected-mode", "yes"]
    return _spawn("redis", argv, dict(os.environ), log_dir)


def wait_redis(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
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
    kv_cache_space_gb: float = 1.0  # KV cache per engine on CPU
    num_gpu_blocks_override: int | None = None
    connector: str = "sessionkv"
    sessionkv: dict = field(default_factory=dict)
    nixl_extra: dict = field(default_factory=dict)
    engine_extra_args: list[str] = field(default_factory=list)
    gpus: list[str] | None = None
    log_dir: Path | None = None
    proxy_args: list[str] = field(default_factory=list)
    # D engines take P's parameters on an early-decode socket, and the proxy sends
    # them each disaggregated request while P prefills (see early_decode.py).
    early_decode: bool = True


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.procs: list[ManagedProcess] = []
        self.prefill: list[EngineSpec] = []
        self.decode: list[EngineSpec] = []
        self.colocated: EngineSpec | None = None
        self.redis_url: str | None = None
        self.proxy_url: str | None = None
        self._next = spec.base_port

    def _port(self) -> int:
        if not self.spec.base_port:
            return free_port()
        self._next += 1
        return self._next - 1

    def _engine(self, role: str, index: int) -> EngineSpec:
        spec = self.spec
        sessionkv = dict(spec.sessionkv)
        if self.redis_url:
            sessionkv.setdefault("redis_url", self.redis_url)
        port = self._port()
        if spec.connector == "sessionkv":
            sessionkv.setdefault("advertise_url", f"http://127.0.0.1:{port}")
            if role == "decode" and spec.early_decode:
                sessionkv.setdefault("early_decode_port", self._port())
                sessionkv.setdefault("early_decode_bind_host", "127.0.0.1")
        gpus = None
        if spec.gpus:
            gpus = spec.gpus[index % len(spec.gpus)]
        return EngineSpec(role=role, model=spec.model, port=port,
                          side_channel_port=self._port(), kv_events_port=self._port(),
                          kv_events_replay_port=self._port(), block_size=spec.block_size,
                          max_model_len=spec.max_model_len,
                          kv_cache_space_gb=spec.kv_cache_space_gb,
                          num_gpu_blocks_override=spec.num_gpu_blocks_override,
                          connector=spec.connector, sessionkv=sessionkv,
                          nixl_extra=dict(spec.nixl_extra), extra_args=list(spec.engine_extra_args), gpus=gpus)

    def start(self, timeout_s: float = 600.0) -> LocalCluster:
        spec = self.spec
        log_dir = spec.log_dir
        try:
            if spec.redis:
                redis_port = self._port()
                self.procs.append(start_redis(redis_port, log_dir))
                wait_redis(redis_port)
                self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
            self.prefill = [self._engine("prefill", i) for i in range(spec.prefill)]
            self.decode = [self._engine("decode", spec.prefill + i) for i in range(spec.decode)]
            engines: list[tuple[ManagedProcess, str]] = []
            for i, e in enumerate(self.prefill):
                engines.append((start_engine(e, f"prefill{i}", log_dir), e.url))
            for i, e in enumerate(self.decode):
                engines.append((start_engine(e, f"decode{i}", log_dir), e.url))
            if spec.colocated:
                self.colocated = EngineSpec(
                    role="colocated", model=spec.model,
                    port=spec.colocated_port or self._port(), block_size=spec.block_size,
                    max_model_len=spec.max_model_len, kv_cache_space_gb=spec.kv_cache_space_gb,
                    extra_args=list(spec.engine_extra_args),
                    gpus=spec.gpus[-1] if spec.gpus else None)
                engines.append((start_engine(self.colocated, "colocated", log_dir),
                                self.colocated.url))
            self.procs.extend(p for p, _ in engines)
            wait_healthy(engines, timeout_s=timeout_s)
            if spec.proxy:
                port = spec.proxy_port or self._port()
                argv = [sys.executable, "-m", "sessionkv_proxy", "--port", str(port),
                        "--policy", spec.policy, "--block-size", str(spec.block_size)]
                for flag, group in (("--prefill", self.prefill), ("--decode", self.decode)):
                    for e in group:
                        engine = (f"url={e.url},events={e.kv_events_endpoint},"
                                  f"replay={e.kv_events_replay_endpoint}")
                        if e.early_decode_endpoint:
                            engine += f",early={e.early_decode_endpoint}"
                        argv += [flag, engine]
                if self.redis_url:
                    argv += ["--redis-url", self.redis_url]
                if (Path(spec.model) / "tokenizer.json").is_file() and \
                        "--tokenizer" not in spec.proxy_args:
                    # The engines' own tokenizer files: text prompts are tokenized in
                    # the proxy (checked against the engines' /tokenize at start-up).
                    argv += ["--tokenizer", spec.model]
                argv += spec.proxy_args
                proxy = start_process("proxy", argv, log_dir)
                self.procs.append(proxy)
                self.proxy_url = f"http://127.0.0.1:{port}"
                wait_healthy([(proxy, self.proxy_url)], timeout_s=60)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # Proxy first (it holds connections to the engines), engines, Redis last.
        stop_all(list(reversed(self.procs)))
        self.procs = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
