"""A re-sent answer as the ids D generated (``resend_answer_ids``, off by default).

A chat client sends each answer back as text; the engine renders the template and
tokenizes it again, and where those ids differ from the ones D generated (SmolLM2
writes ``L`` + ``ES`` where its tokenizer merges ``LES``) D's KV stops matching the
prompt: verification refuses the block holding the difference and every block after
it (docs/benchmarks/retokenization.md).  Refusing only the differing block would not
do: every later block's KV was computed under the other tokens.

With the option on, the proxy remembers per session the prompt it sent last (text
and ids) and the ids D generated for the answer; when the client's next chat request
renders to that prompt followed by exactly that answer's text, the proxy sends the
prompt as token ids to ``/v1/completions``: the remembered prompt, the answer's own
ids, then the rest as the template tokenizes it.  The model sees what it generated,
not the template's tokenization of its text, so the answer equals a co-located
server's given the same prompt ids (not given the same messages).  The completions
answer goes back to the client in chat form.

Only requests the completions endpoint serves as the chat endpoint would take this
path (:func:`ineligible`): non-streamed, one choice, a session id, no tools, no
logprobs, no response format, ``max_tokens`` given (completions' default is 16, the
chat endpoint's the rest of the context), and chat prompts the proxy renders itself
(``tokenizer`` a model directory, its chat template checked against an engine's).
Others go to the chat endpoint as text, as without the option.  Engines started
with a reasoning parser must not be used with it (completions answers are not
parsed).  The memory is this replica's: a turn served by another replica goes as
text.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from sessionkv_proxy.errors import ApiError, error_response
from sessionkv_proxy.metrics import ProxyMetrics
from sessionkv_proxy.prompt_keys import PromptKeys
from sessionkv_proxy.relay import Answer
from sessionkv_proxy.request import ClientRequest
from sessionkv_proxy.server import Response

__all__ = ["ANSWER_IDS_HEADER", "AnswerMemory", "LastAnswer", "ResentAnswers", "Rewrite",
           "answer_of", "chat_answer", "completions_body", "ineligible", "splice"]

logger = logging.getLogger("sessionkv_proxy.resent_answers")

ANSWER_IDS_HEADER = "x-sessionkv-answer-ids"
COMPLETIONS_PATH = "/v1/completions"

# Chat fields the completions endpoint reads the same way; a request with any other
# goes to the chat endpoint as text.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                    "stop_token_ids", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens", "ignore_eos", "n", "user",
                    "session_id", "prompt_cache_key", "skip_special_tokens",
                    "spaces_between_special_tokens")
_ELIGIBLE_FIELDS = frozenset(_SAMPLING_FIELDS) | {
    "model", "messages", "max_tokens", "max_completion_tokens", "stream", "logprobs",
    "return_token_ids"}

_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()


@dataclass(frozen=True, slots=True)
class LastAnswer:
    """A session's last turn as the proxy sent it and D answered it."""

    prompt_text: str               # the rendered prompt (template text)
    prompt_ids: tuple[int, ...]    # the ids sent for it (themselves maybe spliced)
    answer_text: str               # what the client got, and re-sends
    answer_ids: tuple[int, ...]    # the ids D generated for that text (no stop token)


@dataclass(frozen=True, slots=True)
class Rewrite:
    """A chat request sent on as a completions request with token ids."""

    session_id: str
    prompt_text: str
    prompt_ids: tuple[int, ...]
    return_token_ids: bool
    outcome: str   # spliced, same (the answer's ids are the template's), template


def ineligible(body: dict[str, Any], session_id: str | None) -> str | None:
    """Why a chat request cannot go as token ids to the completions endpoint and mean
    the same (None: it can)."""
    if not session_id:
        return "no session id"
    extra = body.keys() - _ELIGIBLE_FIELDS
    if extra:
        return f"field {sorted(extra)[0]}"
    if body.get("stream"):
        return "streamed"
    if body.get("logprobs"):
        return "logprobs"
    if body.get("n") not in (None, 1):
        return "n"
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        return "no max_tokens"
    return None


def splice(text: str, template_ids: list[int], last: LastAnswer,
           encode: Callable[[str, bool], list[int]]) -> list[int] | None:
    """The prompt's ids with the last answer re-sent as D's ids, or None when ``text``
    is not the last prompt followed by that answer's exact text, or when the part
    after it would tokenize otherwise than in the template's ids."""
    head = last.prompt_text + last.answer_text
    if not text.startswith(head) or len(text) == len(head):
        return None
    rest_ids = encode(text[len(head):], False)
    if not rest_ids or template_ids[-len(rest_ids):] != rest_ids:
        return None
    return [*last.prompt_ids, *last.answer_ids, *rest_ids]


