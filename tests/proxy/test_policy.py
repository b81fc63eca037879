"""The routing policy on plain data: formula terms, tiers, hot spots, affinity, decode-only."""

from __future__ import annotations

import collections
import random

import msgspec
import pytest

from sessionkv_proxy import policy, prices
from sessionkv_proxy.policy import (
    Mode,
    NoWorkerAvailable,
    Role,
    RouteInput,
    RoutingParams,
    SessionView,
    TierOverlap,
    WorkerLoad,
    overlaps_from_match,
    pick,
    route,
    score_decode,
    score_prefill,
)
from vllm_sessionkv.wire.cost import LinkModel, OverlapWeights, RecomputeModel, peer_credit_weight

RECOMPUTE = RecomputeModel(s_per_token=1e-4, s_per_token_per_context_token=1e-9,
                           load_slowdown_per_unit=1.0)
FAST_LINK = LinkModel(bytes_per_s=50e9, per_transfer_s=1e-3)  # RDMA-class
SLOW_LINK = LinkModel(bytes_per_s=1e8, per_transfer_s=5e-3)  # ~0.8 Gbit/s TCP
NVME = LinkModel(bytes_per_s=4e9, per_transfer_s=5e-4)  # a fast local NVMe
KV_BYTES_PER_TOKEN = 131072.0  # 128 KiB: an 8B-class model in bf16
BS = 16


def params(**kw) -> RoutingParams:
    kw.setdefault("recompute", RECOMPUTE)
    kw.setdefault("link", FAST_LINK)
    return RoutingParams(**kw)


def P(url: str, **kw) -> WorkerLoad:
    return WorkerLoad(url=url, role=Role.PREFILL, **kw)


def D(url: str, **kw) -> WorkerLoad:
    return WorkerLoad(url=url, role=Role.DECODE, **kw)


def inp(prompt_tokens: int = 160, **kw) -> RouteInput:
    kw.setdefault("block_size", BS)
    kw.setdefault("now_s", 100.0)
    kw.setdefault("kv_bytes_per_token", KV_BYTES_PER_TOKEN)
    return RouteInput(prompt_tokens=prompt_tokens, **kw)


def by_url(terms):
    return {t.url: t for t in terms}


def session(decode_url: str = "d1", expires_at_s: float | None = 1000.0) -> SessionView:
    return SessionView(session_id="s1", last_decode=decode_url, expires_at_s=expires_at_s)


# --------------------------------------------------------------------------- P formula


def test_prefill_terms_equal_hand_computation():
    # 1000 tokens = 63 blocks (62 full + 1 partial).  p2 holds 20 blocks on device and
    # 30 on host (10 beyond device); the session's D holds 50 (20 beyond both).
    i = inp(1000, overlaps={"p2": TierOverlap(20, 30)}, session=session(),
            peer_pullable_blocks=50)
    prm = params(prefill_load_scale=2.0, decode_load_scale=0.5, overlap_credit_decay=1.0)
    workers = [P("p1", active_prefill_blocks=4.0),
               P("p2", active_prefill_blocks=10.0, active_decode_blocks=8.0), D("d1")]
    t = by_url(score_prefill(i, workers, prm))

    # Peer pull of 20 blocks = 320 tokens after 30 local blocks = 480 tokens.
    recompute_s = 320 * 1e-4 + 1e-9 * (320 * 480 + 320 * 319 / 2)
    pull_s = 1e-3 + 320 * KV_BYTES_PER_TOKEN / 50e9
    peer_w = 1 - pull_s / recompute_s
    # Host restore of 10 blocks = 160 tokens after 20 device blocks = 320 tokens, over
    # the default host link (5 GB/s, 0.1 ms a copy).
    host_recompute_s = 160 * 1e-4 + 1e-9 * (160 * 320 + 160 * 159 / 2)
    host_w = 1 - (1e-4 + 160 * KV_BYTES_PER_TOKEN / 5e9) / host_recompute_s
    raw = 1.0 * 20 + host_w * 10 + peer_w * 20
    decay = 1 / (1 + 1.0 * (10 - 4) / 63)
    cost_p2 = 2.0 * max(0.0, 10 + 63 - decay * raw) + 0.5 * 8
    p2 = t["p2"]
    assert (p2.prompt_blocks, p2.device_blocks, p2.host_blocks, p2.peer_blocks) == (63, 20, 10, 20)
    assert p2.peer_weight == pytest.approx(peer_w, rel=1e-12)
    assert p2.raw_credit_blocks == pytest.approx(raw, rel=1e-12)
    assert p2.excess_blocks == 6.0
    assert p2.decay == pytest.approx(decay, rel=1e-12)
    assert p2.credit_blocks == pytest.approx(decay * raw, rel=1e-12)
    assert p2.cost == pytest.approx(cost_p2, rel=1e-12)

    # p1 holds nothing locally: the whole 50-block peer prefix is an increment, and as
    # the least loaded worker it keeps its credit whole.
    recompute1_s = 800 * 1e-4 + 1e-9 * (800 * 799 / 2)
    peer_w1 = 1 - (1e-3 + 800 * KV_BYTES_PER_TOKEN / 50e9) / recompute1_s
    p1 = t["p1"]
    assert (p1.device_blocks, p1.host_blocks, p1.peer_blocks, p1.decay) == (0, 0, 50, 1.0)
    assert p1.cost == pytest.approx(2.0 * (4 + 63 - peer_w1 * 50), rel=1e-12)


def test_partial_block_counts_and_credit_never_makes_cost_negative():
    i = inp(161, overlaps={"p1": TierOverlap(11, 0)})
    (t,) = score_prefill(i, [P("p1")], params(weights=OverlapWeights(device=5.0)))
    assert t.prompt_blocks == 11  # 10 full blocks + 1 token
    assert t.adjusted_prefill_blocks == 0.0 and t.cost == 0.0


def test_device_beats_host_beats_none_at_equal_load():
    i = inp(320, overlaps={"dev": TierOverlap(device_blocks=10),
                           "host": TierOverlap(host_blocks=10)})
    workers = [P(u, active_prefill_blocks=5.0) for u in ("dev", "host", "none")] + [D("d1")]
    t = by_url(score_prefill(i, workers, params()))
    assert t["dev"].cost < t["host"].cost < t["none"].cost
    # The host weight is the share of recompute a restore saves: 10 blocks = 160
    # tokens at 0.1 ms a token against a 5 GB/s copy of 128 KiB a token.
    restore_s = 1e-4 + 160 * KV_BYTES_PER_TOKEN / 5e9
    host_w = 1 - restore_s / (160 * 1e-4 + 1e-9 * 160 * 159 / 2)
    assert t["host"].host_weight == pytest.approx(host_w)
    assert t["dev"].cost == 5 + 20 - 10
    assert t["host"].cost == pytest.approx(5 + 20 - 10 * host_w)
    # Without the model's KV size the configured weight stands (Dynamo's 0.75).
    unknown = by_url(score_prefill(msgspec.structs.replace(i, kv_bytes_per_token=0.0),
                                   workers, params()))
    assert unknown["host"].cost == 5 + 20 - 7.5
    # Large increment, so disaggregated, and P goes to the device hit.
    d = route(i, workers, params(decode_only_max_uncached_tokens=-1), random.Random(0))
    assert d.mode is Mode.DISAGGREGATED and d.prefill_url == "dev"


