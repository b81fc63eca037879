"""The scheduler's pricing component on plain numbers: one quote construction for
peers and the host tier, the load and bandwidth estimates, synchronous reads."""

from __future__ import annotations

import pytest

from vllm_sessionkv.config import CostConfig
from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.wire.cost import LinkModel, PullQuote, RecomputeModel, decide_pull

COST = CostConfig(recompute_s_per_token=1e-3, recompute_s_per_token_per_context_token=0.0,
                  load_slowdown_per_unit=0.5, link_bytes_per_s=1e6, per_transfer_s=1e-3,
                  load_ewma_alpha=0.5, bandwidth_ewma_alpha=0.5,
                  bandwidth_min_sample_bytes=1000, sync_load_max_stall_s=0.005)
HOST = LinkModel(bytes_per_s=1e9, per_transfer_s=0.0)


def pricing() -> Pricing:
    return Pricing(COST, kv_bytes_per_token=100.0, host_link=HOST)


def test_a_decision_is_cost_decide_pull_with_the_live_load():
    p = pricing()
    p.observe_step(2.0)   # load 1.0 after one step at alpha 0.5
    got = p.decide(50, 10, p.peer_link)
    want = decide_pull(PullQuote(pull_tokens=50, context_tokens=10, kv_bytes_per_token=100.0,
                                 engine_load=1.0),
                       RecomputeModel(s_per_token=1e-3, s_per_token_per_context_token=0.0,
                                      load_slowdown_per_unit=0.5),
                       LinkModel(bytes_per_s=1e6, per_transfer_s=1e-3))
    assert got == want and got.pull   # 6 ms to pull against 75 ms to recompute
    assert p.decide(50, 10, HOST).pull_s < got.pull_s   # the host link is faster


def test_a_pull_below_min_pull_tokens_recomputes():
    p = Pricing(CostConfig(min_pull_tokens=100), kv_bytes_per_token=1.0, host_link=HOST)
    assert not p.decide(99, 0, p.peer_link).pull
    assert p.decide(100, 0, p.peer_link).pull


def test_the_load_resets_when_the_engine_was_idle():
    p = pricing()
    p.note_live("a")
    p.observe_step(4.0)
    assert p.engine_load == 2.0
    p.note_live("b")                 # "a" still live: the estimate stands
    assert p.engine_load == 2.0
    p.finished("a")
    p.finished("b")
    p.note_live("c")                 # none live: the engine was idle
    assert p.engine_load == 0.0


def test_bandwidth_learns_only_from_large_transfers():
    p = pricing()
    p.observe_transfers([500, 4000], [0.001, 0.001])   # 500 B is latency, not bandwidth
    assert p.link_bytes_per_s == pytest.approx(0.5 * 1e6 + 0.5 * 4e6)
    p.observe_transfers([4000], [0.0])                 # no duration: ignored
    assert p.link_bytes_per_s == pytest.approx(2.5e6)


def test_a_sync_read_must_be_short_alone_and_times_the_load():
    p = pricing()
    assert p.sync_read(30)          # 1 ms + 3 ms = 4 ms <= 5 ms, idle engine
    assert not p.sync_read(50)      # 6 ms
    p.observe_step(4.0)             # load 2: 4 ms x 2 = 8 ms of others' stall
    assert not p.sync_read(30)
    off = Pricing(CostConfig(sync_load_max_stall_s=0.0), 1.0, HOST)
    assert not off.sync_read(1)
