"""P, D, the co-located baseline and the proxy with Redis on separate network hosts.

Each runs in its own Linux network namespace (``tests/netns.py``), joined by veth
links to a switch on a private /24; the test process reaches them from the root
namespace.  ``examples/local_cluster.py`` starts them with ``--placement``: every
address it hands out (engine URLs, NIXL side channels, KV-event and early-decode
endpoints, Redis, the handles' engine URLs) is the host's own.  NIXL runs over UCX
TCP on the host's link only (``UCX_TLS=tcp``, ``UCX_NET_DEVICES``), as between
machines: no shared memory.

One conversation through the proxy: every turn equals the co-located server in token
ids and top-5 logprobs, and on a turn after P lost its cache P pulls the session's
blocks from D.  The bytes are counted on the TCP connections between P's and D's
namespaces and on their links.
"""

from __future__ import annotations

import json

import pytest
import redis

import netns
from cluster import SESSION_COST, launch_cluster, stop_cluster
from helpers import (
    assert_same,
    completion_body,
    metric_sum,
    post,
    reset_prefix_cache,
    wait_until,
)
from vllm_sessionkv.wire.protocol import session_store_key
from vllm_sessionkv.wire.redis_keys import RedisKeys

pytestmark = pytest.mark.cluster

# Hosts, by the one-letter code in their link names.
HOSTS = {"prefill": "p", "decode": "d", "colocated": "c", "proxy": "x"}
# Any port: the co-located server is alone in its namespace.
COLOCATED_PORT = 29500
BLOCK = 32
NEW_TOKENS = 64  # user text added each turn


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 990 + 20 for i in range(n)]


def _grown(url: str, name: str, before: float) -> float:
    """How much a counter grew, once it has (an engine's stats reach /metrics with its
    step outputs, possibly just after the answer)."""
    wait_until(lambda: metric_sum(url, name) > before, 30, f"{name} to grow on {url}")
    return metric_sum(url, name) - before


def _placement(net: netns.HostNetwork) -> dict:
    def host(name: str, engine: bool) -> dict:
        h = net.hosts[name]
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": h.interface} if engine else {}
        return {"address": h.address, "command_prefix": h.command_prefix, "env": env}

    return {"prefill0": host("prefill", True), "decode0": host("decode", True),
            "colocated": host("colocated", True), "proxy": host("proxy", False),
            "redis": host("proxy", False)}


@pytest.fixture(scope="module")
def hosts_cluster(tiny_model, tmp_path_factory):
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    net = netns.create_network(HOSTS)
    cluster = None
    try:
        cluster = launch_cluster(tiny_model, tmp_path_factory.mktemp("hosts-logs"), [
            "--prefill", "1", "--decode", "1", "--redis",
            "--colocated-port", str(COLOCATED_PORT),
            "--decode-only-max-uncached-tokens", "-1",
            "--sessionkv-config", json.dumps({"cost": SESSION_COST}),
            "--placement", json.dumps(_placement(net))])
        yield cluster, net
    finally:
        report = stop_cluster(cluster) if cluster is not None else {"alive": []}
        left = net.close()
        assert not report["alive"], f"processes left after SIGTERM: {report}"
        assert not left, f"namespaces or links left: {left}"