def test_host_blocks_count_only_beyond_the_device_prefix():
    i = inp(320, overlaps={"p1": TierOverlap(device_blocks=12, host_blocks=8)})
    (t,) = score_prefill(i, [P("p1")], params())
    assert (t.device_blocks, t.host_blocks) == (12, 0)


def test_peer_credit_positive_on_fast_link_long_context_and_zero_on_slow_link():
    i = inp(8000, session=session(), peer_pullable_blocks=480)  # 7680 tokens on D
    workers = [P("p1"), D("d1")]
    (fast,) = score_prefill(i, workers, params(link=FAST_LINK))
    (slow,) = score_prefill(i, workers, params(link=SLOW_LINK))
    assert fast.peer_blocks == slow.peer_blocks == 480
    assert fast.peer_weight > 0.9
    assert slow.peer_weight == 0.0
    assert fast.cost < slow.cost == 500


def test_peer_credit_needs_a_live_healthy_session_holder():
    prm = params()
    expired = inp(8000, session=session(expires_at_s=50.0), peer_pullable_blocks=480)
    (t,) = score_prefill(expired, [P("p1"), D("d1")], prm)
    assert t.peer_blocks == 0 and t.peer_weight == 0.0
    live = inp(8000, session=session(), peer_pullable_blocks=480)
    (t,) = score_prefill(live, [P("p1"), D("d1", healthy=False), D("d2")], prm)
    assert t.peer_blocks == 0
    (t,) = score_prefill(live, [P("p1"), D("d1")], prm)
    assert t.peer_blocks == 480


def test_unknown_kv_size_falls_back_to_the_static_peer_weight():
    i = inp(8000, session=session(), peer_pullable_blocks=480, kv_bytes_per_token=0.0)
    (t,) = score_prefill(i, [P("p1"), D("d1")], params())
    assert t.peer_weight == OverlapWeights().peer


# --------------------------------------------------------------------------- hot spots


def _hotspot_pick(load_blocks: float, decay: float) -> str:
    # "rich" holds the whole 10-block prompt; "idle" holds nothing and has no queue.
    i = inp(160, overlaps={"rich": TierOverlap(device_blocks=10)})
    workers = [P("rich", active_prefill_blocks=load_blocks), P("idle"), D("d1")]
    t = by_url(score_prefill(i, workers, params(overlap_credit_decay=decay)))
    return min(t.values(), key=lambda x: x.cost).url


def test_cache_rich_worker_wins_at_equal_load():
    for load in (0.0, 5.0, 50.0):
        i = inp(160, overlaps={"rich": TierOverlap(device_blocks=10)})
        workers = [P("rich", active_prefill_blocks=load), P("idle", active_prefill_blocks=load)]
        t = by_url(score_prefill(i, workers, params(overlap_credit_decay=4.0)))
        assert t["rich"].decay == 1.0
        assert t["rich"].cost < t["idle"].cost


def test_overloaded_cache_rich_worker_loses_to_idle_beyond_threshold():
    # decay 1: rich costs L + 10 - 10 / (1 + L/10), idle costs 10, so rich loses once
    # L^2/10 + L - 10 > 0, i.e. L > 5 * (sqrt(5) - 1) = 6.18 blocks.
    assert _hotspot_pick(6.0, decay=1.0) == "rich"
    assert _hotspot_pick(7.0, decay=1.0) == "idle"
    # Without decay the credit stays whole and rich keeps the traffic up to L = 10:
    # the hot spot the decay exists to prevent.
    assert _hotspot_pick(7.0, decay=0.0) == "rich"
    assert _hotspot_pick(9.0, decay=0.0) == "rich"
    assert _hotspot_pick(11.0, decay=0.0) == "idle"


# --------------------------------------------------------------------------- health


def test_unhealthy_workers_are_filtered():
    i = inp(320, overlaps={"p_best": TierOverlap(device_blocks=20)})
    workers = [P("p_best", healthy=False), P("p_ok"), D("d_best", healthy=False),
               D("d_ok", active_decode_blocks=100.0)]
    assert [t.url for t in score_prefill(i, workers, params())] == ["p_ok"]
    assert [t.url for t in score_decode(i, workers, params())] == ["d_ok"]
    for seed in range(20):
        d = route(i, workers, params(), random.Random(seed))
        assert (d.prefill_url, d.decode_url) == ("p_ok", "d_ok")


def test_no_healthy_worker_raises_or_falls_back_to_decode_only():
    i = inp(3200)
    with pytest.raises(NoWorkerAvailable) as e:
        score_prefill(i, [P("p1", healthy=False), D("d1")], params())
    assert e.value.role is Role.PREFILL
    with pytest.raises(NoWorkerAvailable) as e:
        route(i, [P("p1"), D("d1", healthy=False)], params(), random.Random(0))
    assert e.value.role is Role.DECODE
    no_p = [P("p1", healthy=False), D("d1")]
    with pytest.raises(NoWorkerAvailable):
        route(i, no_p, params(decode_only_without_prefill=False), random.Random(0))
    d = route(i, no_p, params(), random.Random(0))
    assert d.mode is Mode.DECODE_ONLY and d.prefill_url is None
    # A deployment without a P pool is co-located, not one whose P are down: D
    # serves it whatever decode_only_without_prefill says.
    alone = route(i, [D("d1")], params(decode_only_without_prefill=False),
                  random.Random(0))
    assert (alone.mode, alone.label) == (Mode.DECODE_ONLY, policy.RouteReason.COLOCATED)
    assert "no healthy prefill" in d.reason


# --------------------------------------------------------------------------- D affinity


def test_decode_session_affinity_beats_lower_load_worth_less_than_the_reuse():
    # d1 holds 50 of the prompt's 200 blocks: moving costs 50 blocks of recompute, so
    # d1 keeps the session while it has at most 2 x 50 blocks more work queued than d2.
    i = inp(3200, session=session("d1"), peer_pullable_blocks=50)
    workers = [P("p1"), D("d1", queued_decode_blocks=130.0, kv_usage=0.5),
               D("d2", queued_decode_blocks=30.0)]
    d = route(i, workers, params(), random.Random(0))
    assert d.decode_url == "d1" and d.reason.startswith("session affinity;")
    assert by_url(d.decode_candidates)["d1"].affinity


def test_decode_session_affinity_yields_when_the_holder_is_busier_than_the_reuse_is_worth():
    # Hot sessions sharing d1: 131 blocks of queued work against d2's 30 is more than
    # 2 x 50 blocks of reuse, so the request goes to d2 (and recomputes there).
    i = inp(3200, session=session("d1"), peer_pullable_blocks=50)
    workers = [P("p1"), D("d1", queued_decode_blocks=131.0, kv_usage=0.5),
               D("d2", queued_decode_blocks=30.0)]
    d = route(i, workers, params(), random.Random(0))
    assert d.decode_url == "d2" and d.reason.startswith("session affinity yielded to load")
    assert d.decode_placed   # a placement by load, counted for recent_placements
    # The least loaded other D is the one taken; a d3 under kv pressure is not.
    more = [*workers, D("d3", kv_usage=0.95)]
    assert route(i, more, params(), random.Random(0)).decode_url == "d2"
    # A session that saves more stays: 150 of 200 blocks on d1 is worth 2 x 150.
    i_long = inp(3200, session=session("d1"), peer_pullable_blocks=150)
    assert route(i_long, workers, params(), random.Random(0)).decode_url == "d1"
    # Weight 0: affinity whatever the load (the old rule).
    far = [P("p1"), D("d1", queued_decode_blocks=4000.0), D("d2")]
    assert route(i, far, params(session_affinity_yield_weight=0),
                 random.Random(0)).decode_url == "d1"


