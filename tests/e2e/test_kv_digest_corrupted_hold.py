"""The content digest on real engines: bytes changed after the holder's digest, under
a standing claim, are caught by the reader's digest and never attached.

The holder is P (a prefill for D, P -> D).  The cluster runs with the test-only
fault hook ``SESSIONKV_TEST_CORRUPT_HELD_KV=1`` (``kv_digest.py``): each engine
overwrites the blocks of every hold it starts with noise, right after its worker
digested them.  Nothing ends the hold, so the pull guard grants D's claim and
confirms the read; only the digest can tell.  With ``kv_digest`` on, D's read fails
on the mismatch (counted, ``pull_failed``), D recomputes, and its answer equals the
co-located server.  The negative control runs the same on a cluster with
``kv_digest: false``: D pulls the noise and its answer differs.
"""

from __future__ import annotations

import json
import os

import pytest

from cluster import SESSION_COST, launch_cluster, stop_cluster
from helpers import (
    assert_same,
    compare,
    completion_body,
    fresh_prefill_params,
    metric_sum,
    post,
    token_ids,
    wait_until,
)
from vllm_sessionkv.kv_digest import TEST_CORRUPT_HELD_KV_ENV

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module", params=[True, False], ids=["digest", "no_digest"])
def corrupting_cluster(request, tiny_model, pd_cluster, tmp_path_factory):
    digest = request.param
    before = os.environ.get(TEST_CORRUPT_HELD_KV_ENV)
    os.environ[TEST_CORRUPT_HELD_KV_ENV] = "1"      # the engines started now inherit it
    try:
        cluster = launch_cluster(tiny_model, tmp_path_factory.mktemp("digest-logs"), [
            "--prefill", "1", "--decode", "1", "--no-proxy",
            "--sessionkv-config", json.dumps({"cost": SESSION_COST, "kv_digest": digest})])
    finally:
        if before is None:
            os.environ.pop(TEST_CORRUPT_HELD_KV_ENV)
        else:
            os.environ[TEST_CORRUPT_HELD_KV_ENV] = before
    cluster.colocated = pd_cluster.colocated
    cluster.extras["digest"] = "on" if digest else "off"
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


def _corrupted(cluster, request_id: str) -> bool:
    line = f"held blocks of request {request_id} after their digest"
    return any(line in path.read_text(errors="replace")
               for path in cluster.log_dir.glob("*.log"))


@pytest.mark.parametrize("reads", ["first", "warm"])
def test_bytes_changed_after_the_digest_are_never_attached(corrupting_cluster, reads):
    cluster = corrupting_cluster
    digest = cluster.extras["digest"] == "on"
    p_url, d_url, model = cluster.prefill[0], cluster.decode[0], cluster.model
    # The first read from P handshakes and reads asynchronously; a later short one
    # may read inside D's step (synchronously).
    prompt = token_ids(11 if reads == "first" else 12, 600 if reads == "first" else 200)
    p_out = post(p_url, "/v1/completions", completion_body(
        model, prompt, max_tokens=1, kv_transfer_params=fresh_prefill_params()))
    p_params = p_out.raw["kv_transfer_params"]
    assert p_params["sessionkv"].get("hold_token", 0) > 0, p_params
    # P's worker took the digest and then overwrote the held blocks (test hook).
    wait_until(lambda: _corrupted(cluster, p_params["remote_request_id"]), 60,
               "P overwrote its held blocks")
    mismatched = metric_sum(d_url, "sessionkv_kv_digest_checks_total", outcome="mismatched")
    answer = post(d_url, "/v1/completions", completion_body(
        model, prompt, max_tokens=16, kv_transfer_params=p_params))
    expected = post(cluster.colocated, "/v1/completions",
                    completion_body(model, prompt, max_tokens=16))
    acct = (answer.raw.get("kv_transfer_params") or {}).get("sessionkv", {}).get(
        "accounting", {})
    print(f"digest={digest} reads={reads}: accounting {acct}")
    if not digest:
        # Negative control: the noise was pulled and attached, and the answer differs.
        assert acct.get("pulled_from_peer_tokens", 0) > 0, acct
        assert not compare(answer, expected).equal, acct
        return
    assert_same(answer, expected, f"digest on, {reads} read")
    assert acct.get("pulled_from_peer_tokens", 0) == 0, acct
    assert "pull_failed" in acct.get("decision", ""), acct
    assert metric_sum(d_url, "sessionkv_kv_digest_checks_total",
                      outcome="mismatched") > mismatched
    # P digested what it held (holder side of the same counters).
    assert metric_sum(p_url, "sessionkv_kv_digest_blocks_total") > 0
