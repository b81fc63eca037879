"""The disk tier beneath the host tier, through the proxy (issue 47 must-show 3).

1P + 1D behind the proxy, D with a 64-block device KV, a 24-block host tier and a
disk tier.  A session's turn is written through to D's host tier; its lease ends; a
second session's turn fills the host tier, which evicts the first session's blocks to
disk; plain requests evict its device copy.  The proxy's index (Redis) then holds the
session's prefix on D's disk tier only, and its next turn:

* goes decode only to D with a route reason naming the disk tier; D reads the blocks
  from disk into host slots, checked, then restores them (``pulled_from_host``), and
  the answer equals the co-located server in token ids and top-5 logprobs;
* negative control: with every block file corrupted (one byte flipped), D refuses the
  files, recomputes, and still answers as the co-located server (the route, made on
  the index, still names the disk tier: a stale route costs speed, never correctness).

Every wait is on a condition (a metric, the index); nothing sleeps.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from cluster import (
    TEST_DTYPE,
    TEST_ENGINE_ARGS,
    TEST_KV_CACHE_GB,
    TINY_KV_BYTES_PER_TOKEN,
    free_port_block,
    with_baseline,
)
from helpers import assert_same, completion_body, metric_sum, post, wait_until
from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster
from vllm_sessionkv.wire.hashing import request_keys
from vllm_sessionkv.wire.redis_keys import DEFAULT_NAMESPACE

pytestmark = pytest.mark.cluster

BLOCK = 32
DEVICE_BLOCKS = 64
HOST_BLOCKS = 24
DISK_BLOCKS = 400
BLOCK_BYTES = BLOCK * TINY_KV_BYTES_PER_TOKEN
FILE_BYTES = BLOCK_BYTES + 82  # and the disk tier's header with a 32-byte block hash
LEASE_S = 2.0
COMPLETIONS = "/v1/completions"


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 990 + 20 for i in range(n)]


@pytest.fixture(scope="module")
def disk_pd(tiny_model, colocated_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("disk-tier")
    # The router credits a prefix it routed in the last 30 s as on the device
    # (recent.py), which would hide the disk tier for that long: route on the
    # engines' own word (the index) alone.
    proxy_config = root / "proxy.json"
    proxy_config.write_text(json.dumps({"routing": {"recent_routes_ttl_s": 0}}))
    cluster = LocalCluster(ClusterSpec(
        model=tiny_model, prefill=1, decode=1, colocated=False, redis=True,
        base_port=free_port_block(30), block_size=BLOCK, max_model_len=2000,
        kv_cache_space_gb=TEST_KV_CACHE_GB, num_gpu_blocks_override=DEVICE_BLOCKS,
        dtype=TEST_DTYPE, engine_extra_args=list(TEST_ENGINE_ARGS), log_dir=root / "logs",
        proxy_args=["--config", str(proxy_config)],
        sessionkv={"host_tier_bytes": HOST_BLOCKS * BLOCK_BYTES,
                   "disk_tier_bytes": DISK_BLOCKS * FILE_BYTES,
                   "disk_tier_dir": str(root / "disk"),   # one directory per engine
                   "session_lease_s": LEASE_S, "expiry_margin_s": 1.0,
                   # Restore whenever a tier holds verified KV: which tier serves the
                   # blocks is under test, not the tiny model's prices.
                   "cost": {"per_transfer_s": 0.0, "recompute_s_per_token": 1.0}}))
    with cluster:   # __enter__ starts it
        yield with_baseline(cluster, colocated_url), root / "disk" / "decode0" / "rank0"


def _acct(got, name: str) -> dict:
    raw = got.headers.get(name)
    return json.loads(raw) if raw else {}


def _d(c: LocalCluster, name: str, **labels: str) -> float:
    return metric_sum(c.decode[0].url, name, **labels)


def _index_tiers(c: LocalCluster, prompt: list[int], blocks: int) -> dict[str, int]:
    """D's tiers holding the prompt's first ``blocks`` blocks, as the proxy's index
    (Redis) answers its lookup: tier -> leading blocks held."""
    from sessionkv_proxy.index.redis import RedisIndex

    async def lookup():
        index = RedisIndex.from_url(c.redis_url, namespace=DEFAULT_NAMESPACE)
        try:
            return await index.lookup(request_keys(prompt, BLOCK)[:blocks])
        finally:
            await index.close()

    return asyncio.run(lookup()).get(c.decode[0].url, {})


def _session_on_disk_only(c: LocalCluster, session: str, seed: int):
    """Turn 1 of ``session``; then its KV leaves D's device and host tiers for D's
    disk.  Returns (turn 1's answer, the session's full blocks on disk)."""
    prompt = _ids(seed, 700)
    body = completion_body(c.spec.model, prompt, max_tokens=16)
    first = post(c.proxy_url, COMPLETIONS, dict(body, session_id=session))
    assert_same(first, post(c.colocated.url, COMPLETIONS, body), f"{session}: turn 1")
    history = prompt + first.token_ids
    blocks = len(history) // BLOCK
    # Every hold on D ends at its lease (this turn's and any earlier test's: a hold
    # that ended later would re-offload its blocks to host and evict others there).
    wait_until(lambda: _d(c, "sessionkv_session_holds") == 0, 60, "D's holds to end")
    # Another session's turn on D fills its host tier: the first session's blocks are
    # evicted there and spilled to disk.
    filler = completion_body(c.spec.model, _ids(seed + 500, 820), max_tokens=4,
                             kv_transfer_params={"sessionkv": {"session_id": f"{session}-fill"}},
                             session_id=f"{session}-fill")
    post(c.decode[0].url, COMPLETIONS, filler)
    wait_until(lambda: _index_tiers(c, history, blocks).get("STORAGE") == blocks, 60,
               f"the index to see the session's {blocks} blocks spilled to D's disk "
               f"(now {_index_tiers(c, history, blocks)})")
    # Plain requests (nothing held, nothing written to host) evict its device copy.
    for fill_seed in (seed + 900, seed + 901):
        post(c.decode[0].url, COMPLETIONS,
             completion_body(c.spec.model, _ids(fill_seed, 1200), max_tokens=2))
    wait_until(lambda: _index_tiers(c, history, blocks) == {"STORAGE": blocks}, 60,
               f"the proxy's index to hold the session's {blocks} blocks on D's disk only "
               f"(now {_index_tiers(c, history, blocks)})")
    return first, history, blocks


def _turn2(c: LocalCluster, session: str, history: list[int], seed: int):
    prompt2 = history + _ids(seed + 1, 40)
    body = completion_body(c.spec.model, prompt2, max_tokens=16)
    second = post(c.proxy_url, COMPLETIONS, dict(body, session_id=session))
    h = second.headers
    print(f"{session} turn 2: {h.get('x-sessionkv-route')} to "
          f"{h.get('x-sessionkv-decode-engine')} ({h.get('x-sessionkv-route-reason')}); "
          f"D {_acct(second, 'x-sessionkv-decode')}")
    assert_same(second, post(c.colocated.url, COMPLETIONS, body), f"{session}: turn 2")
    return second


def test_a_session_evicted_from_device_and_host_is_restored_from_disk(disk_pd):
    c, _ = disk_pd
    _, history, blocks = _session_on_disk_only(c, "disk-restore", seed=11)
    promoted = _d(c, "sessionkv_disk_promoted_blocks_total")
    decisions = metric_sum(c.proxy_url, "sessionkv_proxy_routing_decisions_total",
                           reason="disk_tier")

    second = _turn2(c, "disk-restore", history, seed=11)
    h = second.headers
    assert h["x-sessionkv-route"] == "decode_only"
    assert f"{blocks} blocks restored from its disk tier" in h["x-sessionkv-route-reason"]
    assert metric_sum(c.proxy_url, "sessionkv_proxy_routing_decisions_total",
                      reason="disk_tier") == decisions + 1
    acct = _acct(second, "x-sessionkv-decode")
    assert acct.get("pulled_from_host_tokens", 0) == blocks * BLOCK, acct
    assert acct.get("local_hit_tokens", 0) == 0, acct
    assert _d(c, "sessionkv_disk_promoted_blocks_total") >= promoted + blocks
    assert _d(c, "sessionkv_disk_refused_blocks_total") == 0


def test_corrupted_block_files_are_refused_and_the_turn_recomputed(disk_pd):
    """Negative control: the same route, every file damaged; D reads none of them."""
    c, disk_dir = disk_pd
    _, history, blocks = _session_on_disk_only(c, "disk-corrupt", seed=21)
    files = sorted(Path(disk_dir).glob("*.kv"))
    assert len(files) >= blocks
    for path in files:
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x20
        path.write_bytes(bytes(data))
    refused = _d(c, "sessionkv_disk_refused_blocks_total")
    promoted = _d(c, "sessionkv_disk_promoted_blocks_total")

    second = _turn2(c, "disk-corrupt", history, seed=21)
    assert "disk tier" in second.headers["x-sessionkv-route-reason"]
    acct = _acct(second, "x-sessionkv-decode")
    assert acct.get("pulled_from_host_tokens", 0) == 0, acct
    assert _d(c, "sessionkv_disk_refused_blocks_total") >= refused + 1
    assert _d(c, "sessionkv_disk_promoted_blocks_total") == promoted
