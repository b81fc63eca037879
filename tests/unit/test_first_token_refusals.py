"""When D may continue from the token P sampled (first_token.handoff_refusal)."""

from __future__ import annotations

import pytest

from vllm_sessionkv.first_token import FIRST_TOKEN_OUTCOMES, FirstTokenRequest, handoff_refusal

PROMPT = 140


def request(**overrides) -> FirstTokenRequest:
    fields = dict(num_prompt_tokens=PROMPT, num_output_tokens=0, max_tokens=16,
                  max_model_len=2048, greedy=True, eos_token_id=2)
    fields.update(overrides)
    return FirstTokenRequest(**fields)


def test_a_plain_greedy_request_continues():
    assert handoff_refusal(request(), token_id=77, verified_prompt_tokens=PROMPT) is None


def test_unseeded_random_sampling_continues():
    # P's draw is a draw from the same distribution D would have drawn from.
    assert handoff_refusal(request(greedy=False), 77, PROMPT) is None


@pytest.mark.parametrize("overrides, token_id, verified, reason", [
    ({}, 77, PROMPT - 1, "prompt_not_fully_verified"),
    ({}, 77, 0, "prompt_not_fully_verified"),
    ({"num_output_tokens": 1}, 77, PROMPT, "already_has_output"),
    ({"logprobs": 0}, 77, PROMPT, "logprobs"),
    ({"prompt_logprobs": 1}, 77, PROMPT, "logprobs"),
    ({"greedy": False, "seed": 7}, 77, PROMPT, "seeded_sampling"),
    ({"min_tokens": 1}, 77, PROMPT, "min_tokens"),
    ({"presence_penalty": 0.5}, 77, PROMPT, "output_penalties"),
    ({"frequency_penalty": -0.1}, 77, PROMPT, "output_penalties"),
    ({"has_bad_words": True}, 77, PROMPT, "bad_words"),
    ({"structured_output": True}, 77, PROMPT, "structured_output"),
    ({}, 2, PROMPT, "stop_token"),
    ({"stop_token_ids": (5, 77)}, 77, PROMPT, "stop_token"),
    ({"max_tokens": 1}, 77, PROMPT, "nothing_to_decode"),
    ({"max_model_len": PROMPT + 1}, 77, PROMPT, "nothing_to_decode"),
])
def test_refusals(overrides, token_id, verified, reason):
    assert handoff_refusal(request(**overrides), token_id, verified) == reason
    assert reason in FIRST_TOKEN_OUTCOMES


def test_seed_is_irrelevant_when_greedy():
    assert handoff_refusal(request(seed=7), 77, PROMPT) is None


def test_ignored_eos_is_no_stop_token():
    # vLLM's eos_token_id is None for a request that ignores EOS.
    assert handoff_refusal(request(eos_token_id=None), 2, PROMPT) is None
