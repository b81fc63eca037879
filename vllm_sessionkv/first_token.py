"""First-token handoff: D continues from the token P already sampled.

P prefills the whole prompt with ``max_tokens=1``, so it has sampled the first output
token; stock P/D drops it, and D recomputes the last prompt token on P's KV to sample
the same token again: one more engine step for every request.  With the handoff P
exports its token beside its KV, and D (which has then loaded the KV of *every* prompt
token) appends it as its first output and starts at the next one.

Whether D may do that is decided here, on plain data, from what D's own request asks
for.  The token is only used where P's sample is exactly the one D would have drawn
(the same prompt, verified by hash; the same sampling state) and where nothing in D's
engine needs the token's own logits or its place in the output count that the model
runner keeps (vLLM's worker sees the token as the prompt's last one):

* logprobs or prompt logprobs: D would have to return the token's logprobs;
* seeded sampling at temperature > 0: D's generator would start one draw early;
* ``min_tokens``, presence/frequency penalties, bad words: the worker counts output
  tokens for these, and would not count this one;
* structured output: the grammar must see the token;
* the token stops the request (EOS or a stop token id), or ``max_tokens`` < 2, or the
  context is full: nothing is left to decode;
* P's KV does not cover the whole prompt as verified (a partial hit on D is fine;
  an unverified tail is not).

A declined handoff costs the one step it would have saved, never correctness.
"""

from __future__ import annotations

import msgspec

__all__ = ["FIRST_TOKEN_OUTCOMES", "FirstTokenRequest", "handoff_refusal"]

# Why a D request that came with P's token did not continue from it.
REFUSALS = ("already_has_output", "prompt_not_fully_verified", "logprobs",
            "seeded_sampling", "min_tokens", "output_penalties", "bad_words",
            "structured_output", "stop_token", "nothing_to_decode",
            # The token was already used by another request (``n`` > 1 on D).
            "already_used",
            # The engine runs something the handoff does not support
            # (_vllm.first_token.first_token_unsupported), or it is turned off.
            "engine_unsupported")
# What became of P's token on D: "continued" or a refusal.
FIRST_TOKEN_OUTCOMES = ("continued", *REFUSALS)


class FirstTokenRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What D's request asks for, as far as the handoff cares."""

    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    max_model_len: int
    greedy: bool
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    has_bad_words: bool = False
    structured_output: bool = False
    eos_token_id: int | None = None     # None when the request ignores EOS
    stop_token_ids: tuple[int, ...] = ()


def handoff_refusal(request: FirstTokenRequest, token_id: int,
                    verified_prompt_tokens: int) -> str | None:
    """Why D must not continue from P's ``token_id``; None when it may."""
    if request.num_output_tokens:
        return "already_has_output"
    if verified_prompt_tokens < request.num_prompt_tokens:
        return "prompt_not_fully_verified"
    if request.logprobs is not None or request.prompt_logprobs is not None:
        return "logprobs"
    if not request.greedy and request.seed is not None:
        return "seeded_sampling"
    if request.min_tokens > 0:
        return "min_tokens"
    if request.presence_penalty or request.frequency_penalty:
        return "output_penalties"
    if request.has_bad_words:
        return "bad_words"
    if request.structured_output:
        return "structured_output"
    if token_id == request.eos_token_id or token_id in request.stop_token_ids:
        return "stop_token"
    if request.max_tokens < 2 or request.num_prompt_tokens + 1 >= request.max_model_len:
        return "nothing_to_decode"
    return None
