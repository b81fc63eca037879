"""The OpenAI surface through the P/D proxy equals the co-located server.

Requests beyond the plain prompt-and-decode case, each sent through the proxy
(P -> NIXL -> D) and to the co-located server: every choice's text, token ids and
finish reason must be equal, its logprobs within the project's tolerance, and an
error must be an error in both with the same status.  Requests vLLM runs as several engine requests (a batch of prompts,
``n`` > 1) are the sharp case: P's one set of transfer parameters names one engine
request's KV, so the proxy sends them to D alone (checked here by the route header).

Named to sort after test_pd_foundation: that module starts the session's cluster
(its start-up time is checked) and measures the idle cluster's CPU before any test
here leaves P holding blocks no D read (a batch prompt's second prompt).
"""

from __future__ import annotations

import json

import pytest
import requests

from helpers import LOGPROB_TOLERANCE

pytestmark = pytest.mark.cluster

WORDS = "the vaqu is of zipe and dramon kato rimu senlo tola bric".split()


def _text(n: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


def _ids(n: int, step: int) -> list[int]:
    return [(i * step) % 900 + 20 for i in range(n)]


LONG = _text(400)
COMPLETION_CASES = {
    "batch-of-strings": {"prompt": [LONG, _text(300, 3)], "max_tokens": 8},
    "batch-of-token-id-lists": {"prompt": [_ids(300, 7), _ids(200, 5)], "max_tokens": 6},
    "echo": {"prompt": LONG, "max_tokens": 5, "echo": True},
    "echo-max-tokens-0": {"prompt": _text(100), "max_tokens": 0, "echo": True,
                          "logprobs": 2},
    "stop-strings": {"prompt": LONG, "max_tokens": 20, "stop": ["ka", "zi"]},
    "min-tokens-ignore-eos": {"prompt": LONG, "max_tokens": 10, "min_tokens": 5,
                              "ignore_eos": True},
    "logprobs-3": {"prompt": LONG, "max_tokens": 5, "logprobs": 3},
    "prompt-logprobs": {"prompt": _text(150), "max_tokens": 3, "prompt_logprobs": 1},
    "seeded-n-2": {"prompt": LONG, "max_tokens": 8, "temperature": 0.7, "n": 2,
                   "seed": 3},
    "logit-bias": {"prompt": LONG, "max_tokens": 6, "logit_bias": {"100": 50}},
    "penalties": {"prompt": LONG, "max_tokens": 8, "presence_penalty": 1.5,
                  "frequency_penalty": 0.5, "repetition_penalty": 1.3},
    "stream-with-usage": {"prompt": LONG, "max_tokens": 6, "stream": True,
                          "stream_options": {"include_usage": True}},
    "greedy-n-2-refused": {"prompt": LONG, "max_tokens": 6, "n": 2},
    "context-overflow": {"prompt": _text(5000), "max_tokens": 4},
    "max-tokens-over-context": {"prompt": LONG, "max_tokens": 100000},
}
CHAT_CASES = {
    "max-completion-tokens": {"max_completion_tokens": 7},
    "logprobs-top-2": {"max_tokens": 5, "logprobs": True, "top_logprobs": 2},
    "json-object": {"max_tokens": 12, "response_format": {"type": "json_object"}},
    "continue-final-message": {
        "messages": [{"role": "user", "content": LONG},
                     {"role": "assistant", "content": "kato rimu"}],
        "max_tokens": 6, "continue_final_message": True, "add_generation_prompt": False},
    "content-parts": {"messages": [{"role": "user",
                                    "content": [{"type": "text", "text": LONG}]}],
                      "max_tokens": 5},
    "stream-with-usage": {"max_tokens": 6, "stream": True,
                          "stream_options": {"include_usage": True}},
}


def _normalized(resp: requests.Response, stream: bool):
    """Status, and for a 200 what the client reads: per choice the text, token ids,
    finish reason and logprobs (ids, timestamps and engine names left out)."""
    if resp.status_code != 200:
        return resp.status_code, None
    if not stream:
        out = resp.json()
        choices = [{"text": c.get("text", (c.get("message") or {}).get("content")),
                    "token_ids": c.get("token_ids"), "finish": c.get("finish_reason"),
                    "logprobs": c.get("logprobs"), "prompt_logprobs": c.get("prompt_logprobs")}
                   for c in out["choices"]]
        usage = {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
        return 200, {"choices": choices, "usage": usage}
    merged: dict[int, dict] = {}
    usage = None
    for line in resp.text.splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = {k: event["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
        for c in event.get("choices") or ():
            slot = merged.setdefault(c["index"], {"text": "", "token_ids": [], "finish": None})
            text = c.get("text")
            if text is None:
                text = (c.get("delta") or {}).get("content") or ""
            slot["text"] += text
            slot["token_ids"] += c.get("token_ids") or []
            slot["finish"] = c.get("finish_reason") or slot["finish"]
    return 200, {"choices": [merged[i] for i in sorted(merged)], "usage": usage}


def _equal(a, b) -> bool:
    """Equal structures, floats (logprobs) within LOGPROB_TOLERANCE: P's prefill and
    the co-located engine's may round a last bit apart (3e-7 seen in float32)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= LOGPROB_TOLERANCE
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _compare(cluster, path: str, body: dict) -> requests.Response:
    stream = bool(body.get("stream"))
    got = requests.post(cluster.proxy + path, json=body, timeout=300)
    base = requests.post(cluster.colocated + path, json=body, timeout=300)
    proxied, colocated = _normalized(got, stream), _normalized(base, stream)
    assert _equal(proxied, colocated), (f"{path} {json.dumps(body)[:300]}\nproxy:     "
                                  f"{json.dumps(proxied)[:1500]}\nco-located: "
                                  f"{json.dumps(colocated)[:1500]}")
    return got


# Several engine requests each: D alone serves them.
SEVERAL_ENGINE_REQUESTS = {"batch-of-strings", "batch-of-token-id-lists", "seeded-n-2"}


@pytest.mark.parametrize("case", sorted(COMPLETION_CASES))
def test_completions_surface_equals_colocated(pd_cluster, case):
    body = {"model": pd_cluster.model, "temperature": 0, "return_token_ids": True,
            **COMPLETION_CASES[case]}
    got = _compare(pd_cluster, "/v1/completions", body)
    if case in SEVERAL_ENGINE_REQUESTS:
        assert got.headers.get("x-sessionkv-route") == "decode_only", got.headers


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_chat_surface_equals_colocated(pd_cluster, case):
    body = {"model": pd_cluster.model, "temperature": 0, "return_token_ids": True,
            "messages": [{"role": "user", "content": LONG}], **CHAT_CASES[case]}
    _compare(pd_cluster, "/v1/chat/completions", body)

