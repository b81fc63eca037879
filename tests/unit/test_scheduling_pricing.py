"""The scheduler's pricing component on plain numbers: one quote construction for
peers and the host tier, the load and bandwidth estimates, synchronous reads."""

from __future__ import annotations

import pytest

from vllm_sessionkv.config import CostConfig
from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.wire.cost import (
    LinkModel,
    PullQuote,
    RecomputeModel,
    calibrate_s_per_token,
    decide_pull,
)

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


# ------------------------------------------------------------- recompute calibration

def calibrating(**cost) -> Pricing:
    settings = {"recompute_prior_s_per_token": 2e-5,
                "recompute_s_per_token_per_context_token": 0.0,
                "recompute_ewma_alpha": 0.3, "recompute_min_sample_tokens": 64, **cost}
    return Pricing(CostConfig(**settings),
                   kv_bytes_per_token=46_080.0, host_link=HOST)


def test_the_recompute_price_starts_at_the_prior_and_converges_on_the_engines_steps():
    p = calibrating()
    assert not p.recompute_pinned and p.recompute_model.s_per_token == 2e-5
    # A real-model CPU engine: 512-token prefill steps of 2.56 s (5 ms a token).
    now = 0.0
    for _ in range(20):
        p.step_built(now, [(512, 0)])
        now += 2.56
        p.step_finished(now)
    assert p.recompute_model.s_per_token == pytest.approx(5e-3, rel=1e-3)
    # Priced with it, a 1,000-token pull at 1 GB/s (48 ms) beats recompute (5 s);
    # with the prior (20 ms to recompute) it would not have.
    assert p.decide(1000, 0, p.peer_link).pull


def test_decode_steps_and_steps_waiting_on_reads_do_not_move_the_price():
    p = calibrating()
    p.step_built(0.0, [(1, 500), (1, 700)])          # decode: the step's fixed cost
    assert not p.step_finished(0.05)
    p.step_built(0.05, [(512, 0)], timed=False)      # waited on a synchronous read
    assert not p.step_finished(5.0)
    assert p.recompute_model.s_per_token == 2e-5


def test_a_step_is_timed_from_when_it_could_start():
    p = calibrating(recompute_ewma_alpha=1.0)
    # Async scheduling: the second step is built while the first runs; it starts
    # when the first finishes, not when it was built.
    p.step_built(0.0, [(100, 0)])
    p.step_built(0.1, [(200, 100)])
    p.step_finished(1.0)
    assert p.recompute_model.s_per_token == pytest.approx(1.0 / 100)
    p.step_finished(3.0)
    assert p.recompute_model.s_per_token == pytest.approx(2.0 / 200)
    # A step built after an idle spell starts when it was built.
    p.step_built(10.0, [(100, 0)])
    p.step_finished(10.5)
    assert p.recompute_model.s_per_token == pytest.approx(0.5 / 100)


def test_the_attention_term_is_taken_out_of_each_sample():
    p = calibrating(recompute_ewma_alpha=1.0, recompute_s_per_token_per_context_token=1e-6)
    # 100 new tokens after 1,000: 100,000 + 4,950 pairs -> 0.10495 s of attention.
    p.step_built(0.0, [(100, 1000)])
    p.step_finished(0.10495 + 0.2)
    assert p.recompute_model.s_per_token == pytest.approx(2e-3)


def test_a_configured_recompute_price_pins_it():
    p = calibrating(recompute_s_per_token=1e-4)
    assert p.recompute_pinned and p.recompute_model.s_per_token == 1e-4
    for i in range(5):
        p.step_built(float(i), [(512, 0)])
        assert not p.step_finished(i + 0.9)
    assert p.recompute_model.s_per_token == 1e-4


def test_calibrate_s_per_token_is_a_pure_ewma_over_prefill_samples():
    assert calibrate_s_per_token(1e-3, 100, 0.0, 0.5, 0.0, 0.5, 64) == pytest.approx(
        0.5 * 1e-3 + 0.5 * 5e-3)
    assert calibrate_s_per_token(1e-3, 63, 0.0, 0.5, 0.0, 0.5, 64) == 1e-3   # too small
    assert calibrate_s_per_token(1e-3, 100, 0.0, 0.0, 0.0, 0.5, 64) == 1e-3  # no time


@pytest.mark.parametrize("key", ["recompute_ewma_alpha", "load_ewma_alpha",
                                 "bandwidth_ewma_alpha"])
def test_an_ewma_weight_outside_0_1_fails_naming_the_key(key):
    with pytest.raises(ValueError, match=f"cost.{key}"):
        CostConfig(**{key: 0.0})
    with pytest.raises(ValueError, match=f"cost.{key}"):
        CostConfig(**{key: 1.5})
