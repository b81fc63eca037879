"""A crashed D in the 1P+1D cluster from ``examples/local_cluster.py`` (``pd_cluster``).

D's API server is SIGKILLed mid-session.  The proxy keeps running and answering
/health, the launcher's supervisor logs D's exit, restarts it on the same port and
reports it healthy, and the session's next turns through the proxy equal the co-located
server in token ids and top-5 logprobs: D lost its KV, so they recompute it.  The test
ends with D back and seen healthy by the proxy, so later tests find the cluster whole.
"""

from __future__ import annotations

import pytest
import requests

from cluster import kill_engine, launcher_child, wait_engine_restarted, wait_proxy_sees
from helpers import assert_same, chat_body, post

from vllm_sessionkv.dev.workload import new_tokens, system_prompt, user_message

pytestmark = pytest.mark.cluster

CHAT = "/v1/chat/completions"


def test_killed_decode_engine_is_restarted_and_the_session_goes_on(pd_cluster):
    c = pd_cluster
    (d_url,) = c.decode
    proxy = launcher_child(c, argv_has="sessionkv_proxy")
    s = 300
    history = [{"role": "system", "content": system_prompt(s)}]

    def turn(t: int) -> None:
        history.append({"role": "user", "content": user_message(s, t)})
        body = chat_body(c.model, list(history), max_tokens=new_tokens(s, t))
        got = post(c.proxy, CHAT, body, headers={"X-Session-ID": "supervised-restart"})
        assert_same(got, post(c.colocated, CHAT, body), f"turn {t}")
        assert got.headers["x-sessionkv-decode-engine"] == d_url
        history.append({"role": "assistant", "content": got.text})

    turn(0)
    old_pid, since = kill_engine(c, d_url)

    # The proxy is not taken down with D: same process, and it answers /health
    # (503 "unavailable" once it has marked its only D unhealthy).
    resp = requests.get(c.proxy + "/health", timeout=10)
    assert resp.status_code in (200, 503) and "decode" in resp.json()["healthy"]
    assert proxy.is_running()

    wait_engine_restarted(c, "decode0", d_url, old_pid, since)
    wait_proxy_sees(c.proxy, decode=1)
    for t in (1, 2):
        turn(t)
    assert proxy.is_running() and launcher_child(c, argv_has="sessionkv_proxy").pid == proxy.pid
    assert c.launcher.poll() is None
