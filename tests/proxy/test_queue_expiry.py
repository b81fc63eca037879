"""A session handle that would expire in P's queue (issue 47), on plain data: the rule
(``queue_expiry``) and what ``policy.route`` does with it.  The router's side (the
handle not sent, not consumed, counted) is in test_router.py."""

from __future__ import annotations

import random

import pytest

from sessionkv_proxy.engines import parse_vllm_metrics
from sessionkv_proxy.policy import (
    Mode,
    Role,
    RouteInput,
    RoutingParams,
    SessionView,
    WorkerLoad,
    route,
    score_prefill,
)
from sessionkv_proxy.prices import recompute_price, routing_params_from_config
from sessionkv_proxy.queue_expiry import (
    expiry_route,
    handle_expires_in_queue,
    prefill_queue_wait_s,
)
from vllm_sessionkv.wire.cost import LinkModel, RecomputeModel

# 1e-4 s a token, 16-token blocks: 1.6 ms a block of P's queue, 10 s = 6250 blocks.
RECOMPUTE = RecomputeModel(s_per_token=1e-4, s_per_token_per_context_token=1e-9,
                           load_slowdown_per_unit=1.0)
LINK = LinkModel(bytes_per_s=50e9, per_transfer_s=1e-3)
BS = 16
NOW_S = 100.0
MARGIN_S = 10.0           # the engines' expiry_margin_s, and handle_expiry_margin_s
QUEUE_10_S = 6250.0       # P's queued prefill blocks: ~10 s at RECOMPUTE


def params(**kw) -> RoutingParams:
    return RoutingParams(recompute=RECOMPUTE, link=LINK, handle_expiry_margin_s=MARGIN_S,
                         **kw)


def turn(left_s: float | None = 3.0) -> RouteInput:
    """A session turn of 8000 tokens (500 blocks) whose D holds the first 300 blocks
    (the handle's), so 3200 tokens are new: more than D takes alone behind P's queue
    (``decode_only_prefill_queued_max_tokens``, 2048), so only this rule can send it
    to D.  Its handle has ``left_s`` past the margin (None: its end is unknown)."""
    expires = None if left_s is None else NOW_S + MARGIN_S + left_s
    return RouteInput(prompt_tokens=8000, block_size=BS, now_s=NOW_S,
                      kv_bytes_per_token=131072.0, peer_pullable_blocks=300,
                      session=SessionView(session_id="s1", last_decode="d1",
                                          expires_at_s=expires))


def P(queued_prefill_blocks: float = 0.0, **kw) -> WorkerLoad:
    return WorkerLoad(url="p1", role=Role.PREFILL,
                      queued_prefill_blocks=queued_prefill_blocks, **kw)


def D(url: str = "d1", **kw) -> WorkerLoad:
    return WorkerLoad(url=url, role=Role.DECODE, **kw)


def decide(inp: RouteInput, workers: list[WorkerLoad], **kw):
    return route(inp, workers, params(**kw), random.Random(0))


WOULD_EXPIRE = "handle would expire in P's queue (3.0 s left, ~10.0 s queued)"


# --------------------------------------------------------------------------- the rule


def test_the_wait_is_p_queued_compute_at_the_recompute_price():
    assert prefill_queue_wait_s(QUEUE_10_S, BS, RECOMPUTE) == pytest.approx(10.0)
    assert prefill_queue_wait_s(0.0, BS, RECOMPUTE) == 0.0
    assert prefill_queue_wait_s(-3.0, BS, RECOMPUTE) == 0.0


@pytest.mark.parametrize("queued_s, expires", [(2.88, False), (3.12, True), (0.0, False)])
def test_a_handle_expires_when_p_queue_outlasts_its_life_past_the_margin(queued_s, expires):
    inp = turn(left_s=3.0)
    blocks = queued_s / (BS * RECOMPUTE.s_per_token)
    prefill = score_prefill(inp, [P(blocks), D()], params())[0]
    found = handle_expires_in_queue(inp, prefill, params())
    assert (found is not None) is expires
    if expires:
        assert found.left_s == pytest.approx(3.0) and found.queued_s == pytest.approx(3.12)
        assert str(found) == "handle would expire in P's queue (3.0 s left, ~3.1 s queued)"


def test_no_handle_or_no_known_end_is_never_expiring():
    prefill = score_prefill(turn(), [P(QUEUE_10_S), D()], params())[0]
    assert handle_expires_in_queue(turn(left_s=None), prefill, params()) is None
    no_session = RouteInput(prompt_tokens=8000, block_size=BS, now_s=NOW_S)
    assert handle_expires_in_queue(no_session, prefill, params()) is None
    assert expiry_route(None, None, (True, ""), params()) == (False, "")


# --------------------------------------------------------------------------- the route


def test_a_handle_that_would_expire_in_p_queue_sends_the_turn_to_its_d_alone():
    d = decide(turn(left_s=3.0), [P(QUEUE_10_S), D()])
    assert d.mode is Mode.DECODE_ONLY and d.prefill_url is None and d.decode_url == "d1"
    assert d.label.value == "handle_expires_in_queue" and d.handle_expires_in_queue
    assert d.reason == (f"session affinity; decode only: {WOULD_EXPIRE}; "
                        "D holds the session's KV")
    assert d.uncached_tokens == 3200          # D computes only the new tokens


