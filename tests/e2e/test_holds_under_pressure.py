"""D's session holds under KV pressure, through the proxy on real engines (issue 47).

One cluster for both cases: 1P + 1D, D with 64 device blocks, its holds capped at
half (32 blocks, ``session_hold_max_kv_fraction``'s default), retention by value and
a 96-block host tier; the co-located server is the session's.  Each case starts from
engines with no holds and empty prefix caches, and reads counters as growth.

**Retention by value** (item 2).  Session A's first turn comes first, with
``X-Session-Hold-S: 600``; session B's comes after it, with no hint; then session C's
larger turn puts D's holds over the cap, so one of A's and B's holds must end.  A is
the older: the age rule (``retention: "age"``, the rule before) ends A's; by value
B's ends, demoted to the host tier first, and its handle is withdrawn.  Then A's next
turn attaches A's handle and P pulls from it what it does not cache itself, and B's
next turn finds its handle withdrawn; both answers equal the co-located server's.

**Holds make room** for a request D cannot otherwise admit.  Three sessions' first
turns, each hinted to be held for 600 s, leave 30 blocks held: under the cap, so none
ends by it.  Then a plain request of 1,250 tokens (40 blocks) goes straight to D:
with 34 blocks free it fits only if holds end.  Before, it waited for the holds'
leases (600 s) with D running nothing (found by the chat_pressure benchmark: a turn
waited 200 s on a small D).  Now the holds in its way end (``kv_pressure``, least
valuable first, demoted to the host tier) and it is answered as the co-located
server answers it; no lease ran out.
"""

from __future__ import annotations

import json

import pytest
import requests

from cluster import TINY_KV_BYTES_PER_TOKEN, small_kv_cluster
from helpers import assert_same, completion_body, metric_sum, post, token_ids, wait_until
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
    with small_kv_cluster(tiny_model, tmp_path_factory.mktemp("holds-pressure-logs"),
                          BLOCK, DEVICE_BLOCKS, sessionkv, colocated_url) as c:
        yield c


def _clean(c: LocalCluster) -> None:
    """No holds on D and empty prefix caches, whatever the case before left."""
    urls = (c.prefill[0].url, c.decode[0].url)
    for url in urls:   # reset_external: D's holds end (reason "reset")
        requests.post(url + "/reset_prefix_cache", params={"reset_external": "true"},
                      timeout=30)
    # vLLM answers {"success": false} while a block is in use and then keeps every
    # cached block: only {"success": true} is a reset.
    wait_until(lambda: _d(c, "sessionkv_session_holds") == 0
               and all(requests.post(u + "/reset_prefix_cache", timeout=30).json()
                       == {"success": True} for u in urls),
               60, "D's holds ended and both prefix caches reset")


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
    _clean(c)
    hinted = _d(c, "sessionkv_session_hold_leases_total", source="hint")
    default = _d(c, "sessionkv_session_hold_leases_total", source="default")
    demoted = _d(c, "sessionkv_session_hold_ends_total", reason="kv_pressure", tier="host")
    withdrawn = _d(c, "sessionkv_handles_withdrawn_total", reason="kv_pressure")
    a1 = _turn(c, _ids(1, 300), "ret-a", hint="600")    # oldest, hinted: 10 blocks held
    b1 = _turn(c, _ids(2, 300), "ret-b")                # younger, no hint: 10 blocks
    wait_until(lambda: _d(c, "sessionkv_session_hold_leases_total", source="hint")
               >= hinted + 1, 30, "D to lease A's hold from its hint")
    assert _d(c, "sessionkv_session_hold_leases_total", source="default") >= default + 1
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
              tier="host") == demoted + 1
    assert _d(c, "sessionkv_handles_withdrawn_total", reason="kv_pressure") == withdrawn + 1

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


def test_holds_under_the_cap_end_for_a_request_that_needs_their_blocks(cluster):
    c = cluster
    _clean(c)
    hinted = _d(c, "sessionkv_session_hold_leases_total", source="hint")
    pressure = _d(c, "sessionkv_session_holds_released_total", reason="kv_pressure")
    ended = _d(c, "sessionkv_session_hold_ends_total", reason="kv_pressure")
    lease_ended = _d(c, "sessionkv_session_hold_ends_total", reason="lease_ended")
    for seed in (1, 2, 3):   # 300 prompt + 16 answer tokens: 10 blocks held each
        body = completion_body(c.spec.model, token_ids(seed, 300), max_tokens=16)
        got = post(c.proxy_url, COMPLETIONS, body,
                   headers={"X-Session-ID": f"room-{seed}", "X-Session-Hold-S": "600"})
        assert_same(got, post(c.colocated.url, COMPLETIONS, body), f"session {seed}")
    wait_until(lambda: _d(c, "sessionkv_session_hold_leases_total", source="hint")
               >= hinted + 3, 30, "D to lease the three holds from their hints")
    assert _d(c, "sessionkv_session_hold_leases_total", source="hint") == hinted + 3
    assert _d(c, "sessionkv_session_holds_released_total", reason="kv_pressure") == pressure

    big = completion_body(c.spec.model, token_ids(9, 1250), max_tokens=8)
    got = post(c.decode[0].url, COMPLETIONS, big, timeout=120)
    assert_same(got, post(c.colocated.url, COMPLETIONS, big), "the 40-block request")
    wait_until(lambda: _d(c, "sessionkv_session_hold_ends_total", reason="kv_pressure")
               >= ended + 1, 30, "D to count the holds it ended to admit the request")
    assert _d(c, "sessionkv_session_hold_ends_total", reason="lease_ended") == lease_ended