def test_session_affinity_ignores_cached_context_of_running_requests():
    # The yield rule weighs queued work, not in-flight KV: d1 runs requests whose
    # contexts fill 4,000 blocks but which are cache hits with few outputs left
    # (queued 20 blocks); moving the session would recompute 50 blocks.  The rule on
    # whole contexts moved it (and the prefix groups routed after it) for nothing.
    i = inp(3200, session=session("d1"), peer_pullable_blocks=50)
    workers = [P("p1"), D("d1", active_requests=8, active_decode_blocks=4000.0,
                          queued_decode_blocks=20.0), D("d2")]
    assert route(i, workers, params(), random.Random(0)).decode_url == "d1"
    # The same contexts with their work still queued (uncached prompts, long
    # outputs) do move it.
    busy = [P("p1"), D("d1", active_requests=8, active_decode_blocks=4000.0,
                       queued_decode_blocks=400.0), D("d2")]
    assert route(i, busy, params(), random.Random(0)).decode_url == "d2"


def test_session_own_previous_request_still_counted_does_not_move_it():
    # The previous turn (a 2,900-token prompt + 100 output tokens) has sent its last
    # chunk, but its load is still counted on d1 when the next turn (3,200 tokens, d1
    # holds 187 blocks of it) is routed: its queued work (its outputs, 4 blocks) is far
    # below the reuse.
    i = inp(3200, session=session("d1"), peer_pullable_blocks=187)
    workers = [P("p1"), D("d1", active_requests=1, active_decode_blocks=188.0,
                          queued_decode_blocks=4.0), D("d2")]
    assert route(i, workers, params(), random.Random(0)).decode_url == "d1"


def test_decode_affinity_dropped_under_kv_pressure():
    i = inp(3200, session=session("d1"), peer_pullable_blocks=50)
    workers = [P("p1"), D("d1", kv_usage=0.95), D("d2", active_decode_blocks=30.0, kv_usage=0.5),
               D("d3", active_decode_blocks=10.0, kv_usage=0.6)]
    d = route(i, workers, params(), random.Random(0))
    assert d.decode_url == "d3" and "dropped" in d.reason
    # A higher threshold keeps the affinity.
    d = route(i, workers, params(decode_kv_pressure_threshold=0.97), random.Random(0))
    assert d.decode_url == "d1"


def test_decode_affinity_kept_when_every_decode_is_pressured():
    i = inp(3200, session=session("d1"), peer_pullable_blocks=50)
    workers = [P("p1"), D("d1", kv_usage=0.95), D("d2", kv_usage=0.92)]
    d = route(i, workers, params(), random.Random(0))
    assert d.decode_url == "d1" and "kept" in d.reason


def test_expired_session_gives_no_affinity():
    i = inp(3200, session=session("d1", expires_at_s=99.0), peer_pullable_blocks=50)
    workers = [P("p1"), D("d1", active_decode_blocks=400.0), D("d2")]
    d = route(i, workers, params(), random.Random(0))
    assert d.decode_url == "d2" and not any(t.affinity for t in d.decode_candidates)


def test_without_session_decode_prefers_index_overlap_via_cost():
    i = inp(3200, overlaps={"d2": TierOverlap(device_blocks=150)})
    workers = [P("p1"), D("d1"), D("d2", active_decode_blocks=40.0)]
    t = by_url(score_decode(i, workers, params()))
    assert (t["d1"].cost, t["d2"].cost) == (200.0, 40.0 + 50)
    assert route(i, workers, params(), random.Random(0)).decode_url == "d2"


def test_prefix_affinity_holds_under_small_imbalance_and_yields_beyond_the_bound():
    # d2 holds 150 of 200 blocks but runs one request more than d1: the cost alone
    # (one in-flight request of KV > the saved blocks) would move the prefix away.
    i = inp(3200, overlaps={"d2": TierOverlap(device_blocks=150)})
    workers = [P("p1"), D("d1", active_requests=1),
               D("d2", active_requests=2, active_decode_blocks=400.0)]
    d = route(i, workers, params(), random.Random(0))
    assert d.decode_url == "d2" and d.reason.startswith("prefix affinity")
    assert by_url(d.decode_candidates)["d2"].prefix_affinity
    assert route(i, workers, params(decode_affinity_load_bound=0),
                 random.Random(0)).decode_url == "d1"
    # Far over the mean: 9 + 1 > max(1.25 * 5.5, 5.5 + 4).
    busy = [P("p1"), D("d1", active_requests=1),
            D("d2", active_requests=9, active_decode_blocks=400.0)]
    d = route(i, busy, params(), random.Random(0))
    assert d.decode_url == "d1" and not by_url(d.decode_candidates)["d2"].prefix_affinity


def test_prefix_affinity_rides_out_a_low_concurrency_burst():
    # Two workers at low concurrency: the holder of 150 of 200 blocks runs 2
    # requests, the other none.  3 > 1.25 * 1.5 and 3 > 1.5 + 1, but within the
    # slack (1.5 + 4): the burst stays where its prefix is instead of recomputing it.
    i = inp(3200, overlaps={"d2": TierOverlap(device_blocks=150)})
    workers = [P("p1"), D("d1"), D("d2", active_requests=2, active_decode_blocks=400.0)]
    d = route(i, workers, params(), random.Random(0))
    assert d.decode_url == "d2" and d.reason.startswith("prefix affinity")
    assert route(i, workers, params(decode_affinity_load_slack=1),
                 random.Random(0)).decode_url == "d1"
    # At high concurrency the multiplicative bound is the tighter one and the slack
    # changes nothing: 30 + 1 <= 1.25 * 25.5 keeps the prefix, 33 + 1 does not.
    loaded = [P("p1"), D("d1", active_requests=20, active_decode_blocks=4000.0),
              D("d2", active_requests=30, active_decode_blocks=6000.0)]
    assert route(i, loaded, params(), random.Random(0)).decode_url == "d2"
    hot = [P("p1"), D("d1", active_requests=17, active_decode_blocks=3400.0),
           D("d2", active_requests=33, active_decode_blocks=6600.0)]
    for slack in (0, 4):
        d = route(i, hot, params(decode_affinity_load_slack=slack), random.Random(0))
        assert d.decode_url == "d1" and d.reason.startswith("least loaded")


def test_prefix_affinity_needs_a_real_gain_over_the_next_worker():
    # d2 holds only a short shared prefix (10 of 200 blocks): placement by cost.
    i = inp(3200, overlaps={"d2": TierOverlap(device_blocks=10)})
    workers = [P("p1"), D("d1"), D("d2", active_requests=1, active_decode_blocks=300.0)]
    assert route(i, workers, params(), random.Random(0)).decode_url == "d1"
    # Both hold the shared part; d2 also holds the group's own 150 blocks.
    i = inp(3200, overlaps={"d1": TierOverlap(device_blocks=10),
                            "d2": TierOverlap(device_blocks=160)})
    assert route(i, workers, params(), random.Random(0)).decode_url == "d2"
    assert route(i, workers, params(decode_affinity_min_gain=0.9),
                 random.Random(0)).decode_url == "d1"


