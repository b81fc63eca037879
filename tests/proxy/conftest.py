"""Fixtures for proxy tests: a real redis-server and free TCP ports."""

from __future__ import annotations

import random
import shutil
import socket
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
    """A real redis-server on a free port; yields its URL, stopped by PID after.

    Tests share it; each index uses its own namespace, so they do not see each other.
    """
    from vllm_sessionkv.dev.launch import start_redis, stop_all, wait_redis

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not found on PATH (apt-get install redis-server)")
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        wait_redis(port, timeout_s=10.0)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_all([proc], grace_s=5.0)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory, free_port):
    """A local Redis Cluster (3 masters, 1 replica each; ``redis_cluster.py``) shared
    by the tests that only read and write it; yields the ``LocalRedisCluster``."""
    from redis_cluster import LocalRedisCluster

    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.fail("redis-server and redis-cli not found on PATH "
                    "(apt-get install redis-server)")
    cluster = LocalRedisCluster(free_port, tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["single", "cluster"])
def any_redis(request) -> str:
    """The URL of one Redis, then of a Redis Cluster: a test that takes it runs on both."""
    if request.param == "single":
        return request.getfixturevalue("redis_server")
    return request.getfixturevalue("redis_cluster").url
