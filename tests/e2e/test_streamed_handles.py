"""Streamed turns keep D->P reuse without Redis: D's handle channel.

vLLM 0.32 streams no ``kv_transfer_params``, so a proxy relaying a streamed answer
never sees D's end-of-turn handle in it.  Here a proxy with no Redis subscribes to D's
handle channel (``--decode url=...,handles=tcp://...``); the control is the same proxy
without ``handles=``.  Both run beside the session cluster's engines (real vLLM with
the connector, real NIXL), the session cluster's own proxy untouched.

Between the two turns P's prefix cache is emptied, as when P's cache cannot keep the
session: turn 2's prompt starts with turn 1's, which only D still holds, so P either
pulls it from D by the session's handle or recomputes it.  Cost: two proxies on the
running session cluster, four short chat turns (about 20 s on 2 cores).
"""

from __future__ import annotations

import json
import sys

import pytest
import requests

from cluster import free_port_block
from helpers import (
    assert_same,
    chat_body,
    metric_sum,
    post,
    reset_prefix_cache,
    wait_until,
)
from vllm_sessionkv.dev.launch import start_process, stop_all, wait_healthy

pytestmark = pytest.mark.cluster

SYSTEM = " ".join(f"Rule {i}: answer briefly, keep tests real, never guess the {i}th fact."
                  for i in range(12))   # about 700 tokens of the tiny model


def _start_proxy(cluster, channel: bool, log_dir):
    (p_url,), (d_url,) = cluster.prefill, cluster.decode
    decode = f"url={d_url},events={cluster.kv_events[d_url]}"
    if channel:
        decode += f",handles={cluster.handle_channel[d_url]}"
    port = free_port_block(1)
    argv = [sys.executable, "-m", "sessionkv_proxy", "--host", "127.0.0.1",
            "--port", str(port), "--block-size", "32",
            "--decode-only-max-uncached-tokens", "-1",   # always P then D
            "--prefill", f"url={p_url},events={cluster.kv_events[p_url]}",
            "--decode", decode]
    proc = start_process(f"proxy-channel-{channel}", argv, log_dir)
    url = f"http://127.0.0.1:{port}"
    wait_healthy([(proc, url)], timeout_s=60)
    return proc, url


def _stored(proxy: str, d_url: str) -> int:
    report = requests.get(proxy + "/health", timeout=10).json()
    return report.get("handle_channel", {}).get(d_url, {}).get("stored", 0)


def _two_streamed_turns(cluster, proxy: str, session: str) -> dict:
    """Turn 1 and turn 2 of a streamed chat through ``proxy``, each equal to the
    co-located server's answer; what turn 2's P did."""
    (p_url,), (d_url,) = cluster.prefill, cluster.decode
    headers = {"X-Session-ID": session}
    messages = [{"role": "system", "content": f"{session}. {SYSTEM}"},
                {"role": "user", "content": "Write a function that reverses a string."}]
    stored_before = _stored(proxy, d_url)
    first = post(proxy, "/v1/chat/completions",
                 chat_body(cluster.model, messages, max_tokens=48, stream=True), headers)
    assert_same(first, post(cluster.colocated, "/v1/chat/completions",
                            chat_body(cluster.model, messages, max_tokens=48)), "turn 1")
    if "handle_channel" in requests.get(proxy + "/health", timeout=10).json():
        wait_until(lambda: _stored(proxy, d_url) > stored_before, 30,
                   "turn 1's handle on the proxy's channel")
    # Only D holds turn 1's prompt now (the reset waits out P's blocks still held
    # for D's read of turn 1).
    reset_prefix_cache(p_url, timeout_s=30)
    pulled_before = metric_sum(p_url, "sessionkv_prompt_tokens_total",
                               source="pulled_from_peer")
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "Now add a docstring and a test."}]
    second = post(proxy, "/v1/chat/completions",
                  chat_body(cluster.model, messages, max_tokens=32, stream=True), headers)
    assert_same(second, post(cluster.colocated, "/v1/chat/completions",
                             chat_body(cluster.model, messages, max_tokens=32)), "turn 2")
    # P's accounting header is on a stream only when P's answer reached the proxy before
    # D's first chunk (relay.py): P's own counter is what the tests read.
    return {"handle": second.headers["x-sessionkv-handle"],
            "accounting": json.loads(second.headers.get("x-sessionkv-prefill", "{}")),
            "pulled_on_p": metric_sum(p_url, "sessionkv_prompt_tokens_total",
                                      source="pulled_from_peer") - pulled_before}


@pytest.fixture(scope="module")
def proxies(pd_cluster, tmp_path_factory):
    assert pd_cluster.handle_channel, "local_cluster.py gave D no handle channel"
    log_dir = tmp_path_factory.mktemp("channel-proxies")
    started = []
    try:
        with_channel = _start_proxy(pd_cluster, True, log_dir)
        started.append(with_channel[0])
        without = _start_proxy(pd_cluster, False, log_dir)
        started.append(without[0])
        yield {"channel": with_channel[1], "none": without[1]}
    finally:
        stop_all(started)


def test_streamed_chat_pulls_from_d_on_the_next_turn_without_redis(pd_cluster, proxies):
    turn2 = _two_streamed_turns(pd_cluster, proxies["channel"], "stream-channel")
    print(f"with the channel, turn 2: {turn2}")
    assert turn2["handle"] == "attached", turn2
    # P pulled at least the blocks of turn 1's system prompt from D.
    assert turn2["pulled_on_p"] >= 500, turn2
    acct = turn2["accounting"]
    if acct:
        assert turn2["pulled_on_p"] == acct["pulled_from_peer_tokens"], turn2


def test_control_without_the_channel_a_streamed_turn_leaves_no_handle(pd_cluster, proxies):
    turn2 = _two_streamed_turns(pd_cluster, proxies["none"], "stream-none")
    print(f"without the channel, turn 2: {turn2}")
    assert turn2["handle"] == "none", turn2
    assert turn2["accounting"].get("pulled_from_peer_tokens", 0) == 0, turn2
    assert turn2["pulled_on_p"] == 0, turn2
