"""The host tier in the P/D path, through the proxy: a session's KV outlives its hold.

1P + 2D with a deliberately small device KV (64 blocks each) and a host tier on each
engine.  A session turn's blocks are written through to D's host tier when it ends;
here its hold on D then ends (its lease runs out, or holds pass the KV cap), other
traffic evicts its device copy, and the next turn still reuses it:

* a small increment goes to the D that holds it on host, decode only: D restores the
  prefix from host (``pulled_from_host`` tokens) and computes the rest;
* a large increment is disaggregated: the proxy first has D restore the prefix as a
  one-token session turn, and P pulls it by that turn's handle.

Every answer equals the co-located server in token ids and top-5 logprobs; a
perturbed prompt against the same baseline shows the comparison can fail.
"""

from __future__ import annotations

import json

import pytest

from cluster import (
    TEST_DTYPE,
    TEST_ENGINE_ARGS,
    TEST_KV_CACHE_GB,
    TINY_KV_BYTES_PER_TOKEN,
    free_port_block,
    with_baseline,
)
from helpers import (
    assert_same,
    compare,
    completion_body,
    metric_sum,
    post,
    wait_until,
)
from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster

pytestmark = pytest.mark.cluster

BLOCK = 32
DEVICE_BLOCKS = 64
HOST_BLOCKS = 96
BLOCK_BYTES = BLOCK * TINY_KV_BYTES_PER_TOKEN
# Above the handle expiry margins (the engines' 6 s here, the proxy's default 10 s):
# a restored turn's handle must be usable by P.
LEASE_S = 15.0
COMPLETIONS = "/v1/completions"


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 990 + 20 for i in range(n)]


