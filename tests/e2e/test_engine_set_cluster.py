"""Issue 49 must-show 5 on real engines: a decode engine added to a running proxy
gets traffic, and one removed gets none, with no restart; a request in flight on the
removed engine finishes.

On the session's 2P + 2D cluster (``cluster_2p2d`` in tests/conftest.py, shared with
test_routing_2p2d), the test runs a proxy of its own beside the launcher's, on a
watched ``--engines-file`` that first lists P0 and D0 only, then adds D1, then
removes D0 while a streamed request runs there.  Which D served a request is the proxy's
``x-sessionkv-decode-engine`` header, and each D's own count of finished requests
(``vllm:request_success_total``) confirms it.  Round-robin routing makes "gets
traffic" exact; every request goes P -> NIXL -> D, D1's through its early-decode
socket and KV events connected when it was added.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import requests
from cluster import REPO, free_port_block
from helpers import (completion_body, engine_pid, metric_sum, parse_stream, post, signal_tree,
                     wait_until)

pytestmark = pytest.mark.cluster

PROMPT = "Once upon a time in a land far away, " * 6
# Long enough that D0 is still decoding when the test freezes it.
STREAM_TOKENS = 2000


@pytest.fixture(scope="module")
def engines(cluster_2p2d):
    return cluster_2p2d


def _entry(cluster, url: str, role: str) -> dict:
    entry = {"url": url, "role": role}
    events = cluster.kv_events.get(url)
    if events:
        entry["kv_events"] = events
    if role == "decode":
        entry["early_decode"] = cluster.early_decode[url]
        entry["handle_channel"] = cluster.handle_channel[url]
    return entry


def _served(cluster, d_url: str) -> float:
    return metric_sum(d_url, "vllm:request_success_total")


def _proxy_sees(proxy: str, urls: list[str]) -> bool:
    health = requests.get(proxy + "/health", timeout=10).json()
    return [e["url"] for e in health["engines"]] == urls


def test_engines_added_and_removed_while_the_proxy_runs(engines, tmp_path):
    cluster = engines
    p0, (d0, d1) = cluster.prefill[0], cluster.decode
    entries = {url: _entry(cluster, url, role) for url, role in
               ((p0, "prefill"), (d0, "decode"), (d1, "decode"))}
    engines_file = tmp_path / "engines.json"
    engines_file.write_text(json.dumps([entries[p0], entries[d0]]))
    port = free_port_block(1)
    proxy = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(REPO / "proxy"), os.environ.get("PYTHONPATH", "")])}
    log = open(tmp_path / "proxy.log", "wb")
    # The file read every 0.1 s, so D0 is removed well within its long stream.
    config_file = tmp_path / "proxy.json"
    config_file.write_text(json.dumps({"engines_file_poll_s": 0.1}))
    proc = subprocess.Popen([sys.executable, "-m", "sessionkv_proxy", "--port", str(port),
                             "--config", str(config_file),
                             "--engines-file", str(engines_file), "--policy", "round_robin",
                             "--block-size", "32", "--tokenizer", "engine"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _healthy(proxy), 60, "the proxy to start")
        body = completion_body(cluster.model, PROMPT, max_tokens=8)
        # P0 and D0 only: D1 gets nothing.
        d1_before = _served(cluster, d1)
        first = [post(proxy, "/v1/completions", body) for _ in range(3)]
        assert {g.headers["x-sessionkv-decode-engine"] for g in first} == {d0}
        assert {g.headers["x-sessionkv-route"] for g in first} == {"disaggregated"}
        assert _served(cluster, d1) == d1_before

        # D1 added to the file: from then on it gets every other request.
        engines_file.write_text(json.dumps([entries[p0], entries[d0], entries[d1]]))
        wait_until(lambda: _proxy_sees(proxy, [p0, d0, d1]), 30, "D1 in the proxy's set")
        after_add = [post(proxy, "/v1/completions", body) for _ in range(4)]
        on_d1 = [g for g in after_add if g.headers["x-sessionkv-decode-engine"] == d1]
        assert len(on_d1) == 2, [g.headers["x-sessionkv-decode-engine"] for g in after_add]
        assert _served(cluster, d1) == d1_before + 2
        # The same answer from either D (temperature 0, the same model and prompt).
        assert {tuple(g.token_ids) for g in first + after_add} == {tuple(first[0].token_ids)}

        # A streamed request on D0, D0 frozen (SIGSTOP) as soon as its headers are in, then
        # D0 removed from the file: the request is in flight for as long as the test
        # needs, whatever the machine's speed or socket buffers.
        stream_body = completion_body(cluster.model, PROMPT, max_tokens=STREAM_TOKENS,
                                      stream=True)
        d0_pid = engine_pid(d0)   # looked up first: it scans every socket, and is slow
        d0_before = _served(cluster, d0)
        for _ in range(2):
            resp = requests.post(proxy + "/v1/completions", json=stream_body, stream=True,
                                 timeout=300)
            assert resp.status_code == 200
            if resp.headers["x-sessionkv-decode-engine"] == d0:
                break
            resp.content   # on D1: read it out, the next one goes to D0
        assert resp.headers["x-sessionkv-decode-engine"] == d0
        signal_tree(d0_pid, signal.SIGSTOP)   # D0 has the request (its headers are in)
        try:
            # Frozen with the stream under way: the proxy counts it on D0.
            health = requests.get(proxy + "/health", timeout=10).json()
            assert [e["in_flight"] for e in health["engines"] if e["url"] == d0] == [1], \
                health
            engines_file.write_text(json.dumps([entries[p0], entries[d1]]))
            wait_until(lambda: _proxy_sees(proxy, [p0, d1]), 30, "D0 out of the proxy's set")
            health = requests.get(proxy + "/health", timeout=10).json()
            assert health["draining"] == [{"url": d0, "role": "decode", "in_flight": 1}], \
                health
            after_remove = [post(proxy, "/v1/completions", body) for _ in range(4)]
            assert {g.headers["x-sessionkv-decode-engine"] for g in after_remove} == {d1}
        finally:
            signal_tree(d0_pid, signal.SIGCONT)
        streamed = parse_stream(resp.text)
        assert len(streamed.token_ids) == STREAM_TOKENS, "the in-flight request on D0 was cut"
        wait_until(lambda: requests.get(proxy + "/health", timeout=10).json()["draining"]
                   == [], 30, "D0 to finish draining")
        # D0 finished the one request it had, and got no other.
        assert _served(cluster, d0) == d0_before + 1
        text = requests.get(proxy + "/metrics", timeout=10).text
        assert 'sessionkv_proxy_engines{role="decode",state="serving"} 1.0' in text
        assert 'sessionkv_proxy_engine_set_changes_total{outcome="applied"} 2.0' in text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _healthy(proxy: str) -> bool:
    try:
        return requests.get(proxy + "/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False
