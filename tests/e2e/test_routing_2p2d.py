"""Session routing on 2 prefill + 2 decode engines, one and two proxy replicas.

The session's 2P + 2D cluster (``cluster_2p2d`` in tests/conftest.py:
``examples/local_cluster.py`` with Redis and the proxy, shared with
test_engine_set_cluster), with the session's plain co-located vLLM server
(``colocated_url``) as the baseline.

* 6 interleaved sessions of 4 chat turns each (distinct system prompts, temperature
  0, 100-200 new tokens a turn).  Every turn after the first must go where its KV is:
  the decode engine is the session's previous D, and either P reused KV (its own
  prefix cache or a pull from D: ``local_hit_tokens`` or ``pulled_from_peer_tokens``
  > 0 in P's accounting) or the proxy skipped P because D already holds nearly all of
  the prompt (``x-sessionkv-route: decode_only``, and D's accounting shows the hit).
  Every output equals the baseline (token ids and top-5 logprobs).
* A second proxy process on the same engines and the same Redis: a session whose
  turns alternate between the two replicas is routed the same way by both (same D,
  KV reused on every later turn), and its outputs equal the baseline.
* A D killed (SIGKILL) while a session lives there: the session's next turn goes to
  the other D and equals the baseline, and the turn after follows it there.  The
  launcher's supervisor restarts the killed D, and the test waits until the proxy
  counts both D engines healthy again, so the tests around it find the cluster whole.
"""

from __future__ import annotations

import json
import sys

import psutil
import pytest
import requests

from cluster import (
    free_port_block,
    kill_engine,
    refresh_descendants,
    wait_engine_restarted,
    wait_proxy_sees,
)
from helpers import assert_same, chat_body, metric_sum, post, wait_until

from vllm_sessionkv.dev.launch import (
    start_process,
    stop_all,
    wait_healthy,
)
from vllm_sessionkv.dev.workload import new_tokens, system_prompt, user_message

pytestmark = pytest.mark.cluster

CHAT = "/v1/chat/completions"
SESSIONS = 6
TURNS = 4


def session_headers_and_body(session_id: str, way: str) -> tuple[dict, dict]:
    """The three ways a client names its session."""
    if way == "prompt_cache_key":
        return {}, {"prompt_cache_key": session_id}
    if way == "header":
        return {"X-Session-ID": session_id}, {}
    return {}, {"session_id": session_id}


def _engine_layout(cluster) -> dict[str, dict[str, str]]:
    """url -> {"events", "replay"} of each engine, from the engines' own command lines
    (local_cluster.py prints the events endpoints but not the replay ones)."""
    out: dict[str, dict[str, str]] = {}
    for pid in refresh_descendants(cluster):
        try:
            argv = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if "--kv-events-config" not in argv or "--port" not in argv:
            continue
        port = argv[argv.index("--port") + 1]
        cfg = json.loads(argv[argv.index("--kv-events-config") + 1])
        out[f"http://127.0.0.1:{port}"] = {
            "events": cfg["endpoint"].replace("*", "127.0.0.1"),
            "replay": cfg["replay_endpoint"].replace("*", "127.0.0.1")}
    return out


@pytest.fixture(scope="module")
def second_proxy(cluster_2p2d, tmp_path_factory):
    """Another ``python -m sessionkv_proxy`` on the same engines and Redis."""
    layout = _engine_layout(cluster_2p2d)
    assert set(layout) == set(cluster_2p2d.prefill + cluster_2p2d.decode), layout
    port = free_port_block(1)
    argv = [sys.executable, "-m", "sessionkv_proxy", "--port", str(port),
            "--block-size", "32", "--redis-url", cluster_2p2d.redis]
    for flag, urls in (("--prefill", cluster_2p2d.prefill), ("--decode", cluster_2p2d.decode)):
        for url in urls:
            argv += [flag, f"url={url},events={layout[url]['events']},"
                           f"replay={layout[url]['replay']}"]
    proc = start_process("proxy-replica2", argv, tmp_path_factory.mktemp("proxy2-logs"))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy([(proc, url)], timeout_s=60)
        # Its subscribers rebuild the shared index from each publisher's replay: wait
        # until every engine's stream was replayed and events applied from it, where
        # the first replica has any.
        engines = [*cluster_2p2d.prefill, *cluster_2p2d.decode]

        def replayed(e: str) -> bool:
            first = metric_sum(cluster_2p2d.proxy, "sessionkv_proxy_events_applied", engine=e)
            return (metric_sum(url, "sessionkv_proxy_event_replays", engine=e) >= 1
                    and (first == 0
                         or metric_sum(url, "sessionkv_proxy_events_applied", engine=e) > 0))

        wait_until(lambda: all(map(replayed, engines)), 60,
                   "the second replica to replay every engine's events")
        yield url
    finally:
        stop_all([proc])
        assert not proc.alive()


def _acct(headers: dict[str, str], name: str) -> dict | None:
    raw = headers.get(name)
    return json.loads(raw) if raw else None


