"""The official OpenAI Python client through the P/D proxy equals the co-located server.

A client we do not write: its own headers, its body encoding, its SSE parser.  Each
call goes through the proxy (P -> NIXL -> D) and to the co-located server at
temperature 0; the parsed results must be equal, errors of the same type and status.

Named to sort after test_pd_foundation, which starts the session's cluster.
"""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.cluster

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about the sea and the sky. " * 12}]
PROMPT = "The sea is wide and " * 20
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def clients(pd_cluster):
    def make(url):
        return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                             timeout=120)
    return make(pd_cluster.proxy), make(pd_cluster.colocated), pd_cluster.model


def _chat(model, **kw):
    def call(client):
        r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                           **kw)
        return ([(c.message.content, c.finish_reason,
                  [(t.token, round(t.logprob, 4)) for t in c.logprobs.content]
                  if c.logprobs else None) for c in r.choices],
                (r.usage.prompt_tokens, r.usage.completion_tokens))
    return call


def _chat_stream(model, **kw):
    def call(client):
        text, finish, usage, roles = {}, {}, None, []
        for chunk in client.chat.completions.create(model=model, messages=MESSAGES,
                                                    temperature=0, stream=True, **kw):
            if chunk.usage:
                usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for c in chunk.choices:
                roles += [c.delta.role] if c.delta.role else []
                text[c.index] = text.get(c.index, "") + (c.delta.content or "")
                finish[c.index] = c.finish_reason or finish.get(c.index)
        return text, finish, usage, roles
    return call


def _completion(model, prompt=PROMPT, **kw):
    def call(client):
        r = client.completions.create(model=model, prompt=prompt, temperature=0, **kw)
        return ([(c.text, c.finish_reason, c.logprobs and c.logprobs.tokens)
                 for c in r.choices], (r.usage.prompt_tokens, r.usage.completion_tokens))
    return call


def _completion_stream(model, **kw):
    def call(client):
        text, finish, usage = {}, {}, None
        for chunk in client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                               stream=True, **kw):
            if chunk.usage:
                usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for c in chunk.choices:
                text[c.index] = text.get(c.index, "") + c.text
                finish[c.index] = c.finish_reason or finish.get(c.index)
        return text, finish, usage
    return call


CASES = {
    "chat": lambda m: _chat(m, max_tokens=12),
    "chat-max-completion-tokens": lambda m: _chat(m, max_completion_tokens=9),
    "chat-logprobs": lambda m: _chat(m, max_tokens=5, logprobs=True, top_logprobs=3),
    "chat-seeded-n2": lambda m: _chat(m, max_tokens=6, n=2, seed=7,
                                      extra_body={"temperature": 0.8}),
    "chat-tool-choice-none": lambda m: _chat(m, max_tokens=6, tools=[TOOL],
                                             tool_choice="none"),
    "chat-prompt-cache-key": lambda m: _chat(m, max_tokens=6, prompt_cache_key="sdk-1"),
    "chat-extra-sampling": lambda m: _chat(m, max_tokens=8, extra_body={
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}),
    "chat-stream-usage": lambda m: _chat_stream(m, max_tokens=12,
                                                stream_options={"include_usage": True}),
    "chat-stream-continuous-usage": lambda m: _chat_stream(
        m, max_tokens=8, stream_options={"include_usage": True,
                                         "continuous_usage_stats": True}),
    "completion-echo-logprobs": lambda m: _completion(m, max_tokens=4, echo=True, logprobs=2),
    "completion-batch": lambda m: _completion(m, prompt=["a b c " * 30, "x y z " * 40],
                                              max_tokens=4),
    "completion-token-ids": lambda m: _completion(m, prompt=list(range(10, 200)),
                                                  max_tokens=4),
    "completion-stream-n2": lambda m: _completion_stream(
        m, max_tokens=5, n=2, seed=3, extra_body={"temperature": 0.9}),
    "completion-stream-usage": lambda m: _completion_stream(
        m, max_tokens=5, stream_options={"include_usage": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sdk_call_through_proxy_equals_colocated(clients, case):
    proxy, colocated, model = clients
    call = CASES[case](model)
    assert call(proxy) == call(colocated)


ERRORS = {
    "unknown-model": lambda c, m: c.chat.completions.create(
        model="no-such-model", messages=MESSAGES, max_tokens=3),
    "empty-messages": lambda c, m: c.chat.completions.create(model=m, messages=[],
                                                             max_tokens=3),
    "negative-max-tokens": lambda c, m: c.completions.create(model=m, prompt="hi",
                                                             max_tokens=-1),
    "context-overflow": lambda c, m: c.completions.create(model=m, prompt="hi " * 5000,
                                                          max_tokens=3),
    "tool-choice-auto-unconfigured": lambda c, m: c.chat.completions.create(
        model=m, messages=MESSAGES, max_tokens=3, tools=[TOOL]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_sdk_error_through_proxy_equals_colocated(clients, case):
    proxy, colocated, model = clients
    raised = []
    for client in (proxy, colocated):
        with pytest.raises(openai.APIStatusError) as info:
            ERRORS[case](client, model)
        raised.append((type(info.value).__name__, info.value.status_code))
    assert raised[0] == raised[1]
