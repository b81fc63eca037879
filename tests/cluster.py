"""Start and stop real clusters for the end-to-end tests (shared by conftest and tests).

A plain module, not ``conftest``: several conftest.py files exist under tests/, and
importing one by name would pick whichever pytest loaded last.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import requests

if TYPE_CHECKING:
    from vllm_sessionkv.dev.launch import LocalCluster

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 240.0
# Every test engine's --dtype.  Tests compare logprobs with a co-located engine's to
# 2e-3; in bfloat16 a P/D turn and the co-located recompute of the same tokens round
# differently on some CPUs (AMD EPYC and Intel Xeon here: equal tokens, logprobs up to
# 0.18 apart), so bfloat16 would test the CPU's rounding, not the KV.  float32 agrees.
TEST_DTYPE = "float32"
# KV cache per test engine: 262,144 tokens of the tiny model in float32, far above any
# test's need.  vLLM's 1 GiB default put up to nine engines' worth on this 24 GiB
# machine while the session cluster and the 2P+2D one ran together.
TEST_KV_CACHE_GB = 0.5
# Every test engine's extra arguments: eager (vLLM's --enforce-eager), no torch.compile
# warm-up at start, which took about 4 s of a lone engine's start here with the compile
# cache warm (8 s with two engines starting together, 0.3 s eager), over some 55 engine
# starts a cluster lane.  What the tests
# check (the connector's hooks, NIXL reads, verification, answers equal to a co-located
# engine that runs eager too) does not depend on it.  test_docs_cpu_recipe runs the
# documented commands as written, compiled.
TEST_ENGINE_ARGS: tuple[str, ...] = ("--enforce-eager",)
# The tiny Llama's KV bytes per token in TEST_DTYPE: 2 layers x K,V x 2 heads x 64 dims
# x 4 bytes (what a block holds in the host and disk tiers: block size x this).
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4
# Pull-or-recompute prices for the tiny model in these tests: a 32-token tail costs
# about 1 ms to recompute at 200 tokens of context and about 4 ms at 2,000, against
# a fixed 2 ms per pull; each request in P's last step adds 25% to recompute time.
SESSION_COST = {"recompute_s_per_token": 2.0e-5,
                "recompute_s_per_token_per_context_token": 4.4e-8,
                "load_slowdown_per_unit": 0.25, "per_transfer_s": 2.0e-3,
                "link_bytes_per_s": 1.0e9}


def free_port_block(size: int) -> int:
    """First port of ``size`` consecutive free ports, below the ephemeral range.

    vLLM and gloo open listeners on ephemeral ports (32768+ on Linux); drawing the
    cluster's fixed ports from 10000-26999 keeps the two from colliding.  (The proxy
    unit tests use 27000-27999.)
    """
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(10000, 27000 - size)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


@dataclass
class Cluster:
    """What ``local_cluster.py`` reported, plus the processes started beside it."""

    proxy: str
    redis: str | None
    prefill: list[str]
    decode: list[str]
    kv_events: dict[str, str]
    early_decode: dict[str, str]       # D url -> its early-decode socket
    handle_channel: dict[str, str]     # D url -> its handle channel
    model: str
    launcher: subprocess.Popen
    ready_s: float
    log_dir: Path
    descendants: list[int] = field(default_factory=list)
    colocated: str | None = None
    extras: dict[str, str] = field(default_factory=dict)
    teardown_report: dict = field(default_factory=dict)
    # Every line local_cluster.py printed or logged (its supervisor's events too).
    output: list[str] = field(default_factory=list)


def launch_cluster(model: str, log_dir: Path, args: list[str],
                   ready_timeout_s: float = READY_TIMEOUT_S) -> Cluster:
    """Run examples/local_cluster.py and wait for its READY line."""
    base = free_port_block(40)
    argv = [sys.executable, str(REPO / "examples" / "local_cluster.py"), "--model", model,
            "--base-port", str(base), "--proxy-port", str(base + 39),
            "--log-dir", str(log_dir), "--kv-cache-gb", str(TEST_KV_CACHE_GB),
            "--dtype", TEST_DTYPE, *TEST_ENGINE_ARGS, *args]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    layout, lines = None, []
    deadline = started + ready_timeout_s

    def _timeout():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    timer = threading.Timer(ready_timeout_s, _timeout)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("CLUSTER "):
                layout = json.loads(line[len("CLUSTER "):])
            if line.startswith("READY "):
                break
    finally:
        timer.cancel()
    ready_s = time.monotonic() - started
    if layout is None or time.monotonic() > deadline or proc.poll() is not None:
        proc.kill()
        raise RuntimeError("local_cluster.py did not become READY:\n" + "".join(lines[-40:]))
    descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    cluster = Cluster(proxy=layout["proxy"], redis=layout["redis"], prefill=layout["prefill"],
                      decode=layout["decode"], kv_events=layout["kv_events"],
                      early_decode=layout.get("early_decode", {}),
                      handle_channel=layout.get("handle_channel", {}), model=model,
                      launcher=proc, ready_s=ready_s, log_dir=log_dir,
                      descendants=descendants, output=lines,
                      colocated=layout.get("colocated") if layout.get("colocated") != "-"
                      else None)
    def drain() -> None:  # so it never blocks on a full pipe; line by line, for wait_output
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return cluster


@contextmanager
def cluster_with_baselines(model: str, perturbed_model: str, log_dir: Path,
                           launcher_args: list[str], ready_timeout_s: float = READY_TIMEOUT_S,
                           **engine_options) -> Iterator[Cluster]:
    """A P/D cluster from ``local_cluster.py`` with ``launcher_args``, and beside it a
    co-located server on ``model`` (the baseline, ``cluster.colocated``) and a P on
    ``perturbed_model`` served under the same name (the negative control,
    ``cluster.extras["perturbed_prefill"]``).  ``engine_options`` are EngineSpec fields
    for both extra engines (dtype, max_model_len, ...).  On exit everything is stopped
    and nothing the launcher started may be left."""
    from vllm_sessionkv.dev.launch import EngineSpec, start_engine, stop_all, wait_healthy

    cluster = launch_cluster(model, log_dir, launcher_args, ready_timeout_s=ready_timeout_s)
    extra = []
    try:
        base = free_port_block(3)
        options = {"kv_cache_space_gb": TEST_KV_CACHE_GB, "served_model_name": model,
                   "dtype": TEST_DTYPE, "extra_args": list(TEST_ENGINE_ARGS),
                   **engine_options}
        colocated = EngineSpec(role="colocated", model=model, port=base, **options)
        # D skips NIXL's model-compatibility check so that this P can hand it KV.
        perturbed = EngineSpec(role="prefill", model=perturbed_model, port=base + 1,
                               side_channel_port=base + 2,
                               nixl_extra={"enforce_handshake_compat": False}, **options)
        extra = [start_engine(colocated, "colocated", log_dir),
                 start_engine(perturbed, "perturbed-prefill", log_dir)]
        wait_healthy([(extra[0], colocated.url), (extra[1], perturbed.url)],
                     timeout_s=max(ready_timeout_s, 400))
        cluster.colocated = colocated.url
        cluster.extras["perturbed_prefill"] = perturbed.url
        yield cluster
    finally:
        stop_all(extra)
        cluster.teardown_report.update(stop_cluster(cluster))
        alive = cluster.teardown_report.get("alive")
        assert not alive, f"processes left after SIGTERM to local_cluster.py: {alive}"


@contextmanager
def small_kv_cluster(model: str, log_dir: Path, block_size: int, device_blocks: int,
                     sessionkv: dict, colocated_url: str) -> Iterator[LocalCluster]:
    """1P + 1D with Redis, from ``dev/launch.py``: P's and D's device KV
    ``device_blocks`` blocks of ``block_size`` tokens, for what D's session holds do
    when its KV runs short; ``colocated_url`` (the session's server) is its baseline.
    ``sessionkv`` is the connector's config; stopped on exit."""
    from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster

    cluster = LocalCluster(ClusterSpec(
        model=model, prefill=1, decode=1, colocated=False, redis=True,
        base_port=free_port_block(40), block_size=block_size, max_model_len=2000,
        kv_cache_space_gb=TEST_KV_CACHE_GB, num_gpu_blocks_override=device_blocks,
        dtype=TEST_DTYPE, engine_extra_args=list(TEST_ENGINE_ARGS), log_dir=log_dir,
        sessionkv=sessionkv))
    with cluster.start(timeout_s=600):
        yield with_baseline(cluster, colocated_url)


@dataclass(frozen=True)
class Baseline:
    url: str


def with_baseline(cluster: LocalCluster, colocated_url: str) -> LocalCluster:
    """``cluster`` with the session's co-located server (``colocated_url`` fixture) as
    its ``colocated``: a module cluster started without its own baseline engine (one
    engine less to start) reads ``cluster.colocated.url`` as before."""
    cluster.colocated = Baseline(colocated_url)
    return cluster


def launcher_child(cluster: Cluster, port: int | None = None, argv_has: str | None = None
                   ) -> psutil.Process:
    """The launcher's child serving ``--port port`` (an engine's API server), or the one
    whose command line holds ``argv_has`` (``"sessionkv_proxy"``)."""
    found = []
    for child in psutil.Process(cluster.launcher.pid).children():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if port is not None and "--port" in argv and argv[argv.index("--port") + 1] == str(port):
            found.append(child)
        elif argv_has is not None and argv_has in argv:
            found.append(child)
    assert len(found) == 1, f"{len(found)} launcher children match port={port} {argv_has}"
    return found[0]


def wait_output(cluster: Cluster, pattern: str, timeout_s: float, start: int = 0) -> str:
    """The first line of the launcher's output from index ``start`` matching ``pattern``."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    while True:
        for line in cluster.output[start:]:
            if regex.search(line):
                return line
        if time.monotonic() > deadline or cluster.launcher.poll() is not None:
            raise AssertionError(f"local_cluster.py printed no line matching {pattern!r} "
                                 f"(exit code {cluster.launcher.poll()}):\n"
                                 + "".join(cluster.output[-30:]))
        time.sleep(0.5)


def refresh_descendants(cluster: Cluster) -> list[int]:
    """Add the launcher's current processes to ``cluster.descendants`` (its supervisor
    restarts children under new pids) and return the list."""
    try:
        now = {p.pid for p in psutil.Process(cluster.launcher.pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        now = set()
    cluster.descendants = sorted(set(cluster.descendants) | now)
    return cluster.descendants


def _running(pid: int) -> bool:
    """Alive and not a zombie; a process that exits while we look is not running."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_cluster(cluster: Cluster, timeout_s: float = 60.0) -> dict:
    """SIGTERM the launcher; report which of its processes are still alive."""
    refresh_descendants(cluster)
    cluster.launcher.send_signal(signal.SIGTERM)
    try:
        code = cluster.launcher.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    # The launcher's children get the same 1 s as before to be gone, no longer.
    deadline = time.monotonic() + 1.0
    while any(_running(pid) for pid in cluster.descendants) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in cluster.descendants if _running(pid)]
    report = {"exit_code": code, "alive": alive}
    for pid in alive:  # do not leak into other tests, but report it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if code is None:
        cluster.launcher.kill()
    return report


