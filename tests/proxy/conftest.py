"""Fixtures for proxy tests: a real redis-server and free TCP ports."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

# Tests on shared machines take ports from this range only.
_PORT_RANGE = (27000, 27999)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """Returns a function giving a currently free port, never the same one twice."""
    handed_out: set[int] = set()

    def pick() -> int:
        candidates = list(range(_PORT_RANGE[0], _PORT_RANGE[1] + 1))
        random.shuffle(candidates)
        for port in candidates:
            if port not in handed_out and _port_is_free(port):
                handed_out.add(port)
                return port
        raise RuntimeError(f"no free port in {_PORT_RANGE}")

    return pick


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory, free_port) -> Iterator[str]:
    """A real redis-server on a free port in a temp dir; yields its URL.

    Tests share it; each index uses its own namespace, so they do not see each other.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server not found on PATH (apt-get install redis-server)")
    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    log_path = workdir / "redis.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
             "--save", "", "--appendonly", "no", "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10.0
        while True:
            if proc.poll() is not None:
                pytest.fail(f"redis-server exited: {log_path.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"redis-server did not answer on port {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
