"""``resend_answer_ids`` on plain data: which chat requests may go as token ids, the
splice of a re-sent answer's generated ids, the completions request and the chat
answer built from its reply, the memory, and the option's start-up check.

The tiny model's tokenizer and chat template stand in for a real model's: an answer
whose ids are spelled one character each decodes to the text the template tokenizes
otherwise, as SmolLM2's generated ``L`` + ``ES`` re-tokenize as ``LES``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest

from sessionkv_proxy.chat_template import ChatRenderer
from sessionkv_proxy.config import ConfigError, load_config
from sessionkv_proxy.metrics import ProxyMetrics
from sessionkv_proxy.relay import Answer
from sessionkv_proxy.request import ClientRequest
from sessionkv_proxy.resent_answers import (
    ANSWER_IDS_HEADER,
    AnswerMemory,
    LastAnswer,
    ResentAnswers,
    answer_of,
    chat_answer,
    completions_body,
    ineligible,
    splice,
)
from sessionkv_proxy.server import Response
from sessionkv_proxy.tokenizer import LocalTokenizer

ENGINES = [{"url": "http://127.0.0.1:1", "role": "decode"}]
ANSWER = "hello world"


@pytest.fixture(scope="module")
def tok(tiny_model) -> LocalTokenizer:
    return LocalTokenizer.load(str(tiny_model))


@pytest.fixture()
def resent(tok) -> ResentAnswers:
    keys = SimpleNamespace(local_chat=ChatRenderer(tok), local_chat_ok=True,
                           request_templates_ok=False)
    return ResentAnswers(keys, max_sessions=4, metrics=ProxyMetrics())


def generated_ids(tok: LocalTokenizer, text: str) -> list[int]:
    """Ids that decode to ``text`` but are not its tokenization: one per character."""
    ids = [i for ch in text for i in tok.encode(ch, False)]
    assert tok.decode(ids) == text and ids != tok.encode(text, False)
    return ids


def chat(messages: list[dict], **extra) -> dict:
    return {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0, **extra}


def client_of(body: dict, session: str | None = "s1") -> ClientRequest:
    return ClientRequest(request_id="r", path="/v1/chat/completions", is_chat=True,
                         body=body, raw_body=json.dumps(body).encode(), session_id=session)


def completion_reply(text: str, ids: list[int], finish: str = "stop",
                     stop_reason=None) -> dict:
    return {"id": "cmpl-abc", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish, "stop_reason": stop_reason,
                         "token_ids": ids, "prompt_token_ids": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 9}}


def answered(reply: dict) -> Answer:
    return Answer(Response(200, msgspec.json.encode(reply), [("content-type", "application/json")],
                           content_type=None), 200, None, SimpleNamespace(url="d"))


@pytest.mark.parametrize("extra,session,reason", [
    ({}, None, "no session id"),
    ({"stream": True}, "s", "streamed"),
    ({"logprobs": True, "top_logprobs": 5}, "s", "field top_logprobs"),
    ({"logprobs": True}, "s", "logprobs"),
    ({"tools": []}, "s", "field tools"),
    ({"response_format": {"type": "json_object"}}, "s", "field response_format"),
    ({"n": 2}, "s", "n"),
])
def test_requests_the_completions_endpoint_cannot_serve_alike_stay_chat(extra, session,
                                                                         reason):
    assert ineligible(chat([], **extra), session) == reason
    assert ineligible({"model": "m", "messages": []}, "s") == "no max_tokens"
    assert ineligible(chat([], stream=False, logprobs=False, n=1), "s") is None


def test_the_answer_goes_back_as_the_ids_d_generated(tok):
    renderer = ChatRenderer(tok)
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    prompt_text, _ = renderer.render(chat(first))
    ids = generated_ids(tok, ANSWER)
    last = LastAnswer(prompt_text, tuple(tok.encode(prompt_text, False)), ANSWER, tuple(ids))
    second = first + [{"role": "assistant", "content": ANSWER},
                      {"role": "user", "content": "more"}]
    text, _ = renderer.render(chat(second))
    template = tok.encode(text, False)
    spliced = splice(text, template, last, tok.encode)
    head = [*last.prompt_ids, *ids]
    assert spliced[:len(head)] == head
    # After the answer, the template's own tokenization.
    assert spliced[len(head):] == template[len(template) - (len(spliced) - len(head)):]
    assert tok.decode(spliced) == text and spliced != template
    # Negative controls: a trimmed answer, an earlier prompt that differs.
    trimmed = first + [{"role": "assistant", "content": "hello"},
                       {"role": "user", "content": "more"}]
    text2, _ = renderer.render(chat(trimmed))
    assert splice(text2, tok.encode(text2, False), last, tok.encode) is None
    other = [{"role": "system", "content": "other"}, *second[1:]]
    text3, _ = renderer.render(chat(other))
    assert splice(text3, tok.encode(text3, False), last, tok.encode) is None


def toy_encode(text: str, add_special: bool = False) -> list[int]:
    """Characters as their code points, except "ab", one token."""
    out: list[int] = []
    i = 0
    while i < len(text):
        if text.startswith("ab", i):
            out.append(1000)
            i += 2
        else:
            out.append(ord(text[i]))
            i += 1
    return out


def test_a_rest_that_tokenizes_otherwise_alone_is_not_spliced():
    # The answer "xa" is followed by "b...": the template merges across the boundary
    # ("ab"), so the rest tokenized alone is not the template's tail.
    last = LastAnswer("p", (ord("p"),), "xa", (ord("x"), ord("a")))
    text = "pxabc"
    assert splice(text, toy_encode(text), last, toy_encode) is None
    # Control: where the boundary does not merge, the splice is made.
    text = "pxacc"
    assert splice(text, toy_encode(text), last, toy_encode) == toy_encode(text)


def test_completions_body_keeps_sampling_and_takes_max_completion_tokens():
    body = chat([{"role": "user", "content": "x"}], max_completion_tokens=5, seed=3,
                stop=["\n"], session_id="s", return_token_ids=False)
    out = completions_body(body, [1, 2, 3])
    assert out == {"model": "m", "temperature": 0, "seed": 3, "stop": ["\n"],
                   "session_id": "s", "max_tokens": 5, "prompt": [1, 2, 3],
                   "return_token_ids": True}


@pytest.mark.parametrize("finish,stop_reason,expected", [
    ("stop", None, [5, 6]),          # EOS: the last id is not in the text
    ("stop", 9, [5, 6]),             # a stop_token_ids token
    ("length", None, [5, 6, 7]),     # cut: every id is
    ("stop", "\n", None),            # a stop string: the ids run past the text
    ("abort", None, None),
])
def test_the_ids_behind_an_answers_text(finish, stop_reason, expected):
    got = answer_of(completion_reply("t", [5, 6, 7], finish, stop_reason))
    assert (got[1] if got else None) == expected


def test_the_client_gets_a_chat_answer(resent):
    reply = completion_reply("hi", [5, 6])
    reply["kv_transfer_params"] = {"x": 1}   # kept as the relay left it
    _, rewrite = resent.rewrite(client_of(chat([{"role": "user", "content": "x"}],
                                               return_token_ids=True)))
    out = chat_answer(reply, rewrite)
    assert out["object"] == "chat.completion" and out["id"] == "chatcmpl-abc"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == "hi"
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [5, 6]
    assert out["prompt_token_ids"] == list(rewrite.prompt_ids)
    assert out["usage"] == reply["usage"] and out["kv_transfer_params"] == {"x": 1}
    plain = rewrite.__class__(**{**{f: getattr(rewrite, f) for f in rewrite.__slots__},
                                 "return_token_ids": False})
    assert chat_answer(reply, plain)["choices"][0]["token_ids"] is None


def test_a_session_through_two_turns(resent, tok):
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    sent, rewrite = resent.rewrite(client_of(chat(first)))
    assert sent.path == "/v1/completions" and not sent.is_chat
    assert rewrite.outcome == "template"
    assert sent.body["prompt"] == list(rewrite.prompt_ids)
    ids = generated_ids(tok, ANSWER)
    eos = tok.encode("<|im_end|>", False)
    response = resent.finish(rewrite, answered(completion_reply(ANSWER, ids + eos)))
    assert dict(response.headers)[ANSWER_IDS_HEADER] == "template"
    assert json.loads(response.body)["choices"][0]["message"]["content"] == ANSWER
    assert resent.memory.get("s1").answer_ids == tuple(ids)

    second = first + [{"role": "assistant", "content": ANSWER},
                      {"role": "user", "content": "more"}]
    sent2, rewrite2 = resent.rewrite(client_of(chat(second)))
    assert rewrite2.outcome == "spliced"
    assert sent2.body["prompt"][:len(rewrite.prompt_ids) + len(ids)] == [
        *rewrite.prompt_ids, *ids]
    # Another session, or the same one with the answer trimmed: the template's ids.
    _, other = resent.rewrite(client_of(chat(second), session="s2"))
    assert other.outcome == "template"
    trimmed = first + [{"role": "assistant", "content": "hello"},
                       {"role": "user", "content": "more"}]
    _, cut = resent.rewrite(client_of(chat(trimmed)))
    assert cut.outcome == "template"
    # A streamed turn goes to the chat endpoint as text.
    streamed, none = resent.rewrite(client_of(chat(second, stream=True)))
    assert none is None and streamed.path == "/v1/chat/completions"


def test_ids_that_do_not_spell_the_text_are_not_remembered(resent, tok):
    _, rewrite = resent.rewrite(client_of(chat([{"role": "user", "content": "x"}])))
    resent.finish(rewrite, answered(completion_reply("other text", tok.encode("hi", False),
                                                     finish="length")))
    assert resent.memory.get("s1") is None


def test_the_memory_is_bounded():
    memory = AnswerMemory(2)
    for s in ("a", "b", "c"):
        memory.put(s, LastAnswer("p", (1,), "t", (2,)))
    assert len(memory) == 2 and memory.get("a") is None and memory.get("c") is not None


def test_the_option_needs_a_local_tokenizer(tiny_model):
    with pytest.raises(ConfigError, match="resend_answer_ids"):
        load_config(None, {"engines": ENGINES, "resend_answer_ids": True})
    config = load_config(None, {"engines": ENGINES, "resend_answer_ids": True,
                                "tokenizer": str(tiny_model)})
    assert config.resend_answer_ids and not load_config(
        None, {"engines": ENGINES}).resend_answer_ids
    with pytest.raises(ConfigError, match="resend_answer_ids_max_sessions"):
        load_config(None, {"engines": ENGINES, "resend_answer_ids": True,
                           "tokenizer": str(tiny_model), "resend_answer_ids_max_sessions": 0})


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b""])
def test_a_200_that_is_no_completions_answer_is_a_502(resent, tok, body):
    """An engine (or something in between) answering 200 with a body that is not a
    JSON object: the client gets a 502 naming the option, and the session's memory
    is dropped, not a crash or a chat answer made up from nothing."""
    _, rewrite = resent.rewrite(client_of(chat([{"role": "user", "content": "x"}])))
    resent.memory.put("s1", LastAnswer("p", (1,), "t", (2,)))
    broken = Answer(Response(200, body, [], content_type=None), 200, None,
                    SimpleNamespace(url="d"))
    response = resent.finish(rewrite, broken)
    assert response.status == 502 and b"resend_answer_ids" in response.body
    assert resent.memory.get("s1") is None
    # The control: a real answer still comes back as a chat answer.
    ok = resent.finish(rewrite, answered(completion_reply("hi", [5, 6], finish="length")))
    assert ok.status == 200