def kill_engine(cluster: Cluster, url: str) -> tuple[int, int]:
    """SIGKILL the API server of the engine at ``url`` (a crash: its EngineCore is left
    to the launcher's supervisor).  Returns its pid and the launcher's output position
    from which to look for the supervisor's lines."""
    since = len(cluster.output)
    proc = launcher_child(cluster, port=int(url.rsplit(":", 1)[1]))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    return proc.pid, since


def wait_engine_restarted(cluster: Cluster, name: str, url: str, old_pid: int, since: int,
                          timeout_s: float = READY_TIMEOUT_S) -> None:
    """The launcher logged ``name``'s exit and restart, and the new process answers
    /health on the same URL."""
    wait_output(cluster, rf"supervisor event=exited process={name} pid={old_pid} "
                         r"exit_code=-9 ", 30, since)
    wait_output(cluster, rf"supervisor event=restarted process={name} pid=\d+ exit_code=-9 "
                         rf"attempt=\d+ old_pid={old_pid}\b", 30, since)
    wait_output(cluster, rf"supervisor event=healthy process={name} ", timeout_s, since)
    new = launcher_child(cluster, port=int(url.rsplit(":", 1)[1]))
    assert new.pid != old_pid
    resp = requests.get(url + "/health", timeout=10)
    assert resp.status_code == 200, resp.text