def test_session_across_hosts_equals_colocated_and_pulls_from_d(hosts_cluster):
    cluster, net = hosts_cluster
    p, d, x = net.hosts["prefill"], net.hosts["decode"], net.hosts["proxy"]
    p_url, d_url = cluster.prefill[0], cluster.decode[0]
    # Every address handed out is the host's own, none loopback.
    assert p_url.startswith(f"http://{p.address}:") and d_url.startswith(f"http://{d.address}:")
    assert cluster.proxy.startswith(f"http://{x.address}:")
    assert cluster.redis.startswith(f"redis://{x.address}:")
    assert cluster.early_decode[d_url].startswith(f"tcp://{d.address}:")
    assert cluster.kv_events[p_url].startswith(f"tcp://{p.address}:")
    colocated = f"http://{net.hosts['colocated'].address}:{COLOCATED_PORT}"
    model = cluster.model

    early_ready_before = metric_sum(d_url, "sessionkv_early_decode_requests_total",
                                    outcome="ready")
    p_pushes_before = metric_sum(p_url, "sessionkv_early_decode_pushes_total")
    session = "hosts"
    prompt = _ids(7, 600)
    pulls = []
    for turn in range(1, 4):
        if turn == 3:
            # As if P's cache had been evicted: what P reuses must come from D.
            reset_prefix_cache(p_url)
        before = {
            "pulled": metric_sum(p_url, "sessionkv_prompt_tokens_total",
                                 source="pulled_from_peer"),
            "p_nixl": metric_sum(p_url, "vllm:nixl_bytes_transferred_sum"),
            "d_nixl": metric_sum(d_url, "vllm:nixl_bytes_transferred_sum"),
            "p_from_d": p.tcp_bytes_received_from(d.address),
            "d_from_p": d.tcp_bytes_received_from(p.address),
            "p_link": p.interface_bytes(), "d_link": d.interface_bytes()}
        got = post(cluster.proxy, "/v1/completions", completion_body(
            model, prompt, max_tokens=24, stream=turn == 3, session_id=session))
        base = post(colocated, "/v1/completions", completion_body(model, prompt, max_tokens=24))
        assert_same(got, base, f"turn {turn}")
        # A streamed turn's answer may start before P's answer reaches the proxy (D had
        # P's parameters from P's connector): it then goes without P's accounting
        # header (relay.EngineSender.answer), and P's own counter says what it pulled.
        acct_header = got.headers.get("x-sessionkv-prefill")
        assert acct_header is not None or turn == 3, got.headers
        # P -> D, every turn: D read P's blocks from P's host.
        d_nixl = _grown(d_url, "vllm:nixl_bytes_transferred_sum", before["d_nixl"])
        d_from_p = netns.received_since(before["d_from_p"], d.tcp_bytes_received_from(p.address))
        assert d_from_p >= d_nixl, (turn, d_nixl, d_from_p)
        if turn > 1:
            # D's handle from its last answer, its engine_url D's address.
            assert got.headers["x-sessionkv-handle"] == "attached", got.headers
        if turn == 3:
            # Turn 2's prompt and answer, which D holds, but for a partial last block
            # and the one D had not computed yet.
            least = len(prompt) - NEW_TOKENS - 2 * BLOCK

            def counted() -> float:
                return metric_sum(p_url, "sessionkv_prompt_tokens_total",
                                  source="pulled_from_peer") - before["pulled"]

            if acct_header is not None:
                pulled = json.loads(acct_header).get("pulled_from_peer_tokens", 0)
                assert pulled >= least, acct_header
                wait_until(lambda: counted() == pulled, 30,
                           "P's pulled_from_peer tokens to count the pull")
            else:
                wait_until(lambda: counted() >= least, 30,
                           f"P's pulled_from_peer tokens to count a pull of {least}+")
                pulled = int(counted())
            p_nixl = _grown(p_url, "vllm:nixl_bytes_transferred_sum", before["p_nixl"])
            p_from_d = netns.received_since(before["p_from_d"],
                                            p.tcp_bytes_received_from(d.address))
            p_link_rx = p.interface_bytes()[0] - before["p_link"][0]
            d_link_tx = d.interface_bytes()[1] - before["d_link"][1]
            # What P read from D arrived on TCP connections from D's address, and
            # crossed both hosts' links.
            assert p_from_d >= p_nixl, (p_nixl, p_from_d)
            assert p_link_rx >= p_from_d and d_link_tx >= p_from_d, (p_link_rx, d_link_tx)
            pulls.append({"pulled_tokens": pulled, "p_nixl_bytes": p_nixl,
                          "p_tcp_bytes_from_d": p_from_d, "p_link_rx_bytes": p_link_rx,
                          "d_link_tx_bytes": d_link_tx, "d_nixl_bytes_from_p": d_nixl})
        prompt = prompt + got.token_ids + _ids(100 + turn, NEW_TOKENS)
    # D took P's parameters on its early-decode socket each turn, pushed by P's host.
    assert metric_sum(d_url, "sessionkv_early_decode_requests_total",
                      outcome="ready") - early_ready_before == 3
    assert metric_sum(p_url, "sessionkv_early_decode_pushes_total") - p_pushes_before == 3
    # D published its handles to Redis on the proxy's host.
    store = redis.Redis.from_url(cluster.redis)
    wait_until(lambda: store.exists(RedisKeys().handle(session_store_key(session, None))), 30,
               "D's handle in Redis")
    store.close()
    # The proxy applied KV events from both engines' hosts.
    for url in (p_url, d_url):
        assert metric_sum(cluster.proxy, "sessionkv_proxy_events_applied", engine=url) > 0
    print(f"D->P pull across namespaces {net.subnet}: {pulls}")