def test_control_an_idle_p_pulls_with_the_handle_as_before():
    # The same handle with P idle: the P pull of today, with the handle.
    idle = decide(turn(left_s=3.0), [P(0.0), D()])
    assert idle.mode is Mode.DISAGGREGATED and not idle.handle_expires_in_queue
    assert idle.label.value == "increment_too_large"
    assert idle.reason == ("session affinity; disaggregated: increment too large "
                           "(3200 uncached tokens)")
    # Exactly what a handle of long life gets, and what the same queue gives one.
    far = decide(turn(left_s=600.0), [P(0.0), D()])
    assert (idle.mode, idle.label, idle.reason, idle.prefill_candidates) == \
        (far.mode, far.label, far.reason, far.prefill_candidates)
    queued_far = decide(turn(left_s=600.0), [P(QUEUE_10_S), D()])
    assert queued_far.mode is Mode.DISAGGREGATED and not queued_far.handle_expires_in_queue
    # P pulls the 300 blocks the handle names: it computes about the 200 new ones.
    assert 200 <= idle.prefill_work_blocks < 210


@pytest.mark.parametrize("d1, refused", [
    (D(kv_usage=0.85), "D has no room (kv usage 0.85 >= 0.8)"),
    (D(active_requests=32), "D has no room (32 active requests >= 32)"),
])
def test_without_room_on_d_p_recomputes_the_turn_without_the_handle(d1, refused):
    d = decide(turn(left_s=3.0), [P(QUEUE_10_S), d1])
    assert d.mode is Mode.DISAGGREGATED and d.prefill_url == "p1" and d.decode_url == "d1"
    assert d.handle_expires_in_queue and d.label.value == "increment_too_large"
    assert d.reason.endswith(f"; P without the handle: {WOULD_EXPIRE}, {refused}")
    # P is priced, and its queued work counted, as the recompute of the whole prompt.
    chosen = d.prefill_candidates[0]
    assert chosen.peer_blocks == 0 and d.prefill_work_blocks == 500


def test_p_without_the_handle_when_the_sessions_d_is_not_the_one_chosen():
    # d1 (the session's) is over kv pressure: affinity goes to d2, which holds nothing.
    d = decide(turn(left_s=3.0), [P(QUEUE_10_S), D("d1", kv_usage=0.95), D("d2")])
    assert d.mode is Mode.DISAGGREGATED and d.decode_url == "d2"
    assert d.handle_expires_in_queue
    assert d.reason.endswith(f"{WOULD_EXPIRE}, the session's D was not chosen")


def test_p_without_the_handle_when_decode_only_is_off():
    d = decide(turn(left_s=3.0), [P(QUEUE_10_S), D()], decode_only_max_uncached_tokens=-1)
    assert d.mode is Mode.DISAGGREGATED and d.handle_expires_in_queue
    assert d.reason.endswith(f"{WOULD_EXPIRE}, decode only is off")


def test_the_prefill_queue_rule_decides_first_and_keeps_its_reason():
    # 1000 tokens, D holds 40 blocks: 360 new tokens, within what D takes alone behind
    # P's queue.  The handle is not used either way; the reason is P's queue.
    inp = RouteInput(prompt_tokens=1000, block_size=BS, now_s=NOW_S,
                     kv_bytes_per_token=131072.0, peer_pullable_blocks=40,
                     session=SessionView(session_id="s1", last_decode="d1",
                                         expires_at_s=NOW_S + MARGIN_S + 3.0))
    d = decide(inp, [P(QUEUE_10_S), D()])
    assert d.mode is Mode.DECODE_ONLY and d.label.value == "prefill_queued"
    assert not d.handle_expires_in_queue and "expire" not in d.reason


# --------------------------------------------------------------- P's own recompute price


def test_p_reported_price_sizes_its_queue_unless_recompute_is_configured():
    """P's calibrated sessionkv_recompute_seconds_per_token (a real model's, 100x the
    prior here) prices its queue; a configured routing.params.recompute rules."""
    inp = turn(left_s=3.0)
    blocks = QUEUE_10_S / 100            # 0.1 s at RECOMPUTE, 10 s at P's own price
    reported = RECOMPUTE.s_per_token * 100
    prefill = score_prefill(inp, [P(blocks, recompute_s_per_token=reported), D()],
                            params())[0]
    assert prefill.recompute_s_per_token == reported
    found = handle_expires_in_queue(inp, prefill, params())
    assert found is not None and found.queued_s == pytest.approx(10.0)
    # Control: the operator's price (recompute configured) and an engine that says
    # nothing both leave the wait at 0.1 s.
    assert handle_expires_in_queue(inp, prefill, params(recompute_from_engines=False)) is None
    silent = score_prefill(inp, [P(blocks), D()], params())[0]
    assert handle_expires_in_queue(inp, silent, params()) is None


@pytest.mark.parametrize("reported", [None, 0.0, -1.0, float("nan")])
def test_no_usable_reported_price_keeps_the_configured_one(reported):
    assert recompute_price(params(), reported) == RECOMPUTE


def test_configuring_recompute_turns_engine_prices_off():
    assert routing_params_from_config({}).recompute_from_engines
    configured = {"recompute": {"s_per_token": 2e-3, "s_per_token_per_context_token": 0.0,
                                "load_slowdown_per_unit": 0.0}}
    assert not routing_params_from_config(configured).recompute_from_engines
    both = routing_params_from_config({**configured, "recompute_from_engines": True})
    assert both.recompute_from_engines and both.recompute.s_per_token == 2e-3


def test_the_scraped_price_is_the_mean_over_label_sets_and_none_when_absent():
    text = ("# TYPE sessionkv_recompute_seconds_per_token gauge\n"
            'sessionkv_recompute_seconds_per_token{engine="0"} 0.002\n'
            'sessionkv_recompute_seconds_per_token{engine="1"} 0.004\n'
            'sessionkv_recompute_seconds_per_token{engine="2"} NaN\n')
    price = "sessionkv_recompute_seconds_per_token"
    assert parse_vllm_metrics(text)[price] == pytest.approx(0.003)
    assert price not in parse_vllm_metrics("vllm:num_requests_waiting 0.0\n")
