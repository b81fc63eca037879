"""First-token handoff (``vllm_sessionkv.first_token``), vLLM's side: the handoff's
view of a request, and the patches that return P's token to the client and show it
to the model runner.  Requests that continue from P's token, and the token each has
yet to return to its client, are process-wide: one engine per process."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched import scheduler as _scheduler

from vllm_sessionkv.first_token import FirstTokenRequest

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = [
    "continue_from_token",
    "first_token_request",
    "first_token_unsupported",
    "forget_first_token",
    "show_first_tokens_to_worker",
]


# First-token handoff (first_token.py).  Requests that continue from P's token, and
# the token each has yet to return to its client: one engine per process.
_unreturned_first_tokens: dict[str, int] = {}


_finished_first_tokens: set[str] = set()


_first_token_output_patched = False


def first_token_unsupported(vllm_config: Any) -> str | None:
    """Why this engine cannot continue from P's token at all, or None.

    The handoff shows the model runner P's token as the prompt's last (below);
    written and tested for the synchronous scheduler and the v1 model runner (what
    the CPU platform runs), without speculative decoding or custom logits
    processors, which see output tokens the runner would not count."""
    if vllm_config.scheduler_config.async_scheduling:
        return "async_scheduling"
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "v2_model_runner"
    if vllm_config.speculative_config is not None:
        return "speculative_decoding"
    if getattr(vllm_config.model_config, "logits_processors", None):
        return "custom_logits_processors"
    return None


def first_token_request(request: Request, max_model_len: int) -> FirstTokenRequest | None:
    """The handoff's view of a request's sampling (None for pooling requests)."""
    params = request.sampling_params
    if params is None:
        return None
    return FirstTokenRequest(
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        max_tokens=request.max_tokens, max_model_len=max_model_len,
        greedy=params.temperature < 1e-5, seed=params.seed,
        logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
        min_tokens=params.min_tokens or 0,
        presence_penalty=params.presence_penalty or 0.0,
        frequency_penalty=params.frequency_penalty or 0.0,
        has_bad_words=bool(params.bad_words),
        structured_output=request.use_structured_output,
        eos_token_id=params.eos_token_id,
        stop_token_ids=tuple(params.stop_token_ids or ()))


def continue_from_token(request: Request, token_id: int) -> None:
    """Make P's sampled token the request's first output, to be returned to the
    client with the first token D samples.

    The scheduler then counts it as output (``max_tokens``, stop checks, block
    hashes: D's KV at that position is the token's); ``show_first_tokens_to_worker``
    makes the model runner see it as the prompt's last token, whose KV D computes
    in its first step, sampling the token after it."""
    global _first_token_output_patched
    request.append_output_token_ids(token_id)
    _unreturned_first_tokens[request.request_id] = token_id
    if not _first_token_output_patched:
        _first_token_output_patched = True
        _return_first_tokens_with_output()


def forget_first_token(request_id: str) -> None:
    """The request finished.  Its token is dropped after the current (or next)
    ``update_from_output``: a request that finishes there returns it first."""
    if request_id in _unreturned_first_tokens:
        _finished_first_tokens.add(request_id)


def _return_first_tokens_with_output() -> None:
    """Prepend each handed-off token to its request's first ``EngineCoreOutput``.

    vLLM returns the tokens a step sampled; the handed-off one was sampled by P, so
    the client's first chunk carries it and D's first (as after a speculative step
    that accepted a token).  Patches ``Scheduler.update_from_output`` (the
    synchronous scheduler; ``first_token_unsupported`` rules out the others)."""
    cls = _scheduler.Scheduler
    original = cls.update_from_output

    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = original(self, scheduler_output, model_runner_output)
        if _unreturned_first_tokens:
            for engine_outputs in outputs.values():
                for output in engine_outputs.outputs:
                    if output.new_token_ids:
                        token_id = _unreturned_first_tokens.pop(output.request_id, None)
                        if token_id is not None:
                            output.new_token_ids = [token_id, *output.new_token_ids]
            for request_id in _finished_first_tokens:
                _unreturned_first_tokens.pop(request_id, None)
            _finished_first_tokens.clear()
        return outputs

    cls.update_from_output = update_from_output


def show_first_tokens_to_worker(scheduler_output: Any, first_tokens: dict[str, int]) -> None:
    """Give the model runner the prompt-plus-token view of handed-off requests.

    vLLM sends a new request's prompt (``NewRequestData.prompt_token_ids``) and no
    output, so the runner would compute the position after the prompt on a token it
    never got.  It gets the token as the prompt's last, and every later count of
    output tokens (``CachedRequestData.num_output_tokens``: the runner trims its own
    list to it after a failed load, and rebuilds it from it on a resume) one short,
    so the two views agree on every position."""
    if not first_tokens:
        return
    for new in scheduler_output.scheduled_new_reqs:
        token_id = first_tokens.get(new.req_id)
        if token_id is not None and new.prompt_token_ids is not None:
            new.prompt_token_ids = [*new.prompt_token_ids, token_id]
    cached = scheduler_output.scheduled_cached_reqs
    for index, request_id in enumerate(cached.req_ids):
        if request_id in first_tokens:
            cached.num_output_tokens[index] -= 1
