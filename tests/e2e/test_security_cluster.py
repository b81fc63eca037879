"""Issue 49 must-show 4 on real engines: P and D started with vLLM's ``--api-key``
behind a proxy that asks clients for its own key, with the side ports' messages
signed (``side_port_secret``) and the KV-event sockets bound to the engines' address.

* D refuses a request without the engines' key (vLLM's own check: the control that
  the engines really run with ``--api-key``);
* through the proxy: without the client key a 401, with it a disaggregated answer
  equal to the co-located server's at temperature 0 (P -> NIXL -> D, the proxy sending
  the engines' key on every call, early decode's pushes signed and taken by D);
* a forged ``PrefillDone`` pushed to D's real early-decode port by a sender without
  the secret is refused and counted by D's connector, and the next request is still
  served right;
* the KV-event sockets listen on 127.0.0.1 only: a connection to another loopback
  address (127.0.0.2) is refused, while the proxy's index gets the events.
"""

from __future__ import annotations

import pytest
import requests
import zmq
from cluster import launch_cluster, stop_cluster
from helpers import (assert_same, completion_body, connection_refused, metric_sum, post,
                     wait_until)

from vllm_sessionkv.wire.protocol import PrefillDone, encode_prefill_done

pytestmark = pytest.mark.cluster

ENGINE_KEY = "engine-key-for-the-test-0123"
CLIENT_KEY = "client-key-for-the-test-4567"
SECRET = "side-port-secret-for-the-test"
PROMPT = "The sea is wide and the sky is high; " * 8


@pytest.fixture(scope="module")
def keyed_cluster(tiny_model, tmp_path_factory):
    cluster = launch_cluster(tiny_model, tmp_path_factory.mktemp("security-logs"), [
        "--prefill", "1", "--decode", "1", "--decode-only-max-uncached-tokens", "-1",
        "--colocated-port", "0", "--engine-api-key", ENGINE_KEY, "--api-key", CLIENT_KEY,
        "--side-port-secret", SECRET])
    try:
        yield cluster
    finally:
        report = stop_cluster(cluster)
        assert not report["alive"], report


def test_keyed_engines_serve_behind_the_keyed_proxy(keyed_cluster):
    cluster = keyed_cluster
    d_url, model = cluster.decode[0], cluster.model
    body = completion_body(model, PROMPT, max_tokens=12)
    client = {"Authorization": f"Bearer {CLIENT_KEY}"}

    # The engines run with --api-key: D refuses a request without it.
    assert requests.post(d_url + "/v1/completions", json=body, timeout=60).status_code == 401
    # The proxy: no key, a 401 in OpenAI's shape; with it, P -> D, as co-located.
    resp = requests.post(cluster.proxy + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(cluster.proxy + "/health", timeout=30).status_code == 200
    early_ready = metric_sum(d_url, "sessionkv_early_decode_requests_total",
                             outcome="ready")
    baseline = post(cluster.colocated, "/v1/completions", body)
    ours = post(cluster.proxy, "/v1/completions", body, headers=client)
    assert ours.headers["x-sessionkv-route"] == "disaggregated"
    assert_same(ours, baseline, "through the keyed proxy")
    wait_until(lambda: metric_sum(d_url, "sessionkv_early_decode_requests_total",
                                  outcome="ready") > early_ready, 60,
               "D to take P's signed parameters (early decode ready)")
    assert metric_sum(d_url, "sessionkv_early_decode_messages_refused_total") == 0

    # A forged PrefillDone from a sender without the secret, to D's real port.
    endpoint = cluster.early_decode[d_url]
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(endpoint)
    push.send(encode_prefill_done(PrefillDone(
        early_decode_id="0" * 32, kv_transfer_params={"do_remote_prefill": True,
                                                      "remote_block_ids": [[1]]})))
    push.close()
    context.term()
    # D drains its port while a request waits there: the next request's does it.
    second = completion_body(model, PROMPT + " And then", max_tokens=12)
    baseline = post(cluster.colocated, "/v1/completions", second)
    ours = post(cluster.proxy, "/v1/completions", second, headers=client)
    assert_same(ours, baseline, "after a forged PrefillDone")
    wait_until(lambda: metric_sum(d_url, "sessionkv_early_decode_messages_refused_total",
                                  reason="unauthenticated") >= 1, 60,
               "D to count the forged message as unauthenticated")

    # The proxy counted the 401 and sees the engines' events (socket bound, reached).
    resp = requests.get(cluster.proxy + "/metrics", headers=client, timeout=30)
    assert 'sessionkv_proxy_unauthorized_requests_total{endpoint="/v1/completions"} 1.0' \
        in resp.text
    assert requests.get(cluster.proxy + "/metrics", timeout=30).status_code == 401
    wait_until(lambda: _events_applied(cluster.proxy, client) > 0, 60,
               "the proxy to apply KV events")
    for url, events in cluster.kv_events.items():
        port = int(events.rsplit(":", 1)[1])
        assert not connection_refused("127.0.0.1", port), f"{url}'s KV events not on 127.0.0.1"
        assert connection_refused("127.0.0.2", port), f"{url}'s KV events listen on every address"


def _events_applied(proxy: str, headers: dict[str, str]) -> float:
    text = requests.get(proxy + "/metrics", headers=headers, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sessionkv_proxy_events_applied{"))
