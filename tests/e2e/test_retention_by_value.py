"""Retention by value (issue 47 item 2), through the proxy on real engines.

1P + 1D with a small device KV (64 blocks, holds capped at half) and a host tier.
Session A's first turn comes first, with ``X-Session-Hold-S: 600``; session B's comes
after it, with no hint; then session C's larger turn puts D's holds over the cap, so
one of A's and B's holds must end.  A is the older: the age rule (``retention:
"age"``, the rule before) ends A's; by value B's ends, demoted to the host tier first,
and its handle is withdrawn.  Then A's next turn attaches A's handle and P pulls from it
what it does not cache itself, and B's next turn finds its handle withdrawn; both answers equal the
co-located server's.
"""

from __future__ import annotations

import json

import pytest

from cluster import TINY_KV_BYTES_PER_TOKEN, small_kv_cluster
from helpers import assert_same, completion_body, metric_sum, post, wait_until
from vllm_sessionkv.dev.launch import LocalCluster

pytestmark = pytest.mark.cluster

BLOCK = 32
DEVICE_BLOCKS = 64
HOST_BLOCKS = 96
BLOCK_BYTES = BLOCK * TINY_KV_BYTES_PER_TOKEN
COMPLETIONS = "/v1/completions"


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 990 + 20 for i in range(n)]


@pytest.fixture(scope="module")
def cluster(tiny_model, colocated_url, tmp_path_factory):
    sessionkv = {"host_tier_bytes": HOST_BLOCKS * BLOCK_BYTES, "retention": "value",
                 # Pull whenever verified KV exists: which hold survives is under
                 # test, not the tiny model's pull price.
                 "cost": {"per_transfer_s": 0.0, "recompute_s_per_token": 1.0}}
    with small_kv_cluster(tiny_model, tmp_path_factory.mktemp("retention-logs"), BLOCK,
                          DEVICE_BLOCKS, sessionkv, colocated_url) as c:
        yield c


def _turn(c: LocalCluster, prompt: list[int], session: str, hint: str | None = None):
    body = completion_body(c.spec.model, prompt, max_tokens=16)
    headers = {"X-Session-ID": session}
    if hint is not None:
        headers["X-Session-Hold-S"] = hint
    got = post(c.proxy_url, COMPLETIONS, body, headers=headers)
    assert_same(got, post(c.colocated.url, COMPLETIONS, body), f"{session}: turn")
    return got


def _d(c: LocalCluster, name: str, **labels: str) -> float:
    return metric_sum(c.decode[0].url, name, **labels)


def test_the_hinted_older_session_keeps_its_hold_the_younger_is_demoted(cluster):
    c = cluster
    a1 = _turn(c, _ids(1, 300), "ret-a", hint="600")    # oldest, hinted: 10 blocks held
    b1 = _turn(c, _ids(2, 300), "ret-b")                # younger, no hint: 10 blocks
    wait_until(lambda: _d(c, "sessionkv_session_hold_leases_total", source="hint") >= 1,
               30, "D to lease A's hold from its hint")
    assert _d(c, "sessionkv_session_hold_leases_total", source="default") >= 1
    pressure = _d(c, "sessionkv_session_holds_released_total", reason="kv_pressure")
    _turn(c, _ids(3, 520), "ret-c")                     # 17 blocks: 37 > 32 held
    wait_until(lambda: _d(c, "sessionkv_session_holds_released_total",
                          reason="kv_pressure") > pressure, 30,
               "one hold to end by kv_pressure")
    # Exactly one ended, B's (A's is the older: the age rule would have ended it),
    # demoted to the host tier first.
    assert _d(c, "sessionkv_session_holds_released_total", reason="kv_pressure") == \
        pressure + 1
    assert _d(c, "sessionkv_session_hold_ends_total", reason="kv_pressure",
              tier="host") == 1
    assert _d(c, "sessionkv_handles_withdrawn_total", reason="kv_pressure") == 1

    # A's next turn (a large increment: P then D) attaches A's hold and P pulls it.
    a2 = _turn(c, _ids(1, 300) + a1.token_ids + _ids(4, 400), "ret-a", hint="600")
    h = a2.headers
    p_acct = json.loads(h.get("x-sessionkv-prefill") or "{}")
    print(f"A turn 2: {h.get('x-sessionkv-route')} handle={h.get('x-sessionkv-handle')} "
          f"P {p_acct}")
    assert h["x-sessionkv-route"] == "disaggregated", dict(h)
    assert h["x-sessionkv-handle"] == "attached", dict(h)
    # P still caches the prompt it prefilled for A's first turn; the rest of what A's
    # hold has (its answer) P pulls from it.
    pulled = p_acct.get("pulled_from_peer_tokens", 0)
    assert pulled >= 16 and pulled + p_acct.get("local_hit_tokens", 0) >= 300, p_acct

    # B's next turn finds B's handle withdrawn, and is still answered right.
    b2 = _turn(c, _ids(2, 300) + b1.token_ids + _ids(5, 400), "ret-b")
    print(f"B turn 2: {b2.headers.get('x-sessionkv-route')} "
          f"handle={b2.headers.get('x-sessionkv-handle')} "
          f"reason={b2.headers.get('x-sessionkv-route-reason')}")
    assert b2.headers["x-sessionkv-handle"] == "withdrawn", dict(b2.headers)