def test_recent_placements_spread_new_placements_by_count():
    # d1 looks idle (its requests were short cache hits) but took 8 more placements
    # lately than d2: a new prefix goes to d2 despite d2's in-flight KV.
    i = inp(3200)
    workers = [P("p1"), D("d1", recent_placements=10),
               D("d2", active_decode_blocks=300.0, recent_placements=2)]
    t = by_url(score_decode(i, workers, params()))
    assert t["d1"].cost == 200 + 4.0 * 200 * 8 and t["d2"].cost == 300 + 200
    assert route(i, workers, params(), random.Random(0)).decode_url == "d2"
    assert route(i, workers, params(decode_recent_weight=0), random.Random(0)).decode_url == "d1"
    # One placement more outweighs up to four prompts' worth of in-flight KV.
    close = [P("p1"), D("d1", recent_placements=3),
             D("d2", active_decode_blocks=790.0, recent_placements=2)]
    assert route(i, close, params(), random.Random(0)).decode_url == "d2"
    # A session keeps its D whatever the counts.
    s = inp(3200, session=session("d1"), peer_pullable_blocks=50)
    assert route(s, workers, params(), random.Random(0)).decode_url == "d1"


def test_only_requests_placed_by_cost_count_as_placements():
    workers = [P("p1"), D("d1"), D("d2", active_decode_blocks=50.0)]
    # A new prompt: placed by cost, on either path.
    assert route(inp(3200), workers, params(), random.Random(0)).decode_placed
    assert route(inp(64), workers, params(), random.Random(0)).decode_placed   # decode only
    # Following its session or its prefix: not a placement.
    s = inp(3200, session=session("d2"), peer_pullable_blocks=50)
    assert not route(s, workers, params(), random.Random(0)).decode_placed
    held = inp(3200, overlaps={"d2": TierOverlap(device_blocks=150)})
    d = route(held, workers, params(), random.Random(0))
    assert d.decode_url == "d2" and d.reason.startswith("prefix affinity")
    assert not d.decode_placed
    # A session dropped for KV pressure is placed anew elsewhere.
    pressed = [P("p1"), D("d1"), D("d2", kv_usage=0.95)]
    d = route(s, pressed, params(), random.Random(0))
    assert d.decode_url == "d1" and d.decode_placed
    # Nothing goes to D for a prefill-only request.
    assert not route(inp(3200, max_output_tokens=1), workers, params(),
                     random.Random(0)).decode_placed


def test_recent_placements_surcharge_only_the_blocks_a_worker_must_compute():
    # d2 holds 170 of the 200 blocks and took one placement more than d1 lately, at
    # equal in-flight load.  The surcharge applies to d2's 30 new blocks, not to the
    # 200-block prompt, so the prefix keeps the request even where the cost decides
    # (prefix affinity off, as after the load bound released it).
    i = inp(3200, overlaps={"d2": TierOverlap(device_blocks=170)})
    workers = [P("p1"), D("d1", recent_placements=2), D("d2", recent_placements=3)]
    no_affinity = params(decode_affinity_load_bound=0)
    t = by_url(score_decode(i, workers, no_affinity))
    assert t["d1"].cost == 200 and t["d2"].cost == 30 * (1 + 4.0 * 1)
    assert route(i, workers, no_affinity, random.Random(0)).decode_url == "d2"
    # A larger excess still moves it: 30 * (1 + 4 * 2) > 200.
    skewed = [P("p1"), D("d1", recent_placements=2), D("d2", recent_placements=4)]
    assert route(i, skewed, no_affinity, random.Random(0)).decode_url == "d1"


def test_prefix_affinity_needs_a_unique_longest_holder():
    i = inp(3200, overlaps={"d1": TierOverlap(device_blocks=150),
                            "d2": TierOverlap(device_blocks=150)})
    workers = [P("p1"), D("d1", active_decode_blocks=50.0), D("d2")]
    d = route(i, workers, params(), random.Random(0))
    assert d.decode_url == "d2" and d.reason.startswith("least loaded")


# --------------------------------------------------------------------------- decode-only


def test_decode_only_for_small_uncached_increment():
    # D holds 60 of 63 blocks (960 tokens): 40 uncached tokens <= 256.
    i = inp(1000, session=session("d1"), peer_pullable_blocks=60)
    d = route(i, [P("p1"), D("d1"), D("d2")], params(), random.Random(0))
    assert d.mode is Mode.DECODE_ONLY and d.prefill_url is None and d.decode_url == "d1"
    assert d.uncached_tokens == 40 and d.prefill_candidates == ()


def test_decode_only_uses_index_overlap_when_no_session():
    i = inp(1000, overlaps={"d1": TierOverlap(device_blocks=55)})
    d = route(i, [P("p1"), D("d1")], params(), random.Random(0))
    assert d.mode is Mode.DECODE_ONLY and d.uncached_tokens == 1000 - 55 * BS


@pytest.mark.parametrize("d1, pulled_blocks, why", [
    (D("d1"), 10, "increment too large"),  # 840 uncached tokens
    (D("d1", kv_usage=0.85), 60, "busy"),  # over 0.8 yet under pressure 0.9
    (D("d1", active_requests=32), 60, "busy"),
])
def test_disaggregated_when_increment_large_or_decode_loaded(d1, pulled_blocks, why):
    i = inp(1000, session=session("d1"), peer_pullable_blocks=pulled_blocks)
    d = route(i, [P("p1"), d1, D("d2", kv_usage=0.85)], params(), random.Random(0))
    assert d.mode is Mode.DISAGGREGATED and d.prefill_url == "p1" and d.decode_url == "d1"
    assert why in d.reason


def test_decode_only_threshold_is_inclusive_and_can_be_disabled():
    i = inp(1000, session=session("d1"), peer_pullable_blocks=60)  # 40 uncached
    workers = [P("p1"), D("d1")]
    prm = params(decode_only_max_uncached_tokens=40)
    assert route(i, workers, prm, random.Random(0)).mode is Mode.DECODE_ONLY
    prm = params(decode_only_max_uncached_tokens=39)
    assert route(i, workers, prm, random.Random(0)).mode is Mode.DISAGGREGATED
    full = inp(960, session=session("d1"), peer_pullable_blocks=60)  # nothing uncached
    prm = params(decode_only_max_uncached_tokens=-1)
    assert route(full, workers, prm, random.Random(0)).mode is Mode.DISAGGREGATED


# --------------------------------------------------------------------------- load-aware


def _queued_turn() -> RouteInput:
    # 1000 tokens = 63 blocks; the session's D holds 40, so 23 blocks (360 tokens) are
    # uncached there: over the static bound (256), a P -> D turn on an idle P.
    return inp(1000, session=session("d1"), peer_pullable_blocks=40)


def test_idle_prefill_keeps_the_static_decision():
    i = _queued_turn()
    workers = [P("p1"), D("d1", queued_prefill_blocks=5.0)]
    on = route(i, workers, params(), random.Random(0))
    off = route(i, workers, params(decode_only_prefill_queued_max_tokens=0), random.Random(0))
    assert on.mode is Mode.DISAGGREGATED and on.label.value == "increment_too_large"
    assert (on.mode, on.label, on.reason, on.prefill_url) == \
        (off.mode, off.label, off.reason, off.prefill_url)
    # What P computes: the prompt less its credit (the 40 pulled blocks at their price).
    chosen = by_url(on.prefill_candidates)["p1"]
    assert on.prefill_work_blocks == pytest.approx(63 - chosen.raw_credit_blocks)
    assert 23 < on.prefill_work_blocks < 26   # the pull is not free


