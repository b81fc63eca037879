"""Return the shared P/D cluster to a known state before a test module, and check it.

Ten modules share one session-scoped cluster (``pd_cluster``) and change it: a D
killed and restarted by its supervisor, a P stopped and resumed, session holds left
for their lease (120 s), prefix caches full of earlier prompts, background load.  A
module must not depend on which ran before it, so before each one the cluster is
brought to the same state:

* the launcher runs, and every engine (P, D, the co-located baseline, the perturbed
  P) answers ``/health``;
* the proxy counts every P and D available, with Redis up;
* no engine runs or queues a request;
* the proxy's ``POST /admin/reset`` has dropped every session (records and handles)
  and every P's and D's session holds and prefix cache; the baselines' caches are
  reset too;
* every D reports zero session holds.

Each step waits on its condition; when one does not hold within its time the module
fails with what is off, engine by engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import requests

from cluster import READY_TIMEOUT_S, Cluster
from helpers import metric_sum

__all__ = ["restore_known_state"]

# A D that a module killed can still be coming back: the supervisor's restart plus
# the engine's start.
HEALTHY_TIMEOUT_S = READY_TIMEOUT_S
# Background load a module left (requests of up to a few hundred tokens) drains in
# well under this on the 2-core machine.
IDLE_TIMEOUT_S = 120.0
RESET_TIMEOUT_S = 60.0
_POLL_S = 0.2


def _wait(problems: Callable[[], list[str]], timeout_s: float, what: str) -> None:
    """Poll ``problems()`` until it returns none; fail with the last ones."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = problems()
        if not found:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"shared cluster not in its known state after {timeout_s:.0f} s "
                                 f"({what}):\n  " + "\n  ".join(found))
        time.sleep(_POLL_S)


def _engines(cluster: Cluster) -> dict[str, str]:
    """url -> what it is, for every engine of the shared cluster."""
    named = {url: "P" for url in cluster.prefill}
    named.update({url: "D" for url in cluster.decode})
    if cluster.colocated:
        named[cluster.colocated] = "co-located baseline"
    named.update({url: name for name, url in cluster.extras.items()})
    return named


def _get(url: str) -> tuple[int | None, str]:
    try:
        resp = requests.get(url, timeout=5)
    except requests.RequestException as exc:
        return None, type(exc).__name__
    return resp.status_code, resp.text


def _health_problems(cluster: Cluster) -> list[str]:
    if cluster.launcher.poll() is not None:
        return [f"local_cluster.py exited with code {cluster.launcher.poll()}"]
    found = []
    for url, name in _engines(cluster).items():
        status, text = _get(url + "/health")
        if status != 200:
            found.append(f"{name} {url}: /health -> {status} {text[:200]}")
    status, text = _get(cluster.proxy + "/health")
    if status != 200:
        found.append(f"proxy {cluster.proxy}: /health -> {status} {text[:300]}")
        return found
    report = requests.get(cluster.proxy + "/health", timeout=5).json()
    want = {"prefill": len(cluster.prefill), "decode": len(cluster.decode)}
    if {role: report["healthy"].get(role) for role in want} != want:
        found.append(f"proxy counts {report['healthy']} available, want {want}")
    if cluster.redis and report.get("redis", {}).get("state") != "up":
        found.append(f"proxy: redis {report.get('redis')}")
    # (An event lag the proxy reports stays until the engine's next batch: a P a
    # module stopped and resumed leaves one.  The reset below sends every engine's
    # next batch.)
    return found


def _busy_problems(cluster: Cluster) -> list[str]:
    found = []
    for url, name in _engines(cluster).items():
        running = metric_sum(url, "vllm:num_requests_running")
        waiting = metric_sum(url, "vllm:num_requests_waiting")
        if running or waiting:
            found.append(f"{name} {url}: {running:g} requests running, {waiting:g} waiting")
    return found


def _reset_problems(cluster: Cluster) -> list[str]:
    """Reset through the proxy (sessions, then P's and D's holds and caches), then the
    baselines directly; each unreset engine named."""
    resp = requests.post(cluster.proxy + "/admin/reset", params={"timeout_s": "10"},
                         timeout=60)
    found = [] if resp.status_code == 200 else [
        f"proxy /admin/reset -> {resp.status_code} {resp.text[:400]}"]
    baselines = [url for url, name in _engines(cluster).items() if name not in ("P", "D")]
    for url in baselines:
        body = requests.post(url + "/reset_prefix_cache", params={"reset_external": "true"},
                             timeout=30).json()
        if body != {"success": True}:
            found.append(f"{_engines(cluster)[url]} {url}: /reset_prefix_cache -> {body}")
    return found


def _hold_problems(cluster: Cluster) -> list[str]:
    return [f"D {url}: {held:g} session holds"
            for url in cluster.decode
            if (held := metric_sum(url, "sessionkv_session_holds"))]


def restore_known_state(cluster: Cluster) -> None:
    """Bring the shared cluster to its known state (see the module docstring) and
    check it; raises AssertionError naming what is off."""
    _wait(lambda: _health_problems(cluster), HEALTHY_TIMEOUT_S, "engines and proxy healthy")
    _wait(lambda: _busy_problems(cluster), IDLE_TIMEOUT_S, "no request running or queued")
    _wait(lambda: _reset_problems(cluster), RESET_TIMEOUT_S,
          "sessions dropped, holds released, prefix caches reset")
    _wait(lambda: _hold_problems(cluster), RESET_TIMEOUT_S, "no session holds on D")