@pytest.fixture(scope="module")
def host_pd(tiny_model, colocated_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("host-pd-logs")
    cluster = LocalCluster(ClusterSpec(
        model=tiny_model, prefill=1, decode=2, colocated=False, redis=True,
        base_port=free_port_block(40), block_size=BLOCK, max_model_len=2000,
        kv_cache_space_gb=TEST_KV_CACHE_GB, num_gpu_blocks_override=DEVICE_BLOCKS,
        dtype=TEST_DTYPE, engine_extra_args=list(TEST_ENGINE_ARGS), log_dir=log_dir,
        sessionkv={"host_tier_bytes": HOST_BLOCKS * BLOCK_BYTES, "session_lease_s": LEASE_S,
                   "expiry_margin_s": 6.0, "superseded_hold_grace_s": 1.0,
                   # Pull whenever verified KV exists: which source serves the blocks
                   # is under test here, not the tiny model's pull price.
                   "cost": {"per_transfer_s": 0.0, "recompute_s_per_token": 1.0}}))
    with cluster:   # __enter__ starts it
        yield with_baseline(cluster, colocated_url)


def _session_turn(c: LocalCluster, prompt: list[int], session: str, max_tokens: int = 16):
    body = completion_body(c.spec.model, prompt, max_tokens=max_tokens)
    got = post(c.proxy_url, COMPLETIONS, dict(body, session_id=session))
    base = post(c.colocated.url, COMPLETIONS, body)
    assert_same(got, base, f"{session}: {len(prompt)}-token prompt")
    return got


def _acct(got, name: str) -> dict:
    raw = got.headers.get(name)
    return json.loads(raw) if raw else {}


def _host_tokens(url: str) -> float:
    return metric_sum(url, "sessionkv_prompt_tokens_total", source="pulled_from_host")


def _released(url: str, reason: str) -> float:
    return metric_sum(url, "sessionkv_session_holds_released_total", reason=reason)


def _evict(c: LocalCluster, url: str, seeds: tuple[int, ...]) -> None:
    """Plain requests (no session: nothing held, nothing written to host) that take
    over the engine's free device blocks, evicting what was cached there."""
    for seed in seeds:
        post(url, COMPLETIONS, completion_body(c.spec.model, _ids(seed, 1200), max_tokens=2))


def test_after_its_lease_a_session_returns_to_the_host_tier_holding_it(host_pd):
    """Must-show 1 (lease) and 2: the next turn goes decode only to the D holding the
    session on its host tier, the route reason names the host tier, and D restores it."""
    c = host_pd
    prompt = _ids(1, 700)
    first = _session_turn(c, prompt, "host-lease", max_tokens=16)
    holder = first.headers["x-sessionkv-decode-engine"]
    other = next(d.url for d in c.decode if d.url != holder)
    ended = _released(holder, "lease_ended")
    wait_until(lambda: _released(holder, "lease_ended") > ended, 60, "the lease to end")
    _evict(c, holder, (901, 902))
    # The index hears D's evictions and host stores through KV events: wait for the
    # proxy to see the session's blocks on D's host tier only.
    restored = _host_tokens(holder)

    prompt2 = prompt + first.token_ids + _ids(2, 40)
    second = _session_turn(c, prompt2, "host-lease", max_tokens=16)
    h = second.headers
    print(f"turn 2: route {h.get('x-sessionkv-route')} to {h.get('x-sessionkv-decode-engine')}"
          f" ({h.get('x-sessionkv-route-reason')}); D {_acct(second, 'x-sessionkv-decode')}")
    assert h["x-sessionkv-decode-engine"] == holder != other
    assert h["x-sessionkv-route"] == "decode_only"
    assert "host tier" in h["x-sessionkv-route-reason"]
    acct = _acct(second, "x-sessionkv-decode")
    assert acct.get("pulled_from_host_tokens", 0) >= 20 * BLOCK, acct
    assert acct.get("local_hit_tokens", 0) < acct["pulled_from_host_tokens"], acct
    assert _host_tokens(holder) > restored
    assert metric_sum(c.proxy_url, "sessionkv_proxy_routing_decisions_total", reason="host_tier") >= 1

    # Negative control: the same comparison fails against a perturbed prompt's answer.
    perturbed = list(prompt2)
    perturbed[len(prompt) // 2] = perturbed[len(prompt) // 2] % 990 + 21
    other_answer = post(c.colocated.url, COMPLETIONS,
                        completion_body(c.spec.model, perturbed, max_tokens=16))
    assert not compare(second, other_answer).equal


def test_a_large_increment_is_restored_on_decode_and_pulled_by_prefill(host_pd):
    """Disaggregated: D restores the session's prefix from host, P pulls it."""
    c = host_pd
    prompt = _ids(3, 600)
    first = _session_turn(c, prompt, "host-pull", max_tokens=16)
    holder = first.headers["x-sessionkv-decode-engine"]
    ended = _released(holder, "lease_ended")
    wait_until(lambda: _released(holder, "lease_ended") > ended, 60, "the lease to end")
    _evict(c, holder, (903, 904))
    _evict(c, c.prefill[0].url, (905, 906))   # P's own copy goes too
    restores = metric_sum(c.proxy_url, "sessionkv_proxy_host_tier_restores_total",
                          outcome="handle")
    restored = _host_tokens(holder)

    prompt2 = prompt + first.token_ids + _ids(4, 400)   # over the decode-only threshold
    second = _session_turn(c, prompt2, "host-pull", max_tokens=16)
    h = second.headers
    p_acct = _acct(second, "x-sessionkv-prefill")
    print(f"turn 2: {h.get('x-sessionkv-route')} ({h.get('x-sessionkv-route-reason')}); "
          f"P {p_acct}; D {_acct(second, 'x-sessionkv-decode')}")
    assert h["x-sessionkv-route"] == "disaggregated"
    assert "host tier" in h["x-sessionkv-route-reason"]
    assert metric_sum(c.proxy_url, "sessionkv_proxy_host_tier_restores_total",
                      outcome="handle") == restores + 1
    assert _host_tokens(holder) >= restored + 18 * BLOCK
    assert p_acct.get("pulled_from_peer_tokens", 0) >= 18 * BLOCK, p_acct


def test_holds_over_the_kv_cap_end_early_and_the_session_returns_from_host(host_pd):
    """Must-show 1 (device eviction, no lease end): holds may pin half of D's KV; a
    newer session's hold ends the older one's early (``kv_pressure``), its device copy
    is evicted, and its next turn is restored from host."""
    c = host_pd
    prompt = _ids(5, 700)
    first = _session_turn(c, prompt, "host-pressure", max_tokens=16)
    holder = first.headers["x-sessionkv-decode-engine"]
    pressure = _released(holder, "kv_pressure")
    # A bigger session turn on the same D: the two holds pin more than 32 blocks.
    big = completion_body(c.spec.model, _ids(6, 1100), max_tokens=4,
                          kv_transfer_params={"sessionkv": {"session_id": "host-big"}},
                          session_id="host-big")
    post(holder, COMPLETIONS, big)
    wait_until(lambda: _released(holder, "kv_pressure") > pressure, 30,
               "the older hold to end by kv_pressure")
    _evict(c, holder, (907,))
    restored = _host_tokens(holder)

    prompt2 = prompt + first.token_ids + _ids(7, 40)
    second = _session_turn(c, prompt2, "host-pressure", max_tokens=16)
    h = second.headers
    acct = _acct(second, "x-sessionkv-decode")
    print(f"turn 2: {h.get('x-sessionkv-route')} ({h.get('x-sessionkv-route-reason')}); "
          f"D {acct}")
    assert h["x-sessionkv-decode-engine"] == holder
    assert acct.get("pulled_from_host_tokens", 0) > 0, acct
    assert _host_tokens(holder) > restored