def test_turn_goes_to_decode_alone_behind_a_prefill_queue():
    i = _queued_turn()
    d = route(i, [P("p1", queued_prefill_blocks=30.0), D("d1", queued_prefill_blocks=5.0)],
              params(), random.Random(0))
    assert d.mode is Mode.DECODE_ONLY and d.prefill_url is None and d.decode_url == "d1"
    assert d.label.value == "prefill_queued"
    assert "P's queue 30.0 + 24.7" in d.reason and "D's queue 5.0 + 23.0 = 28.0" in d.reason
    assert d.uncached_tokens == 1000 - 40 * BS


@pytest.mark.parametrize("p1, d1, prm", [
    # D's own queue is longer: through P is sooner (30 + 23.x < 40 + 23).
    (P("p1", queued_prefill_blocks=30.0), D("d1", queued_prefill_blocks=40.0), {}),
    # D's queued prefill with this turn's (105 + 23 blocks = 2048 tokens) at the bound
    # is allowed, one block more is not: D's running decodes would be starved.
    (P("p1", queued_prefill_blocks=500.0), D("d1", queued_prefill_blocks=106.0), {}),
    # D has no room.
    (P("p1", queued_prefill_blocks=30.0), D("d1", kv_usage=0.85), {}),
    (P("p1", queued_prefill_blocks=30.0), D("d1", active_requests=32), {}),
    # The rule is off, or every turn is to be disaggregated.
    (P("p1", queued_prefill_blocks=30.0), D("d1"),
     {"decode_only_prefill_queued_max_tokens": 0}),
    (P("p1", queued_prefill_blocks=30.0), D("d1"), {"decode_only_max_uncached_tokens": -1}),
])
def test_prefill_queue_rule_keeps_p_when_it_must(p1, d1, prm):
    d = route(_queued_turn(), [p1, d1], params(**prm), random.Random(0))
    assert d.mode is Mode.DISAGGREGATED and d.label.value == "increment_too_large"


def test_prefill_queue_bound_is_inclusive():
    workers = [P("p1", queued_prefill_blocks=500.0), D("d1", queued_prefill_blocks=105.0)]
    d = route(_queued_turn(), workers, params(), random.Random(0))
    assert d.mode is Mode.DECODE_ONLY and "(within 2048 tokens)" in d.reason
    d = route(_queued_turn(), workers,
              params(decode_only_prefill_queued_max_tokens=2047), random.Random(0))
    assert d.mode is Mode.DISAGGREGATED


def test_prefill_queue_bound_is_validated():
    with pytest.raises(ValueError, match="decode_only_prefill_queued_max_tokens"):
        params(decode_only_prefill_queued_max_tokens=-1)


# --------------------------------------------------------------------------- held KV


# D at 95% KV usage, 40 points of it blocks only session holds keep (D ends them for a
# request it cannot admit): 55% net.  The control is the same D without the engine's
# gauge (stock vLLM, an older connector): kv_reclaimable 0, vLLM's usage as it is.
HELD = {"kv_usage": 0.95, "kv_reclaimable": 0.40}
UNREPORTED = {"kv_usage": 0.95}


def test_net_kv_usage_takes_off_what_only_holds_keep_floored_at_zero():
    assert policy.net_kv_usage(D("d", **HELD)) == pytest.approx(0.55)
    assert policy.net_kv_usage(D("d", **UNREPORTED)) == 0.95
    # The two gauges come from different moments: never below 0.
    assert policy.net_kv_usage(D("d", kv_usage=0.30, kv_reclaimable=0.35)) == 0.0
    t = by_url(score_decode(inp(160), [P("p1"), D("d1", **HELD), D("d2", **UNREPORTED)],
                            params()))
    assert (t["d1"].kv_usage, t["d1"].kv_reclaimable) == (0.95, 0.40)
    assert t["d1"].net_kv_usage == pytest.approx(0.55) and not t["d1"].over_pressure
    assert t["d2"].net_kv_usage == 0.95 and t["d2"].over_pressure


@pytest.mark.parametrize("load, kept", [(HELD, True), (UNREPORTED, False)])
def test_a_decode_full_of_holds_keeps_its_sessions(load, kept):
    i = inp(3200, session=session("d1"), peer_pullable_blocks=50)
    workers = [P("p1"), D("d1", **load), D("d2", active_decode_blocks=30.0, kv_usage=0.5)]
    d = route(i, workers, params(), random.Random(0))
    if kept:
        assert d.decode_url == "d1" and d.reason.startswith(
            "session affinity (kv usage 0.55: 0.95 less 0.40 only session holds keep "
            "<= 0.9)")
    else:
        assert d.decode_url == "d2" and d.reason.startswith(
            "session affinity dropped: kv pressure (kv usage 0.95 > 0.9)")


def test_a_decode_over_pressure_net_of_its_holds_still_loses_its_sessions():
    # 0.99 less 0.05 held is 0.94: over 0.9 all the same; the reason gives the figure.
    i = inp(3200, session=session("d1"), peer_pullable_blocks=50)
    workers = [P("p1"), D("d1", kv_usage=0.99, kv_reclaimable=0.05), D("d2", kv_usage=0.5)]
    d = route(i, workers, params(), random.Random(0))
    assert d.decode_url == "d2" and "kv pressure (kv usage 0.94: 0.99 less 0.05" in d.reason
    alone = route(i, [P("p1"), D("d1", kv_usage=0.99, kv_reclaimable=0.05)], params(),
                  random.Random(0))
    assert alone.decode_url == "d1" and "session affinity kept: every decode" in alone.reason


@pytest.mark.parametrize("load, alone", [(HELD, True), (UNREPORTED, False)])
def test_a_decode_full_of_holds_takes_a_small_turn_alone(load, alone):
    # D holds 60 of 63 blocks: 40 uncached tokens, a small increment.
    i = inp(1000, session=session("d1"), peer_pullable_blocks=60)
    d = route(i, [P("p1"), D("d1", **load)], params(), random.Random(0))
    assert d.decode_url == "d1"
    if alone:
        assert d.mode is Mode.DECODE_ONLY and d.label.value == "small_increment"
        assert d.reason == ("session affinity (kv usage 0.55: 0.95 less 0.40 only "
                            "session holds keep <= 0.9); decode only: 40 uncached tokens, "
                            "kv usage 0.55: 0.95 less 0.40 only session holds keep < 0.8")
    else:
        assert d.mode is Mode.DISAGGREGATED and d.label.value == "decode_busy"
        assert "decode worker busy (kv usage 0.95 >= 0.8)" in d.reason


@pytest.mark.parametrize("load, alone", [(HELD, True), (UNREPORTED, False)])
def test_a_decode_full_of_holds_takes_a_turn_behind_a_prefill_queue(load, alone):
    d = route(_queued_turn(), [P("p1", queued_prefill_blocks=30.0), D("d1", **load)],
              params(), random.Random(0))
    assert (d.mode is Mode.DECODE_ONLY) is alone
    if alone:
        assert d.label.value == "prefill_queued" and "(within 2048 tokens, kv usage 0.55" \
            in d.reason


def test_room_names_what_refused_it():
    busy = route(inp(1000, session=session("d1"), peer_pullable_blocks=60),
                 [P("p1"), D("d1", active_requests=32)], params(), random.Random(0))
    assert "decode worker busy (32 active requests >= 32)" in busy.reason
    # Under every bound and no holds: the reasons are as before, with no figure.
    plain = route(inp(1000, session=session("d1"), peer_pullable_blocks=60),
                  [P("p1"), D("d1", kv_usage=0.5)], params(), random.Random(0))
    assert plain.reason == "session affinity; decode only: 40 uncached tokens"