def completions_body(body: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """An eligible chat request as a completions request for ``prompt_ids``."""
    out: dict[str, Any] = {k: body[k] for k in ("model", *_SAMPLING_FIELDS) if k in body}
    max_tokens = body.get("max_completion_tokens")
    out["max_tokens"] = body.get("max_tokens") if max_tokens is None else max_tokens
    out["prompt"] = prompt_ids
    out["return_token_ids"] = True
    return out


def answer_of(out: dict[str, Any]) -> tuple[str, list[int]] | None:
    """(text, the ids that produced it) of a completions answer's one choice: the ids
    D holds KV for, less a stop token (EOS or a ``stop_token_ids`` one), which is not
    in the text.  None where they cannot be told (a stop string: the ids run past the
    text)."""
    choices = out.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        return None
    choice = choices[0]
    text, ids = choice.get("text"), choice.get("token_ids")
    if not isinstance(text, str) or not isinstance(ids, list) or not ids:
        return None
    finish = choice.get("finish_reason")
    if finish == "stop" and not isinstance(choice.get("stop_reason"), str):
        return text, ids[:-1]
    if finish == "length":
        return text, ids
    return None


def chat_answer(out: dict[str, Any], rewrite: Rewrite) -> dict[str, Any]:
    """A completions answer in the chat endpoint's form."""
    chat_choices = []
    for choice in out.get("choices") or ():
        chat_choices.append({
            "index": choice.get("index", 0),
            "message": {"role": "assistant", "content": choice.get("text"),
                        "refusal": None, "annotations": None, "audio": None,
                        "function_call": None, "reasoning": None},
            "logprobs": None, "finish_reason": choice.get("finish_reason"),
            "stop_reason": choice.get("stop_reason"),
            "token_ids": choice.get("token_ids") if rewrite.return_token_ids else None})
    answer_id = str(out.get("id", ""))
    rest = {k: v for k, v in out.items() if k not in ("id", "object", "choices")}
    return {"id": "chatcmpl-" + answer_id.removeprefix("cmpl-"),
            "object": "chat.completion", **rest, "choices": chat_choices,
            "prompt_token_ids": list(rewrite.prompt_ids) if rewrite.return_token_ids
            else None}


class AnswerMemory:
    """Each session's last answer, the least recently used dropped past a bound."""

    def __init__(self, max_sessions: int) -> None:
        self._max = max_sessions
        self._last: OrderedDict[str, LastAnswer] = OrderedDict()

    def get(self, session_id: str) -> LastAnswer | None:
        last = self._last.get(session_id)
        if last is not None:
            self._last.move_to_end(session_id)
        return last

    def put(self, session_id: str, last: LastAnswer) -> None:
        self._last[session_id] = last
        self._last.move_to_end(session_id)
        while len(self._last) > self._max:
            self._last.popitem(last=False)

    def drop(self, session_id: str) -> None:
        self._last.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._last)


class ResentAnswers:
    """The turn's two steps: :meth:`rewrite` before routing, :meth:`finish` on the
    answer."""

    def __init__(self, prompt_keys: PromptKeys, max_sessions: int,
                 metrics: ProxyMetrics) -> None:
        self._keys = prompt_keys
        self._metrics = metrics
        self.memory = AnswerMemory(max_sessions)

    def rewrite(self, client: ClientRequest) -> tuple[ClientRequest, Rewrite | None]:
        """The request to route and send: the client's, or a completions request with
        token ids (and what to answer the client with)."""
        if not client.is_chat:
            return client, None
        reason = ineligible(client.body, client.session_id)
        chat = self._keys.local_chat
        if reason is None and (chat is None or not self._keys.local_chat_ok):
            reason = "no checked local chat template"
        if reason is None:
            try:
                text, add_special = chat.render(client.body, self._keys.request_templates_ok)
            except Exception as exc:   # declined, or the template refused it
                reason = f"not rendered here: {exc!r}"
        if reason is not None:
            self._metrics.resent_answers.labels("chat_text").inc()
            logger.debug("request_id=%s as text: %s", client.request_id, reason)
            return client, None
        encode = chat.tokenizer.encode
        template_ids = encode(text, add_special)
        last = self.memory.get(client.session_id)
        ids = splice(text, template_ids, last, encode) if last is not None else None
        outcome = ("template" if ids is None else
                   "same" if ids == template_ids else "spliced")
        self._metrics.resent_answers.labels(outcome).inc()
        prompt_ids = template_ids if ids is None else ids
        body = completions_body(client.body, prompt_ids)
        rewrite = Rewrite(session_id=client.session_id, prompt_text=text,
                          prompt_ids=tuple(prompt_ids),
                          return_token_ids=bool(client.body.get("return_token_ids")),
                          outcome=outcome)
        return ClientRequest(request_id=client.request_id, path=COMPLETIONS_PATH,
                             is_chat=False, body=body, raw_body=_json.encode(body),
                             session_id=client.session_id,
                             hold_hint_s=client.hold_hint_s), rewrite

    def finish(self, rewrite: Rewrite, answer: Answer) -> Response | None:
        """The client's answer in chat form; the session's answer remembered."""
        response = answer.response
        if response is None or answer.status != 200:
            self.memory.drop(rewrite.session_id)
            return response
        try:
            out = _decode.decode(response.body)
        except msgspec.DecodeError:
            out = None
        if not isinstance(out, dict):
            # vLLM's completions endpoint answers JSON objects; anything else is a
            # broken engine or something in between, not an answer to translate.
            self.memory.drop(rewrite.session_id)
            return error_response(ApiError(
                502, "the engine answered the completions request the chat turn went "
                     "as (resend_answer_ids) with a body that is not a JSON object"))
        got = answer_of(out)
        decode = self._keys.local_chat.tokenizer.decode if self._keys.local_chat else None
        # The ids must account for the text exactly (nothing skipped, nothing cut).
        if got is not None and decode is not None and decode(got[1]) == got[0]:
            self.memory.put(rewrite.session_id, LastAnswer(
                prompt_text=rewrite.prompt_text, prompt_ids=rewrite.prompt_ids,
                answer_text=got[0], answer_ids=tuple(got[1])))
        else:
            self.memory.drop(rewrite.session_id)
        headers = [*response.headers, (ANSWER_IDS_HEADER, rewrite.outcome)]
        return Response(200, _json.encode(chat_answer(out, rewrite)), headers,
                        content_type=None)
