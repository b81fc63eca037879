"""First-token handoff on real engines: D continues from the token P sampled.

Requests without logprobs (the handoff's domain) are compared by token ids with the
co-located server; the KV behind them is then checked the project's usual way, by
token ids *and* top-5 logprobs of a continuation that D serves from its prefix cache
(the blocks P handed over and the block D computed for P's token).  The perturbed P
is the negative control: continuing from its token and KV must differ.
"""

from __future__ import annotations

import json

import pytest

from helpers import assert_same, chat_body, completion_body, compare, metric_sum, post

pytestmark = pytest.mark.cluster

HANDOFF = "sessionkv_first_token_handoffs_total"


def plain_completion(model: str, prompt, max_tokens: int, **extra) -> dict:
    """A greedy request the handoff may serve: no logprobs."""
    body = completion_body(model, prompt, max_tokens=max_tokens, **extra)
    del body["logprobs"]
    return body


def prompt_of(length: int, seed: int) -> list[int]:
    return [(23 * i + seed) % 900 + 20 for i in range(length)]


def through_prefill(p_url: str, d_url: str, body: dict):
    """P prefills ``body``'s prompt for D (max_tokens=1), then D serves ``body`` on
    P's parameters, as the proxy does.  Returns P's and D's generations."""
    p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    p_body.pop("min_tokens", None)
    p_out = post(p_url, "/v1/completions", p_body)
    return p_out, post(d_url, "/v1/completions",
                       dict(body, kv_transfer_params=p_out.raw["kv_transfer_params"]))


def continuation_matches_baseline(cluster, prompt: list[int], generated: list[int]) -> None:
    """D's cached KV for prompt + generated (P's blocks and D's own) gives the
    co-located server's tokens and logprobs."""
    follow = completion_body(cluster.model, prompt + generated[:-1], max_tokens=6)
    hits_before = metric_sum(cluster.decode[0], "vllm:prefix_cache_hits_total")
    got = post(cluster.decode[0], "/v1/completions", follow)
    assert metric_sum(cluster.decode[0], "vllm:prefix_cache_hits_total") - hits_before \
        >= len(prompt) // 32 * 32, "the continuation did not reuse D's cached blocks"
    assert_same(got, post(cluster.colocated, "/v1/completions", follow),
                "continuation on D's cached KV")


# 128 and 127 tokens: P's token opens a new block, or completes one (its hash
# includes the token); 140: in the middle of a block.
@pytest.mark.parametrize("length", [140, 128, 127])
def test_decode_continues_from_the_prefill_token(pd_cluster, length):
    p_url, d_url = pd_cluster.prefill[0], pd_cluster.decode[0]
    prompt = prompt_of(length, seed=length)
    body = plain_completion(pd_cluster.model, prompt, max_tokens=24)
    continued = metric_sum(d_url, HANDOFF, outcome="continued")
    p_out, got = through_prefill(p_url, d_url, body)
    assert metric_sum(d_url, HANDOFF, outcome="continued") == continued + 1
    base = post(pd_cluster.colocated, "/v1/completions", body)
    assert got.token_ids == base.token_ids, compare(got, base)
    assert got.text == base.text
    assert got.token_ids[0] == p_out.token_ids[0]
    assert got.raw["usage"]["completion_tokens"] == 24
    assert got.raw["usage"]["prompt_tokens"] == length
    acct = got.raw["kv_transfer_params"]["sessionkv"]["accounting"]
    assert acct["first_token_from_prefill"] is True, acct
    assert acct.get("recomputed_tokens", 0) == 0, acct
    assert acct["pulled_from_peer_tokens"] == length, acct
    continuation_matches_baseline(pd_cluster, prompt, got.token_ids)


@pytest.mark.parametrize("path, stream, max_tokens", [
    ("/v1/completions", True, 2), ("/v1/completions", False, 2),
    ("/v1/completions", True, 16), ("/v1/chat/completions", True, 16),
    ("/v1/chat/completions", False, 2)])
