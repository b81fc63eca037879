"""A local Redis Cluster for tests: 3 masters with 1 replica each, from
``redis-server --cluster-enabled yes`` processes joined by ``redis-cli --cluster
create``.  Each wait is on a condition (``CLUSTER INFO``, ``CLUSTER NODES``,
``INFO replication``), never a fixed sleep."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from vllm_sessionkv.dev.launch import ManagedProcess, start_process, stop_all

__all__ = ["LocalRedisCluster"]

MASTERS, REPLICAS_PER_MASTER = 3, 1
# Short, so that a killed master is failed over within a few seconds; the test
# processes still answer well within it on a loaded 2-core machine.
NODE_TIMEOUT_MS = 2000


def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis cluster: timed out waiting for {what}")
        time.sleep(0.05)


def _answers(port: int, check: Callable[[redis.Redis], bool]) -> bool:
    client = redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        return check(client)
    except redis.RedisError:
        return False
    finally:
        client.close()


class LocalRedisCluster:
    """Six ``redis-server`` processes on loopback; ``ports[i]`` with its cluster bus
    port ``bus_ports[i]`` (picked free too, not port + 10000)."""

    def __init__(self, pick_port: Callable[[], int], work_dir: Path) -> None:
        n = MASTERS * (1 + REPLICAS_PER_MASTER)
        self.ports = [pick_port() for _ in range(n)]
        self.bus_ports = [pick_port() for _ in range(n)]
        self.work_dir = work_dir
        self.procs: dict[int, ManagedProcess] = {}
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """Any one node is enough; the client reads the rest from the cluster."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def _start(self) -> None:
        for port, bus in zip(self.ports, self.bus_ports):
            node_dir = self.work_dir / str(port)
            node_dir.mkdir(parents=True, exist_ok=True)
            self.procs[port] = start_process(f"redis-{port}", [
                "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                "--protected-mode", "yes", "--save", "", "--appendonly", "no",
                "--dir", str(node_dir), "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-port", str(bus), "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                # A replica may take over however long it was cut off (tests kill
                # its master right after writing).
                "--cluster-replica-validity-factor", "0"], node_dir)
        for port in self.ports:
            _until(lambda p=port: _answers(p, lambda c: c.ping()), 10, f"node {port}")
        created = subprocess.run(
            ["redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", str(REPLICAS_PER_MASTER), "--cluster-yes"],
            capture_output=True, text=True, timeout=60)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}\n"
                               f"{created.stderr}")
        self.wait_ok()
        # Every replica has synced with its master (so a failover has data to keep).
        for port in self.replicas():
            _until(lambda p=port: _answers(p, lambda c: c.info("replication").get(
                "master_link_status") == "up"), 30, f"replica {port} to sync")

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and sees 3 masters, all of
        them live processes, serving all slots (after a kill: once a replica took
        over, not while the others have yet to notice)."""
        def ok(c: redis.Redis) -> bool:
            info = c.cluster("info")
            masters = self.masters(c)
            return (info.get("cluster_state") == "ok"
                    and int(info.get("cluster_slots_ok", 0)) == 16384
                    and len(masters) == MASTERS
                    and set(masters) <= set(self.live_ports()))

        _until(lambda: all(_answers(p, ok) for p in self.live_ports()), timeout_s,
               "cluster_state:ok on every live node")

    def live_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.alive()]

    @staticmethod
    def _nodes(client: redis.Redis) -> list[tuple[int, str]]:
        """(port, flags) of every node that ``client``'s node knows."""
        # redis-py parses it: {"host:port": {"flags": "myself,master", ...}}
        return [(int(address.rsplit(":", 1)[1]), node["flags"])
                for address, node in client.cluster("nodes").items()]

    def masters(self, client: redis.Redis) -> list[int]:
        return [p for p, flags in self._nodes(client)
                if "master" in flags and "fail" not in flags]

    def replicas(self) -> list[int]:
        return [p for p, flags in self._ask(self._nodes) if "slave" in flags]

    def _ask(self, question):
        client = redis.Redis(port=self.live_ports()[0], socket_timeout=2.0)
        try:
            return question(client)
        finally:
            client.close()

    def master_of(self, key: str) -> int:
        """The port of the master that serves ``key``'s slot."""
        def ask(client: redis.Redis) -> int:
            slot = client.cluster("keyslot", key)
            for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
            raise LookupError(f"no master serves slot {slot}")
        return self._ask(ask)

    def kill(self, port: int) -> None:
        """SIGKILL one node, as a crashed host would end it."""
        proc = self.procs[port]
        os.kill(proc.pid, signal.SIGKILL)
        proc.popen.wait(timeout=10)

    def stop(self) -> None:
        stop_all(list(self.procs.values()), grace_s=5.0)