# --------------------------------------------------------------------------- prefill-only


@pytest.mark.parametrize("max_output_tokens, mode", [
    (0, Mode.PREFILL_ONLY), (1, Mode.PREFILL_ONLY),
    (2, Mode.DISAGGREGATED), (None, Mode.DISAGGREGATED),
])
def test_nothing_to_decode_is_served_by_prefill_alone(max_output_tokens, mode):
    # 3200 uncached tokens: too many for D; P computes the only new token anyway.
    i = inp(3200, max_output_tokens=max_output_tokens)
    d = route(i, [P("p1"), P("p2", active_prefill_blocks=50), D("d1")], params(),
              random.Random(0))
    assert d.mode is mode and d.prefill_url == "p1" and d.decode_url == "d1"
    if mode is Mode.PREFILL_ONLY:
        assert "prefill only" in d.reason and d.prefill_candidates


def test_prefill_only_yields_to_decode_only_and_can_be_disabled():
    # D holds all but 40 tokens: D serves the whole request, one token or many.
    held = inp(1000, session=session("d1"), peer_pullable_blocks=60, max_output_tokens=1)
    workers = [P("p1"), D("d1")]
    assert route(held, workers, params(), random.Random(0)).mode is Mode.DECODE_ONLY
    big = inp(3200, max_output_tokens=1)
    off = params(prefill_only_without_decode=False)
    assert route(big, workers, off, random.Random(0)).mode is Mode.DISAGGREGATED
    # No healthy P: D serves it whole, as for any request.
    d = route(big, [P("p1", healthy=False), D("d1")], params(), random.Random(0))
    assert d.mode is Mode.DECODE_ONLY and "no healthy prefill" in d.reason


def test_prefill_only_credits_no_peer_pull():
    # A plain request on P carries no handle, so the session's D blocks are not
    # P's to pull: the same session priced for P -> D credits them.
    i = inp(3200, session=session("d1"), peer_pullable_blocks=100)
    workers = [P("p1"), D("d1", active_requests=32)]
    both = route(i, workers, params(), random.Random(0))
    alone = route(msgspec.structs.replace(i, max_output_tokens=1), workers, params(),
                  random.Random(0))
    assert both.mode is Mode.DISAGGREGATED and both.prefill_candidates[0].peer_blocks == 100
    assert alone.mode is Mode.PREFILL_ONLY and alone.prefill_candidates[0].peer_blocks == 0


def test_several_engine_requests_are_not_split_over_p_and_d():
    # n > 1 or a batch: P would hand over one engine request's KV, so D computes
    # them; with at most one new token P serves them all, as for any request.
    big = inp(3200)
    workers = [P("p1"), D("d1")]
    assert route(big, workers, params(), random.Random(0)).mode is Mode.DISAGGREGATED
    fan = route(msgspec.structs.replace(big, engine_requests=2), workers, params(),
                random.Random(0))
    assert fan.mode is Mode.DECODE_ONLY and fan.prefill_url is None
    assert fan.label is policy.RouteReason.SEVERAL_ENGINE_REQUESTS
    assert "2 engine requests" in fan.reason
    one_token = msgspec.structs.replace(big, engine_requests=3, max_output_tokens=1)
    assert route(one_token, workers, params(), random.Random(0)).mode is Mode.PREFILL_ONLY
    with pytest.raises(ValueError, match="engine_requests"):
        inp(100, engine_requests=0)


# --------------------------------------------------------------------------- pick


def _random_case(r: random.Random):
    n_p, n_d = r.randint(1, 5), r.randint(1, 4)
    workers = [P(f"p{k}", healthy=r.random() > 0.15,
                 active_prefill_blocks=float(r.choice([0, r.randint(0, 200)])),
                 active_decode_blocks=float(r.randint(0, 100))) for k in range(n_p)]
    workers += [D(f"d{k}", healthy=k == 0 or r.random() > 0.15, kv_usage=r.random(),
                  active_requests=r.randint(0, 40),
                  active_decode_blocks=float(r.randint(0, 400)),
                  queued_decode_blocks=float(r.randint(0, 300))) for k in range(n_d)]
    prompt = r.randint(0, 4000)
    overlaps = {w.url: TierOverlap(r.randint(0, 300), r.randint(0, 300))
                for w in workers if r.random() < 0.6}
    sess = session(f"d{r.randrange(n_d)}", r.choice([None, 50.0, 500.0])) \
        if r.random() < 0.6 else None
    i = inp(prompt, overlaps=overlaps, session=sess, peer_pullable_blocks=r.randint(0, 300))
    prm = params(link=r.choice([FAST_LINK, SLOW_LINK]),
                 prefill_load_scale=r.choice([0.5, 1.0, 2.0]),
                 overlap_credit_decay=r.choice([0.0, 1.0, 3.0]))
    return i, workers, prm


