"""The launcher's supervisor (``LocalCluster.supervise_once``) on real child processes.

No vLLM engine: the children are short Python programs and a real redis-server, started
through the launcher's own ``start_process``/``start_redis``.  The clock is stepped
through ``supervise_once(now_s=...)``, so backoffs and windows are checked exactly.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from vllm_sessionkv.dev.launch import (
    ChildExited,
    ClusterSpec,
    EventKind,
    LocalCluster,
    free_port,
    start_process,
    wait_redis,
)

REPO = Path(__file__).resolve().parents[2]
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
# Starts a grandchild in its process group, as vLLM's API server starts EngineCore.
WITH_GRANDCHILD = [sys.executable, "-c",
                   "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                   "'import time; time.sleep(120)']); time.sleep(120)"]
HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def make_cluster(tmp_path):
    clusters: list[LocalCluster] = []

    def make(**spec) -> LocalCluster:
        spec = {"max_restarts": 3, "restart_window_s": 60.0, "restart_backoff_s": 1.0,
                "max_restart_backoff_s": 30.0, **spec}
        cluster = LocalCluster(ClusterSpec(model="unused", log_dir=tmp_path, **spec))
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()
        assert not [p for p in cluster.procs if p.alive()]


def _manage(cluster: LocalCluster, name: str, argv: list[str], health_url: str | None = None):
    return cluster.manage(name, lambda: start_process(name, argv, cluster.spec.log_dir),
                          health_url)


def _kill(proc) -> int:
    os.kill(proc.pid, signal.SIGKILL)
    proc.popen.wait(timeout=10)
    return proc.pid


def _kinds(events) -> list[tuple[EventKind, str]]:
    return [(e.kind, e.process) for e in events]


def test_killed_child_is_restarted_after_its_backoff_and_the_rest_keep_running(
        make_cluster, caplog):
    cluster = make_cluster()
    victim = _manage(cluster, "victim", SLEEP)
    other = _manage(cluster, "other", SLEEP)
    victim.log_path.write_text("first run's last words\n")
    assert cluster.supervise_once(now_s=0.0) == []
    old_pid = _kill(victim)

    caplog.set_level(logging.INFO, logger="vllm_sessionkv.dev.launch")
    events = cluster.supervise_once(now_s=10.0)
    assert _kinds(events) == [(EventKind.EXITED, "victim")]
    assert events[0].exit_code == -signal.SIGKILL and events[0].pid == old_pid
    assert cluster.supervise_once(now_s=10.9) == []  # backoff 1 s not over

    events = cluster.supervise_once(now_s=11.0)
    assert _kinds(events) == [(EventKind.RESTARTED, "victim")]
    assert events[0].attempt == 1 and events[0].exit_code == -signal.SIGKILL
    new = cluster.procs[0]
    assert new.pid != old_pid and new.alive() and new.name == "victim"
    assert other.alive() and cluster.procs[1] is other
    # The run that ended keeps its log; the new run writes a fresh one.
    assert (victim.log_path.parent / "victim.log.1").read_text() == "first run's last words\n"
    assert victim.log_path.exists()
    logged = caplog.text
    assert re.search(rf"supervisor event=exited process=victim pid={old_pid} exit_code=-9", logged)
    assert re.search(rf"supervisor event=restarted process=victim pid={new.pid} "
                     r"exit_code=-9 attempt=1 old_pid=", logged)


def test_restarts_are_bounded_in_a_window_then_the_child_is_given_up(make_cluster, caplog):
    cluster = make_cluster(max_restarts=2, restart_window_s=60.0, restart_backoff_s=1.0)
    crash = [sys.executable, "-c", "raise SystemExit(3)"]
    _manage(cluster, "crasher", crash)
    steady = _manage(cluster, "steady", SLEEP)

    def exited_at(now_s: float):
        cluster.procs[0].popen.wait(timeout=30)
        return cluster.supervise_once(now_s=now_s)

    assert _kinds(exited_at(0.0)) == [(EventKind.EXITED, "crasher")]
    assert _kinds(cluster.supervise_once(now_s=1.0)) == [(EventKind.RESTARTED, "crasher")]
    # The backoff doubles with each restart in the window: 2 s now.
    assert _kinds(exited_at(1.5)) == [(EventKind.EXITED, "crasher")]
    assert cluster.supervise_once(now_s=3.4) == []
    events = cluster.supervise_once(now_s=3.5)
    assert _kinds(events) == [(EventKind.RESTARTED, "crasher")] and events[0].attempt == 2

    caplog.set_level(logging.INFO, logger="vllm_sessionkv.dev.launch")
    events = exited_at(4.0)
    assert _kinds(events) == [(EventKind.EXITED, "crasher"), (EventKind.GAVE_UP, "crasher")]
    assert events[0].exit_code == 3
    assert cluster.given_up() == ["crasher"]
    assert cluster.supervise_once(now_s=1000.0) == []  # stays given up
    assert steady.alive() and cluster.procs[1] is steady
    gave_up = [r for r in caplog.records if "event=gave_up" in r.getMessage()]
    assert len(gave_up) == 1 and gave_up[0].levelno == logging.ERROR
    assert "process=crasher" in gave_up[0].getMessage()
    assert "restarts_in_window=2 window_s=60" in gave_up[0].getMessage()


def test_restarts_outside_the_window_do_not_count(make_cluster):
    cluster = make_cluster(max_restarts=1, restart_window_s=10.0, restart_backoff_s=1.0)
    proc = _manage(cluster, "child", SLEEP)
    _kill(proc)
    cluster.supervise_once(now_s=0.0)
    assert _kinds(cluster.supervise_once(now_s=1.0)) == [(EventKind.RESTARTED, "child")]
    _kill(cluster.procs[0])
    # The restart at t=1 is out of the 10 s window at t=20: the backoff starts over.
    assert _kinds(cluster.supervise_once(now_s=20.0)) == [(EventKind.EXITED, "child")]
    assert _kinds(cluster.supervise_once(now_s=21.0)) == [(EventKind.RESTARTED, "child")]
    assert cluster.given_up() == [] and cluster.procs[0].alive()


def test_max_restarts_zero_never_restarts(make_cluster):
    cluster = make_cluster(max_restarts=0)
    _kill(_manage(cluster, "child", SLEEP))
    events = cluster.supervise_once(now_s=0.0)
    assert _kinds(events) == [(EventKind.EXITED, "child"), (EventKind.GAVE_UP, "child")]
    assert cluster.supervise_once(now_s=100.0) == []


def test_a_dead_childs_process_group_is_killed_before_it_restarts(make_cluster):
    cluster = make_cluster()
    leader = _manage(cluster, "engine", WITH_GRANDCHILD)
    deadline = time.monotonic() + 30
    while not psutil.Process(leader.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    (grandchild,) = psutil.Process(leader.pid).children()
    _kill(leader)
    assert grandchild.is_running()  # orphaned, still holding whatever it held
    cluster.supervise_once(now_s=0.0)
    grandchild.wait(timeout=10)
    assert not grandchild.is_running()


def test_restarted_child_with_a_health_url_is_reported_healthy(make_cluster):
    cluster = make_cluster(restart_backoff_s=0.0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    _kill(_manage(cluster, "server", [sys.executable, "-c", HEALTH_SERVER, str(port)], url))
    assert _kinds(cluster.supervise_once()) == [(EventKind.EXITED, "server")]
    assert _kinds(cluster.supervise_once()) == [(EventKind.RESTARTED, "server")]
    deadline = time.monotonic() + 30
    events = []
    while not events and time.monotonic() < deadline:
        events = cluster.supervise_once()
        time.sleep(0.05)
    assert _kinds(events) == [(EventKind.HEALTHY, "server")] and events[0].attempt == 1
    assert cluster.supervise_once() == []  # reported once


def test_fail_fast_raises_and_restarts_nothing(make_cluster):
    cluster = make_cluster(fail_fast=True)
    victim = _manage(cluster, "victim", SLEEP)
    other = _manage(cluster, "other", SLEEP)
    _kill(victim)
    with pytest.raises(ChildExited) as info:
        cluster.supervise_once(now_s=0.0)
    assert info.value.exited == [("victim", -signal.SIGKILL)]
    assert cluster.procs[0] is victim and other.alive()
    assert cluster.supervise_once(now_s=100.0) == []  # raised once, nothing restarted
    cluster.stop()
    assert not other.alive()


def _launch_redis_only(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, int, list[str]]:
    """examples/local_cluster.py with Redis as its only child (no engines, no proxy)."""
    port = free_port()
    argv = [sys.executable, str(REPO / "examples" / "local_cluster.py"), "--model", "unused",
            "--prefill", "0", "--decode", "0", "--no-proxy", "--redis",
            "--base-port", str(port), "--log-dir", str(tmp_path), *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("READY "):
            return proc, port, lines
    raise AssertionError("local_cluster.py did not become READY:\n" + "".join(lines))


def _redis_pid(launcher: subprocess.Popen) -> int:
    (child,) = psutil.Process(launcher.pid).children()
    assert child.name().startswith("redis")
    return child.pid


def _read_until(proc: subprocess.Popen, lines: list[str], pattern: str) -> str:
    for line in proc.stdout:  # the launcher's own deadline-free loop: pytest-timeout bounds it
        lines.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(lines))


@pytest.mark.timeout(120)
def test_local_cluster_script_restarts_a_killed_child(tmp_path):
    launcher, port, lines = _launch_redis_only(tmp_path)
    try:
        old = _redis_pid(launcher)
        os.kill(old, signal.SIGKILL)
        _read_until(launcher, lines, r"supervisor event=exited process=redis .*exit_code=-9")
        line = _read_until(launcher, lines, r"supervisor event=restarted process=redis ")
        assert f"old_pid={old}" in line
        wait_redis(port)  # the same port again
        assert launcher.poll() is None
    finally:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0


@pytest.mark.timeout(120)
def test_local_cluster_script_fail_fast_exits_1_when_a_child_dies(tmp_path):
    launcher, _, lines = _launch_redis_only(tmp_path, "--fail-fast")
    try:
        os.kill(_redis_pid(launcher), signal.SIGKILL)
        assert launcher.wait(timeout=60) == 1
        lines += launcher.stdout.readlines()
        assert any("process exited: redis (exit code -9)" in line for line in lines), lines
    finally:
        if launcher.poll() is None:
            launcher.kill()
