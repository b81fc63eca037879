"""Start and stop real clusters for the end-to-end tests (shared by conftest and tests).

A plain module, not ``conftest``: several conftest.py files exist under tests/, and
importing one by name would pick whichever pytest loaded last.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 240.0
# KV cache per test engine: 262,144 tokens of the tiny model, far above any test's
# need.  vLLM's 1 GiB default put up to nine engines' worth (6.75 GiB more) on this
# 24 GiB machine while the session cluster and the 2P+2D one ran together.
TEST_KV_CACHE_GB = 0.25
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
    model: str
    launcher: subprocess.Popen
    ready_s: float
    log_dir: Path
    descendants: list[int] = field(default_factory=list)
    colocated: str | None = None
    extras: dict[str, str] = field(default_factory=dict)
    teardown_report: dict = field(default_factory=dict)


def launch_cluster(model: str, log_dir: Path, args: list[str],
                   ready_timeout_s: float = READY_TIMEOUT_S) -> Cluster:
    """Run examples/local_cluster.py and wait for its READY line."""
    base = free_port_block(40)
    argv = [sys.executable, str(REPO / "examples" / "local_cluster.py"), "--model", model,
            "--base-port", str(base), "--proxy-port", str(base + 39),
            "--log-dir", str(log_dir), "--kv-cache-gb", str(TEST_KV_CACHE_GB), *args]
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
    # Keep draining its output so it never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    return Cluster(proxy=layout["proxy"], redis=layout["redis"], prefill=layout["prefill"],
                   decode=layout["decode"], kv_events=layout["kv_events"],
                   early_decode=layout.get("early_decode", {}), model=model,
                   launcher=proc, ready_s=ready_s, log_dir=log_dir, descendants=descendants)


def _running(pid: int) -> bool:
    """Alive and not a zombie; a process that exits while we look is not running."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_cluster(cluster: Cluster, timeout_s: float = 60.0) -> dict:
    """SIGTERM the launcher; report which of its processes are still alive."""
    cluster.launcher.send_signal(signal.SIGTERM)
    try:
        code = cluster.launcher.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    time.sleep(1.0)
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
        from vllm_sessionkv.launch import start_redis, wait_redis

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
        from vllm_sessionkv.launch import stop_all

        try:
            self.resume()
        except ProcessLookupError:
            pass
        stop_all([self.proc], grace_s=5.0)