def _reference_prefill_cost(i: RouteInput, w: WorkerLoad, t, least_loaded: float,
                            prm: RoutingParams) -> float:
    # Independent restatement of the formula, on the per-tier increments the scorer
    # reports and its priced peer weight.
    ov = i.overlaps.get(w.url, TierOverlap())
    pb = -(-i.prompt_tokens // i.block_size)
    device = min(ov.device_blocks, pb)
    host = max(0, min(ov.host_blocks, pb) - device)
    assert (t.device_blocks, t.host_blocks) == (device, host)
    if host and i.kv_bytes_per_token > 0:
        host_w = 1 - (prm.host_link.per_transfer_s + host * i.block_size * i.kv_bytes_per_token
                      / prm.host_link.bytes_per_s) / (
            host * i.block_size * prm.recompute.s_per_token
            + prm.recompute.s_per_token_per_context_token * (
                host * i.block_size * device * i.block_size
                + host * i.block_size * (host * i.block_size - 1) / 2))
        host_w = max(0.0, host_w)
    else:
        host_w = 0.75 if host else 0.0
    assert t.host_weight == pytest.approx(host_w, rel=1e-9)
    credit = device + host_w * host + t.peer_weight * t.peer_blocks
    credit /= 1 + prm.overlap_credit_decay * (w.active_prefill_blocks - least_loaded) / max(1, pb)
    return (prm.prefill_load_scale * max(0.0, w.active_prefill_blocks + pb - credit)
            + w.active_decode_blocks)


def test_property_chosen_workers_have_minimum_cost():
    seen_modes = collections.Counter()
    for seed in range(400):
        i, workers, prm = _random_case(random.Random(seed))
        d = route(i, workers, prm, random.Random(seed))
        seen_modes[d.mode] += 1
        dc = by_url(d.decode_candidates)
        chosen = dc[d.decode_url]
        if not chosen.affinity and not chosen.prefix_affinity:
            eligible = [t for t in dc.values() if not t.over_pressure] or list(dc.values())
            if "yielded to load" in d.reason:   # the cheapest D other than the holder
                seen_modes["yielded"] += 1
                eligible = [t for t in eligible if not t.affinity]
            assert chosen.cost == min(t.cost for t in eligible)
            assert not chosen.over_pressure or all(t.over_pressure for t in dc.values())
        if d.mode is Mode.DISAGGREGATED and d.prefill_candidates:
            pc = by_url(d.prefill_candidates)
            assert pc[d.prefill_url].cost == min(t.cost for t in pc.values())
            healthy = {w.url: w for w in workers if w.role is Role.PREFILL and w.healthy}
            assert set(pc) == set(healthy)
            least = min(w.active_prefill_blocks for w in healthy.values())
            for url, t in pc.items():
                ref = _reference_prefill_cost(i, healthy[url], t, least, prm)
                assert t.cost == pytest.approx(ref, rel=1e-9, abs=1e-9)
    assert seen_modes[Mode.DISAGGREGATED] > 50 and seen_modes[Mode.DECODE_ONLY] > 10
    assert seen_modes["yielded"] > 5


def test_same_seed_same_decisions():
    for seed in range(50):
        i, workers, prm = _random_case(random.Random(seed))
        prm = msgspec.structs.replace(prm, temperature=0.5)
        a = route(i, workers, prm, random.Random(seed))
        b = route(i, list(reversed(workers)), prm, random.Random(seed))
        assert a == b  # worker order does not matter either


def test_ties_are_spread_over_seeds():
    i = inp(320)
    workers = [P("p1"), P("p2"), D("d1"), D("d2")]
    prm = params(decode_only_max_uncached_tokens=-1)
    picks = collections.Counter()
    for seed in range(200):
        d = route(i, workers, prm, random.Random(seed))
        picks[d.prefill_url] += 1
        picks[d.decode_url] += 1
    for url in ("p1", "p2", "d1", "d2"):
        assert picks[url] > 60, picks


def test_temperature_zero_is_argmin_and_positive_temperature_samples():
    costs = {"a": 10.0, "b": 12.0, "c": 30.0}
    assert {pick(costs, 0.0, random.Random(s)) for s in range(100)} == {"a"}
    draws = collections.Counter(pick(costs, 0.5, random.Random(s)) for s in range(2000))
    assert draws["a"] > draws["b"] > draws["c"] > 0


# --------------------------------------------------------------------------- structs


def test_params_reject_unknown_fields_and_bad_values():
    raw = {"recompute": msgspec.to_builtins(RECOMPUTE), "link": msgspec.to_builtins(FAST_LINK)}
    assert msgspec.convert(raw, RoutingParams) == params()
    with pytest.raises(msgspec.ValidationError, match="prefil_load_scale"):
        msgspec.convert({**raw, "prefil_load_scale": 2.0}, RoutingParams)
    with pytest.raises(ValueError, match="decode_kv_pressure_threshold"):
        params(decode_kv_pressure_threshold=1.5)
    with pytest.raises(ValueError, match="temperature"):
        params(temperature=-1.0)
    with pytest.raises(ValueError, match="decode_affinity_load_slack"):
        params(decode_affinity_load_slack=-1.0)
    with pytest.raises(ValueError, match="block_size"):
        inp(block_size=0)


def test_decision_is_one_loggable_record():
    i = inp(3200, session=session("d1"), peer_pullable_blocks=50)
    d = route(i, [P("p1"), D("d1")], params(), random.Random(0))
    record = msgspec.json.decode(msgspec.json.encode(d))
    assert record["mode"] == "disaggregated"
    assert record["prefill_candidates"][0]["peer_weight"] > 0
    assert record["decode_candidates"][0]["affinity"] is True


def test_overlaps_from_index_match():
    got = overlaps_from_match({"e1": {"GPU": 4, "CPU": 9, "STORAGE": 20}, "e2": {"CPU": 3}})
    assert got == {"e1": TierOverlap(4, 9, 20), "e2": TierOverlap(0, 3)}


def test_all_is_sorted_and_complete():
    assert policy.__all__ == sorted(policy.__all__)
    for name in policy.__all__:
        assert hasattr(policy, name)


def test_pick_ignores_candidate_order():
    costs = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 5.0}
    flipped = dict(reversed(list(costs.items())))
    for temperature in (0.0, 1.0):
        for seed in range(50):
            assert (pick(costs, temperature, random.Random(seed))
                    == pick(flipped, temperature, random.Random(seed)))


def test_every_decision_names_its_reason_as_an_enum_label():
    """The metrics label comes from the decision, not from matching its text."""
    from sessionkv_proxy.policy import Mode, RouteReason

    rng = random.Random(0)
    small = policy.route(inp(40), [P("p"), D("d")], params(), rng)
    assert (small.mode, small.label) == (Mode.DECODE_ONLY, RouteReason.SMALL_INCREMENT)
    large = policy.route(inp(4000), [P("p"), D("d")], params(), rng)
    assert (large.mode, large.label) == (Mode.DISAGGREGATED,
                                         RouteReason.INCREMENT_TOO_LARGE)
    busy = policy.route(inp(40), [P("p"), D("d", kv_usage=0.95)], params(), rng)
    assert busy.label is RouteReason.DECODE_BUSY
    alone = policy.route(inp(4000), [D("d")], params(), rng)
    assert alone.label is RouteReason.COLOCATED
    down = policy.route(inp(4000), [P("p", healthy=False), D("d")], params(), rng)
    assert down.label is RouteReason.NO_PREFILL_WORKER
    one = policy.route(inp(4000, max_output_tokens=1), [P("p"), D("d")], params(), rng)
    assert (one.mode, one.label) == (Mode.PREFILL_ONLY, RouteReason.NO_DECODE)


def test_the_prefill_credit_is_the_cost_model_s_formula():
    from vllm_sessionkv.wire.cost import overlap_credit_blocks

    terms = policy.score_prefill(
        inp(320, overlaps={"p": TierOverlap(device_blocks=5, host_blocks=9)}),
        [P("p"), D("d")], params())
    t = by_url(terms)["p"]
    assert t.raw_credit_blocks == overlap_credit_blocks(
        t.device_blocks, t.host_blocks, t.peer_blocks, params().weights, t.peer_weight,
        t.host_weight)


def test_one_role_enum():
    from sessionkv_proxy import config

    assert config.Role is policy.Role


# --------------------------------------------------------------------------- host tier


def test_a_session_on_a_decode_workers_host_tier_returns_there_decode_only():
    # The session's lease ended (no live holder): d2 holds 18 of its 20 blocks on its
    # host tier only, d1 nothing.  d2 takes it by prefix, restores, computes the rest.
    i = inp(320, overlaps={"d2": TierOverlap(host_blocks=18)})
    d = route(i, [P("p1"), D("d1"), D("d2")], params(), random.Random(0))
    terms = by_url(d.decode_candidates)
    assert (terms["d2"].device_blocks, terms["d2"].host_blocks, terms["d2"].new_blocks) == (0, 18, 2)
    assert 0 < terms["d2"].host_weight < 1
    assert d.decode_url == "d2" and d.mode is Mode.DECODE_ONLY
    assert d.label is policy.RouteReason.HOST_TIER and d.uncached_tokens == 32
    assert "host tier" in d.reason
    # Control: without the host entries it is a plain placement and a large increment.
    plain = route(inp(320), [P("p1"), D("d1"), D("d2")], params(), random.Random(0))
    assert plain.mode is Mode.DISAGGREGATED and "host tier" not in plain.reason


