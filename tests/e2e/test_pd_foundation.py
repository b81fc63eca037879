"""Foundation: requests go proxy -> P -> NIXL -> D and equal a co-located server.

Real vLLM servers, real NIXL transfers over UCX, real Redis.  Each test checks token
ids and top-5 logprobs against the co-located baseline.
"""

from __future__ import annotations

import time

import psutil
import pytest

from helpers import (
    assert_same,
    chat_body,
    compare,
    completion_body,
    fresh_prefill_params,
    metric_sum,
    post,
)

pytestmark = pytest.mark.cluster

PROMPT_IDS = [(7 * i + 3) % 900 + 20 for i in range(150)]
MESSAGES = [{"role": "system", "content": "tool call result kato rimu senlo " * 12},
            {"role": "user", "content": "the vaqu is of zipe and dramon? " * 6}]


def test_local_cluster_ready_within_two_minutes(pd_cluster):
    print(f"local_cluster.py READY after {pd_cluster.ready_s:.0f}s")
    assert pd_cluster.ready_s < 120.0, f"READY after {pd_cluster.ready_s:.0f}s"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_through_proxy_equals_baseline(pd_cluster, stream):
    d_url = pd_cluster.decode[0]
    bytes_before = metric_sum(d_url, "vllm:nixl_bytes_transferred_sum")
    body = completion_body(pd_cluster.model, PROMPT_IDS, max_tokens=24, stream=stream)
    got = post(pd_cluster.proxy, "/v1/completions", body)
    base = post(pd_cluster.colocated, "/v1/completions", dict(body, stream=False))
    assert_same(got, base, f"completions stream={stream}")
    assert got.headers.get("x-sessionkv-route") == "disaggregated"
    assert metric_sum(d_url, "vllm:nixl_bytes_transferred_sum") > bytes_before
    assert metric_sum(d_url, "vllm:nixl_num_failed_transfers_total") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_proxy_equals_baseline(pd_cluster, stream):
    d_url = pd_cluster.decode[0]
    bytes_before = metric_sum(d_url, "vllm:nixl_bytes_transferred_sum")
    body = chat_body(pd_cluster.model, MESSAGES, max_tokens=24, stream=stream)
    got = post(pd_cluster.proxy, "/v1/chat/completions", body)
    base = post(pd_cluster.colocated, "/v1/chat/completions", dict(body, stream=False))
    assert_same(got, base, f"chat stream={stream}")
    assert metric_sum(d_url, "vllm:nixl_bytes_transferred_sum") > bytes_before


def test_negative_control_perturbed_prefill_is_detected(pd_cluster):
    """P runs a model whose k/v projections are scaled by -3.  D decodes on the KV
    it pulls, so its output must differ from the baseline: proof that the
    comparison can fail and that D really uses transferred KV."""
    p_url = pd_cluster.extras["perturbed_prefill"]
    d_url = pd_cluster.decode[0]
    # A NIXL handshake with the freshly started P can time out on a loaded 2-core
    # machine; D then recomputes (the failure policy), which proves nothing here.
    # Only an attempt whose bytes really crossed counts.
    for attempt in range(3):
        prompt = [(11 * i + 5 + attempt) % 900 + 20 for i in range(140)]  # not cached on D
        p_out = post(p_url, "/v1/completions",
                     completion_body(pd_cluster.model, prompt, max_tokens=1,
                                     kv_transfer_params=fresh_prefill_params()))
        params = p_out.raw["kv_transfer_params"]
        bytes_before = metric_sum(d_url, "vllm:nixl_bytes_transferred_sum")
        got = post(d_url, "/v1/completions",
                   completion_body(pd_cluster.model, prompt, max_tokens=24,
                                   kv_transfer_params=params))
        if metric_sum(d_url, "vllm:nixl_bytes_transferred_sum") > bytes_before:
            break
    else:
        pytest.fail("no NIXL transfer from the perturbed P in 3 attempts")
    base = post(pd_cluster.colocated, "/v1/completions",
                completion_body(pd_cluster.model, prompt, max_tokens=24))
    result = compare(got, base)
    assert not result.equal, "D's output ignored the perturbed KV it was handed"
    acct = got.raw["kv_transfer_params"]["sessionkv"]["accounting"]
    assert acct["pulled_from_peer_tokens"] > 0


def test_idle_cluster_uses_under_20_percent_of_a_core(pd_cluster):
    """All processes local_cluster.py started (P, D, Redis, proxy), idle for 10 s.

    Measured with no session lease held: while D holds one, vLLM 0.32's engine core
    steps empty batches (README, Limits)."""
    time.sleep(3.0)  # let in-flight work from earlier tests drain
    procs = []
    for pid in pd_cluster.descendants + [pd_cluster.launcher.pid]:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for p in list(procs):
        try:
            procs.extend(p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    unique = {p.pid: p for p in procs}.values()

    def cpu_seconds() -> float:
        total = 0.0
        for p in unique:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    window_s = 10.0
    before = cpu_seconds()
    time.sleep(window_s)
    used = (cpu_seconds() - before) / window_s
    print(f"idle 1P+1D cluster: {used * 100:.1f}% of one core over {window_s:.0f}s "
          f"({len(unique)} processes)")
    assert used < 0.20, f"idle cluster uses {used * 100:.1f}% of one core"
