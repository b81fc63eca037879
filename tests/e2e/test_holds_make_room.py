"""Session holds make room for a request D cannot otherwise admit (issue 47).

1P + 1D, D with 64 device blocks and its holds capped at half (32 blocks).  Three
sessions' first turns, each hinted to be held for 600 s (``X-Session-Hold-S``), leave
30 blocks held: under the cap, so none ends by it.  Then a plain request of 1,250
tokens (40 blocks) goes straight to D: with 34 blocks free it fits only if holds end.
Before, it waited for the holds' leases (600 s) with D running nothing (found by the
chat_pressure benchmark: a turn waited 200 s on a small D).  Now the holds in its way
end (``kv_pressure``, least valuable first, demoted to the host tier) and it is
answered as the co-located server answers it; no lease ran out.
"""

from __future__ import annotations

import pytest

from cluster import small_kv_cluster
from helpers import assert_same, completion_body, metric_sum, post, token_ids, wait_until
from vllm_sessionkv.dev.launch import LocalCluster

pytestmark = pytest.mark.cluster

BLOCK = 32
DEVICE_BLOCKS = 64
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def cluster(tiny_model, colocated_url, tmp_path_factory):
    sessionkv = {"retention": "value", "session_hold_max_kv_fraction": 0.5}
    with small_kv_cluster(tiny_model, tmp_path_factory.mktemp("make-room-logs"), BLOCK,
                          DEVICE_BLOCKS, sessionkv, colocated_url) as c:
        yield c


def _d(c: LocalCluster, name: str, **labels: str) -> float:
    return metric_sum(c.decode[0].url, name, **labels)


def test_holds_under_the_cap_end_for_a_request_that_needs_their_blocks(cluster):
    c = cluster
    for seed in (1, 2, 3):   # 300 prompt + 16 answer tokens: 10 blocks held each
        body = completion_body(c.spec.model, token_ids(seed, 300), max_tokens=16)
        got = post(c.proxy_url, COMPLETIONS, body,
                   headers={"X-Session-ID": f"room-{seed}", "X-Session-Hold-S": "600"})
        assert_same(got, post(c.colocated.url, COMPLETIONS, body), f"session {seed}")
    assert _d(c, "sessionkv_session_hold_leases_total", source="hint") == 3
    assert _d(c, "sessionkv_session_holds_released_total", reason="kv_pressure") == 0

    big = completion_body(c.spec.model, token_ids(9, 1250), max_tokens=8)
    got = post(c.decode[0].url, COMPLETIONS, big, timeout=120)
    assert_same(got, post(c.colocated.url, COMPLETIONS, big), "the 40-block request")
    wait_until(lambda: _d(c, "sessionkv_session_hold_ends_total", reason="kv_pressure") >= 1,
               30, "D to count the holds it ended to admit the request")
    assert _d(c, "sessionkv_session_hold_ends_total", reason="lease_ended") == 0