def test_handoff_through_the_proxy_equals_baseline(pd_cluster, path, stream, max_tokens):
    d_url = pd_cluster.decode[0]
    seed = 1000 + max_tokens + 10 * stream + 100 * (path == "/v1/chat/completions")
    if path == "/v1/completions":
        body = plain_completion(pd_cluster.model, prompt_of(150, seed), max_tokens,
                                stream=stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
    else:
        words = " ".join(f"w{(seed * 7 + i) % 97}" for i in range(60))
        body = chat_body(pd_cluster.model, [{"role": "user", "content": words}],
                         max_tokens=max_tokens, stream=stream)
        del body["logprobs"], body["top_logprobs"]
    continued = metric_sum(d_url, HANDOFF, outcome="continued")
    got = post(pd_cluster.proxy, path, body)
    base_body = {k: v for k, v in body.items() if k != "stream_options"}
    base = post(pd_cluster.colocated, path, dict(base_body, stream=False))
    assert got.headers.get("x-sessionkv-route") == "disaggregated"
    assert got.token_ids == base.token_ids and len(got.token_ids) == max_tokens
    assert got.text == base.text
    assert metric_sum(d_url, HANDOFF, outcome="continued") == continued + 1


def test_sampling_that_needs_the_token_on_d_is_not_handed_off(pd_cluster):
    """Seeded sampling (D's generator would start one draw early), logprobs, and a
    token that stops the request: D recomputes the last prompt token as stock P/D
    does, and still equals the co-located server."""
    p_url, d_url = pd_cluster.prefill[0], pd_cluster.decode[0]
    model = pd_cluster.model
    seeded = plain_completion(model, prompt_of(140, 7), 12, temperature=1.0, seed=1234)
    with_logprobs = completion_body(model, prompt_of(140, 8), max_tokens=12)
    first = post(pd_cluster.colocated, "/v1/completions",
                 plain_completion(model, prompt_of(140, 9), 1)).token_ids[0]
    stopping = plain_completion(model, prompt_of(140, 9), 12, stop_token_ids=[first],
                                ignore_eos=False)
    for body, outcome in ((seeded, "seeded_sampling"), (with_logprobs, "logprobs"),
                          (stopping, "stop_token")):
        refused = metric_sum(d_url, HANDOFF, outcome=outcome)
        _, got = through_prefill(p_url, d_url, body)
        assert metric_sum(d_url, HANDOFF, outcome=outcome) == refused + 1, outcome
        base = post(pd_cluster.colocated, "/v1/completions", body)
        if body is with_logprobs:
            assert_same(got, base, outcome)
        assert got.token_ids == base.token_ids, outcome
        acct = got.raw["kv_transfer_params"]["sessionkv"]["accounting"]
        assert not acct.get("first_token_from_prefill") and acct["recomputed_tokens"] == 1
    assert got.token_ids == [first]


def test_negative_control_continuing_from_a_perturbed_prefill_differs(pd_cluster):
    """The perturbed P's token and KV: D continues from them, so its output must
    differ from the co-located server's; proof that the token comparison above can
    fail and that D really continues from what P handed over."""
    p_url, d_url = pd_cluster.extras["perturbed_prefill"], pd_cluster.decode[0]
    for attempt in range(3):   # a first read from a peer can fail on a busy machine
        body = plain_completion(pd_cluster.model, prompt_of(140, 50 + attempt), 24)
        continued = metric_sum(d_url, HANDOFF, outcome="continued")
        _, got = through_prefill(p_url, d_url, body)
        acct = got.raw["kv_transfer_params"]["sessionkv"]["accounting"]
        if metric_sum(d_url, HANDOFF, outcome="continued") == continued + 1 and \
                acct["pulled_from_peer_tokens"] == 140:
            break
    else:
        pytest.fail("no handoff with a completed read from the perturbed P in 3 attempts")
    base = post(pd_cluster.colocated, "/v1/completions", body)
    assert got.token_ids != base.token_ids


def test_session_turns_continue_from_the_prefill_token(pd_cluster):
    """A conversation through the proxy whose turns D serves from P's token: the
    next turn's P pulls the previous turn's blocks from D, including the block D
    computed for P's token (its hash covers the token as an output), and every
    turn equals the co-located server."""
    d_url = pd_cluster.decode[0]
    session = "handoff-session"
    prompt = prompt_of(600, seed=77)
    continued = metric_sum(d_url, HANDOFF, outcome="continued")
    pulled = 0
    for turn in range(1, 5):
        body = plain_completion(pd_cluster.model, prompt, 24, session_id=session)
        got = post(pd_cluster.proxy, "/v1/completions", body)
        base = post(pd_cluster.colocated, "/v1/completions", body)
        assert got.token_ids == base.token_ids, (turn, compare(got, base))
        decode_acct = json.loads(got.headers["x-sessionkv-decode"])
        assert decode_acct.get("first_token_from_prefill") is True, (turn, decode_acct)
        if turn > 1:
            assert got.headers["x-sessionkv-handle"] == "attached", turn
            pulled += json.loads(got.headers["x-sessionkv-prefill"]).get(
                "pulled_from_peer_tokens", 0)
        turn_prompt, prompt = prompt, prompt + got.token_ids + prompt_of(40, seed=1000 + turn)
    assert pulled > 0, "no turn pulled KV from D"
    assert metric_sum(d_url, HANDOFF, outcome="continued") == continued + 4
    continuation_matches_baseline(pd_cluster, turn_prompt, got.token_ids)


def test_prefill_asked_to_keep_its_token_exports_none(pd_cluster):
    """What the proxy's --no-first-token-handoff sends P: P exports no token, and D
    recomputes the last prompt token as stock P/D does."""
    p_url, d_url = pd_cluster.prefill[0], pd_cluster.decode[0]
    body = plain_completion(pd_cluster.model, prompt_of(140, seed=321), 12)
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None,
              "sessionkv": {"first_token": False}}
    p_out = post(p_url, "/v1/completions", dict(body, max_tokens=1, kv_transfer_params=params))
    p_params = p_out.raw["kv_transfer_params"]
    assert "first_token_id" not in p_params["sessionkv"], p_params
    continued = metric_sum(d_url, HANDOFF, outcome="continued")
    got = post(d_url, "/v1/completions", dict(body, kv_transfer_params=p_params))
    assert metric_sum(d_url, HANDOFF, outcome="continued") == continued
    assert got.token_ids == post(pd_cluster.colocated, "/v1/completions", body).token_ids
    acct = got.raw["kv_transfer_params"]["sessionkv"]["accounting"]
    assert not acct.get("first_token_from_prefill") and acct["recomputed_tokens"] == 1, acct