def start_proxy_process(argv: list[str], port: int, timeout_s: float = 120.0
                        ) -> tuple[subprocess.Popen, str]:
    """Start a proxy (``argv`` serving on 127.0.0.1:``port``) beside a cluster and wait
    for its /health; the tail of its log is in the assertion if it exits first.

    Its log goes to a file, not a pipe: a pipe nobody reads fills (64 KiB) and the
    proxy's next log line blocks its event loop, requests and SIGTERM included."""
    log = tempfile.NamedTemporaryFile(prefix=f"proxy-{port}-", suffix=".log", delete=False)
    with log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, Path(log.name).read_text(errors="replace")[-3000:]
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, f"the proxy's /health after {timeout_s} s"
        time.sleep(0.1)


def wait_proxy_sees(proxy_url: str, decode: int, timeout_s: float = 60.0) -> None:
    """Wait until the proxy's /health counts ``decode`` healthy D engines."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = requests.get(proxy_url + "/health", timeout=10)
        healthy = resp.json()["healthy"]
        if healthy["decode"] == decode:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"proxy /health after {timeout_s:.0f}s: {resp.status_code} "
                                 f"{resp.text}")
        time.sleep(0.5)


class OwnRedis:
    """A redis-server this test owns: kill, stop, continue, restart on one port."""

    def __init__(self, port: int, log_dir: Path) -> None:
        self.port, self.log_dir = port, log_dir
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        from vllm_sessionkv.dev.launch import start_redis, wait_redis

        self.proc = start_redis(self.port, self.log_dir)
        wait_redis(self.port, timeout_s=10.0)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.popen.wait(timeout=10)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        from vllm_sessionkv.dev.launch import stop_all

        try:
            self.resume()
        except ProcessLookupError:
            pass
        stop_all([self.proc], grace_s=5.0)