def test_a_large_increment_has_the_decode_worker_restore_for_the_prefill_to_pull():
    # 20 of 63 blocks on d1's host tier, P holds nothing: D restores 320 tokens, P pulls.
    i = inp(1000, overlaps={"d1": TierOverlap(host_blocks=20)})
    d = route(i, [P("p1"), D("d1")], params(), random.Random(0))
    assert d.mode is Mode.DISAGGREGATED and d.label is policy.RouteReason.HOST_TIER_PULL
    assert d.restore_tokens == 320 and "host tier" in d.reason
    # P already holds as much on its own device: nothing to restore.
    p_has = inp(1000, overlaps={"d1": TierOverlap(host_blocks=20),
                                "p1": TierOverlap(device_blocks=20)})
    assert route(p_has, [P("p1"), D("d1")], params(), random.Random(0)).restore_tokens == 0
    # A link too slow to beat recompute: P recomputes instead.
    slow = params(link=LinkModel(bytes_per_s=1e6, per_transfer_s=1.0))
    d_slow = route(i, [P("p1"), D("d1")], slow, random.Random(0))
    assert d_slow.restore_tokens == 0 and d_slow.label is policy.RouteReason.INCREMENT_TOO_LARGE
    # The session's D without a handle (its lease ended): it restores for P.
    lapsed = msgspec.structs.replace(i, session=session("d1", expires_at_s=None))
    assert route(lapsed, [P("p1"), D("d1")], params(), random.Random(0)).restore_tokens == 320
    # A D whose restored handles expire, or a request the router cannot restore for
    # (no session, no token ids, a handle already offered), is not asked; the reason
    # says why.
    expiring = route(i, [P("p1"), D("d1", restores_expire=True)], params(), random.Random(0))
    assert expiring.restore_tokens == 0 and "lease is shorter" in expiring.reason
    assert expiring.label is policy.RouteReason.INCREMENT_TOO_LARGE
    barred = route(msgspec.structs.replace(i, restore_allowed=False), [P("p1"), D("d1")],
                   params(), random.Random(0))
    assert barred.restore_tokens == 0 and "not asked" in barred.reason
    # The live session holder hands P its handle instead.
    live = msgspec.structs.replace(i, session=session("d1"), peer_pullable_blocks=20)
    assert route(live, [P("p1"), D("d1")], params(), random.Random(0)).restore_tokens == 0


# --------------------------------------------------------------------------- disk tier


def test_each_tier_is_priced_by_its_link_device_over_host_over_disk():
    # Ten blocks on each tier of a different D: the same reach, priced by how the
    # blocks come back (in place, a host copy, a disk read then the copy).
    i = inp(320, overlaps={"dev": TierOverlap(device_blocks=10),
                           "host": TierOverlap(host_blocks=10),
                           "disk": TierOverlap(disk_blocks=10)})
    terms = by_url(score_decode(i, [D("dev"), D("host"), D("disk")],
                                params(disk_link=NVME)))
    assert terms["dev"].cost < terms["host"].cost < terms["disk"].cost
    assert 0 < terms["disk"].disk_weight < terms["host"].host_weight < 1
    assert {t.new_blocks for t in terms.values()} == {10}
    # The weight is the share of the recompute the read saves over ``disk_link``.
    assert terms["disk"].disk_weight == peer_credit_weight(
        10 * BS, 0, KV_BYTES_PER_TOKEN, RECOMPUTE, NVME)
    # With the default prior (1 GB/s) this 8B-class model recomputes faster than it
    # reads: no credit.
    assert by_url(score_decode(i, [D("disk")], params()))["disk"].disk_weight == 0.0
    # A disk too slow to beat recompute earns no credit and no reach.
    slow = params(disk_link=LinkModel(bytes_per_s=1e6, per_transfer_s=1.0))
    slow_terms = by_url(score_decode(i, [D("disk")], slow))["disk"]
    assert (slow_terms.disk_weight, slow_terms.disk_blocks, slow_terms.new_blocks) == (0, 0, 20)
    # KV size unknown: the fixed weights stand in.
    unknown = by_url(score_decode(msgspec.structs.replace(i, kv_bytes_per_token=0.0),
                                  [D("disk")], params(weights=OverlapWeights(disk=0.3))))
    assert unknown["disk"].disk_weight == 0.3


def test_disk_blocks_count_only_beyond_the_device_and_host_prefix():
    i = inp(320, overlaps={"d1": TierOverlap(device_blocks=4, host_blocks=9, disk_blocks=15)})
    t = by_url(score_decode(i, [D("d1")], params(disk_link=NVME)))["d1"]
    assert (t.device_blocks, t.host_blocks, t.disk_blocks, t.new_blocks) == (4, 5, 6, 5)
    p = by_url(score_prefill(i, [P("d1"), D("x")], params(disk_link=NVME)))["d1"]
    assert (p.device_blocks, p.host_blocks, p.disk_blocks) == (4, 5, 6)
    assert p.raw_credit_blocks == pytest.approx(4 + 5 * p.host_weight + 6 * p.disk_weight)


def test_a_session_on_a_decode_workers_disk_tier_returns_there_and_the_reason_names_it():
    # The session's KV left d2's device and host: 18 of its 20 blocks are on d2's disk.
    i = inp(320, overlaps={"d2": TierOverlap(disk_blocks=18)})
    d = route(i, [P("p1"), D("d1"), D("d2")], params(disk_link=NVME), random.Random(0))
    assert d.decode_url == "d2" and d.mode is Mode.DECODE_ONLY
    assert d.label is policy.RouteReason.DISK_TIER and d.uncached_tokens == 32
    assert "18 blocks restored from its disk tier" in d.reason
    # Part on host, part on disk: the slowest tier names the route, both are listed.
    mixed = route(inp(320, overlaps={"d2": TierOverlap(host_blocks=6, disk_blocks=18)}),
                  [P("p1"), D("d1"), D("d2")], params(disk_link=NVME), random.Random(0))
    assert mixed.label is policy.RouteReason.DISK_TIER
    assert "6 blocks restored from its host tier, 12 blocks restored from its disk tier" \
        in mixed.reason
    # A large increment: D restores from host and disk for P to pull.
    big = route(inp(1000, overlaps={"d1": TierOverlap(host_blocks=5, disk_blocks=20)}),
                [P("p1"), D("d1")], params(disk_link=NVME), random.Random(0))
    assert big.label is policy.RouteReason.DISK_TIER_PULL and big.restore_tokens == 320
    assert "host and disk tiers" in big.reason
    # Control: a disk read priced above recompute is no reach (the engine would
    # recompute): a plain placement and a large increment, as with no disk at all.
    slow = params(disk_link=LinkModel(bytes_per_s=1e6, per_transfer_s=1.0))
    plain = route(i, [P("p1"), D("d1"), D("d2")], slow, random.Random(0))
    assert plain.mode is Mode.DISAGGREGATED and "disk tier" not in plain.reason
    assert plain.label is policy.RouteReason.INCREMENT_TOO_LARGE


def test_routing_params_validate_tier_prices():
    with pytest.raises(ValueError, match="disk_link"):
        prices.routing_params_from_config({"disk_link": {"bytes_per_s": 0, "per_transfer_s": 0}})
    with pytest.raises(ValueError, match="disk"):
        prices.routing_params_from_config({"weights": {"disk": -0.5}})
    with pytest.raises(ValueError, match="disk_lnk"):
        prices.routing_params_from_config({"disk_lnk": {}})
    got = prices.routing_params_from_config({"disk_link": {"bytes_per_s": 2e9,
                                                           "per_transfer_s": 1e-3}})
    assert got.disk_link == LinkModel(bytes_per_s=2e9, per_transfer_s=1e-3)


def test_device_blocks_beat_host_blocks_for_the_decode_choice():
    i = inp(320, overlaps={"dev": TierOverlap(device_blocks=10),
                           "host": TierOverlap(host_blocks=10)})
    terms = by_url(score_decode(i, [D("dev"), D("host")], params()))
    assert terms["dev"].cost < terms["host"].cost
    assert terms["dev"].new_blocks == terms["host"].new_blocks == 10