def _check_reuse(got, prev_decode: str, what: str) -> str:
    """Assert a later turn went where its KV is; return the route mode."""
    h = got.headers
    route = h.get("x-sessionkv-route")
    assert h.get("x-sessionkv-decode-engine") == prev_decode, (
        f"{what}: decode moved {prev_decode} -> {h.get('x-sessionkv-decode-engine')} "
        f"({h.get('x-sessionkv-route-reason')})")
    if route == "disaggregated":
        p = _acct(h, "x-sessionkv-prefill")
        assert p is not None, f"{what}: no P accounting header"
        # Zero counts are left out of the accounting JSON.
        assert p.get("local_hit_tokens", 0) > 0 or p.get("pulled_from_peer_tokens", 0) > 0, (
            f"{what}: P {h.get('x-sessionkv-prefill-engine')} reused no KV: {p} "
            f"(handle {h.get('x-sessionkv-handle')}; {h.get('x-sessionkv-route-reason')})")
    else:
        assert route == "decode_only", f"{what}: route {route!r}"
        d = _acct(h, "x-sessionkv-decode")
        assert d is not None and d.get("local_hit_tokens", 0) > 0, (
            f"{what}: decode-only turn found no KV on D: {d}")
    return route


def test_interleaved_sessions_follow_their_kv(cluster_2p2d):
    c = cluster_2p2d
    ways = ["prompt_cache_key", "header", "session_id"]
    history = {s: [{"role": "system", "content": system_prompt(s)}] for s in range(SESSIONS)}
    last_decode: dict[int, str] = {}
    routes: dict[str, int] = {}
    reused = {"p_local_hit": 0, "p_pulled": 0, "p_recomputed": 0, "d_local_hit": 0}
    firsts: dict[str, int] = {}
    for turn in range(TURNS):
        for s in range(SESSIONS):
            what = f"session {s} turn {turn}"
            history[s].append({"role": "user", "content": user_message(s, turn)})
            body = chat_body(c.model, list(history[s]), max_tokens=new_tokens(s, turn))
            headers, extra = session_headers_and_body(f"route-2p2d-{s}", ways[s % 3])
            got = post(c.proxy, CHAT, dict(body, **extra), headers=headers)
            base = post(c.colocated, CHAT, body)
            assert_same(got, base, what)
            assert len(got.token_ids) == new_tokens(s, turn)
            d_url = got.headers["x-sessionkv-decode-engine"]
            if turn == 0:
                firsts[d_url] = firsts.get(d_url, 0) + 1
            else:
                route = _check_reuse(got, last_decode[s], what)
                routes[route] = routes.get(route, 0) + 1
                p = _acct(got.headers, "x-sessionkv-prefill") or {}
                d = _acct(got.headers, "x-sessionkv-decode") or {}
                reused["p_local_hit"] += p.get("local_hit_tokens", 0)
                reused["p_pulled"] += p.get("pulled_from_peer_tokens", 0)
                reused["p_recomputed"] += p.get("recomputed_tokens", 0)
                reused["d_local_hit"] += d.get("local_hit_tokens", 0)
            last_decode[s] = d_url
            history[s].append({"role": "assistant", "content": got.text})
    print(f"first turns per D: {firsts}; later turns by route: {routes}; "
          f"tokens over later turns: {reused}")


def test_two_replicas_route_a_session_alike(cluster_2p2d, second_proxy):
    c = cluster_2p2d
    replicas = [c.proxy, second_proxy]
    for health in replicas:
        assert requests.get(health + "/health", timeout=10).status_code == 200
    for s, way in ((100, "prompt_cache_key"), (101, "header")):
        history = [{"role": "system", "content": system_prompt(s)}]
        session_id = f"route-replicas-{s}"
        decode = None
        for turn in range(TURNS):
            replica = replicas[(turn + s) % 2]
            what = f"replica session {s} turn {turn} via {replica}"
            history.append({"role": "user", "content": user_message(s, turn)})
            body = chat_body(c.model, list(history), max_tokens=new_tokens(s, turn))
            headers, extra = session_headers_and_body(session_id, way)
            got = post(replica, CHAT, dict(body, **extra), headers=headers)
            base = post(c.colocated, CHAT, body)
            assert_same(got, base, what)
            if decode is None:
                decode = got.headers["x-sessionkv-decode-engine"]
            else:
                _check_reuse(got, decode, what)
            history.append({"role": "assistant", "content": got.text})


def test_killed_decode_engine_moves_its_session_to_the_other_one(cluster_2p2d):
    c = cluster_2p2d
    s = 200
    history = [{"role": "system", "content": system_prompt(s)}]

    def turn(t: int):
        history.append({"role": "user", "content": user_message(s, t)})
        body = chat_body(c.model, list(history), max_tokens=new_tokens(s, t))
        got = post(c.proxy, CHAT, body, headers={"X-Session-ID": "route-2p2d-killed-d"})
        assert_same(got, post(c.colocated, CHAT, body), f"killed-D session turn {t}")
        history.append({"role": "assistant", "content": got.text})
        return got

    wait_proxy_sees(c.proxy, decode=2)
    first = turn(0).headers["x-sessionkv-decode-engine"]
    (other,) = set(c.decode) - {first}
    old_pid, since = kill_engine(c, first)
    try:
        got = turn(1)
        assert got.headers["x-sessionkv-decode-engine"] == other, (
            f"turn 1 went to {got.headers['x-sessionkv-decode-engine']} "
            f"({got.headers.get('x-sessionkv-route-reason')}), not the surviving {other}")
        _check_reuse(turn(2), other, "killed-D session turn 2")
    finally:
        wait_engine_restarted(c, f"decode{c.decode.index(first)}", first, old_pid, since)
        wait_proxy_sees(c.proxy, decode=2)
