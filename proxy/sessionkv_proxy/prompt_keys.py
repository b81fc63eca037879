"""A prompt's token ids and block keys, as the engines will see them.

Token ids come from the engine's ``/tokenize``, or, once they matched the engine's
at start-up (:mod:`sessionkv_proxy.startup_checks`), from the same tokenizer
in-process for completions text and from the model's chat template rendered
in-process for chat, so they equal vLLM's; or, with ``tokenizer: text``, there are
no ids: the keys are over the prompt's text, for pools without KV events.  The block
keys are the connector's request keys over those ids (or over the text), salted
with the request's tenant.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from vllm_sessionkv.wire.hashing import request_keys

from sessionkv_proxy.block_size import BlockSize
from sessionkv_proxy.chat_template import ChatRenderer
from sessionkv_proxy.config import ProxyConfig
from sessionkv_proxy.engines import EnginePool
from sessionkv_proxy.errors import ApiError
from sessionkv_proxy.keys import text_keys
from sessionkv_proxy.startup_checks import TokenizerVerdict, Verdict, check_tokenizer
from sessionkv_proxy.text_ids import ExtendingIds
from sessionkv_proxy.tokenizer import LocalTokenizer
from sessionkv_proxy.upstream import UpstreamPool

__all__ = ["CHARS_PER_TOKEN", "PromptKeys", "estimate_tokens", "prompt_text"]

logger = logging.getLogger("sessionkv_proxy.prompt_keys")

_json = msgspec.json.Encoder()
# Characters per token for a prompt the router has no token ids of: enough to tell a
# long prompt from a short one, and the size of a text key's block in tokens.
CHARS_PER_TOKEN = 3
# What /tokenize takes of a chat request.
_CHAT_TOKENIZE_FIELDS = ("model", "messages", "add_generation_prompt",
                         "continue_final_message", "chat_template", "chat_template_kwargs",
                         "tools", "add_special_tokens")


class PromptKeys:
    """Token ids and block keys of prompts; owns the local tokenizer and its check.

    Completions string prompts are tokenized here once the local ids matched an
    engine's (``local_tokenizer_ok``); chat requests likewise with the model's chat
    template (``local_chat_ok``), and a request's own chat_template only once the
    engines were seen to accept one and render it the same
    (``request_templates_ok``).  Until a check gave its verdict, a request starts
    one in the background; a mismatch drops the local tokenizer for good."""

    def __init__(self, config: ProxyConfig, block_size: BlockSize, pool: EnginePool,
                 upstream: UpstreamPool, on_error: Callable[[str], None]) -> None:
        self._config = config
        self._pool = pool
        self._upstream = upstream  # the hot path's client, also for /tokenize
        self._on_error = on_error
        self._block_size = block_size   # configured, or learned from KV events
        # Keys over the prompt's text instead of its token ids (``tokenizer: text``).
        self.text_keys = config.tokenizer == "text"
        self.local_tokenizer = (None if config.tokenizer in ("engine", "none", "text")
                                else LocalTokenizer.load(config.tokenizer))
        self.local_tokenizer_ok = False
        self.local_chat: ChatRenderer | None = None
        # A chat session's prompt ids, from its last turn's (text_ids.py).
        self.chat_ids: ExtendingIds | None = None
        if self.local_tokenizer is not None:
            self.chat_ids = ExtendingIds(self.local_tokenizer.backend)
            renderer = ChatRenderer(self.local_tokenizer)
            if renderer.unusable:
                logger.info("chat prompts are tokenized by the engine: %s", renderer.unusable)
            else:
                self.local_chat = renderer
        self.local_chat_ok = False
        self.request_templates_ok = False
        self._check: asyncio.Task | None = None

    # ------------------------------------------------------------ the local check
    async def check_local(self) -> None:
        """Compare the local tokenizer (and chat template) with an engine's, and use
        them from now on if they match (see :func:`check_tokenizer`)."""
        if self.local_tokenizer is None:
            return
        verdict = await check_tokenizer(
            self.local_tokenizer, None if self.local_chat_ok else self.local_chat,
            self.engine_token_ids, completions_known=self.local_tokenizer_ok)
        self.apply(verdict)

    def apply(self, verdict: TokenizerVerdict) -> None:
        """Take a check's verdict: a match turns the local path on, a mismatch drops
        it for the rest of the process life, no verdict changes nothing."""
        if verdict.completions is Verdict.MISMATCH:
            self.local_tokenizer = self.local_chat = None
            self._on_error("local_tokenizer_mismatch")
            return
        if verdict.completions is Verdict.MATCH:
            self.local_tokenizer_ok = True
        if verdict.chat is Verdict.MISMATCH:
            self.local_chat = None
            self._on_error("local_chat_template_mismatch")
        elif verdict.chat is Verdict.MATCH:
            self.local_chat_ok = True
            self.request_templates_ok = verdict.request_templates

    def _check_later(self) -> None:
        """Start the check against the engine, unless one is running."""
        if self._check is None or self._check.done():
            self._check = asyncio.create_task(self.check_local())

    # ------------------------------------------------------------ token ids
    async def token_ids(self, body: dict[str, Any], is_chat: bool,
                        session_key: str | None = None) -> list[int] | None:
        """The prompt's token ids exactly as the engines will see them, or None.
        ``session_key``: the session's (with its tenant), under which a chat prompt's
        ids are kept for its next turn's."""
        if not is_chat:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            local = self.local_tokenizer
            if local is not None and isinstance(prompt, str):
                if self.local_tokenizer_ok:
                    ids = local.ids_for_completion(body)
                    if ids is not None:
                        return ids
                else:
                    self._check_later()
        elif self.local_chat is not None:
            if self.local_chat_ok:
                try:
                    # ChatRenderer.ids, the text tokenized from the last turn's.
                    text, add_special = self.local_chat.render(body, self.request_templates_ok)
                    return self.chat_ids.ids(session_key, text, add_special)
                except Exception as exc:   # declined, or the template refused it
                    logger.debug("chat prompt tokenized by the engine: %r", exc)
            else:
                self._check_later()
        return await self.engine_token_ids(body, is_chat)

    async def engine_token_ids(self, body: dict[str, Any], is_chat: bool
                               ) -> list[int] | None:
        """The prompt's token ids from an engine's ``/tokenize``, or None (no engine
        answered, a batch of prompts, ``tokenizer: none``); an engine's refusal of
        the prompt is the client's 4xx."""
        if self._config.tokenizer == "none":
            return None
        req = _tokenize_request(body, is_chat)
        if req is None:
            return None  # batched prompts: route on load only
        engines = [e for e in self._pool.engines if e.available] or self._pool.engines
        engine = engines[0]
        try:
            resp = await self._upstream.post(engine.url, "/tokenize", _json.encode(req))
            status, data = resp.status, await resp.read()
        except (OSError, asyncio.TimeoutError) as exc:
            logger.warning("tokenize on %s failed: %r; routing on load only", engine.url, exc)
            return None
        if status >= 400:
            if status < 500:
                raise ApiError(status, "cannot tokenize the prompt: "
                               f"{data[:500].decode(errors='replace')}")
            return None
        try:
            out = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return None
        tokens = out.get("tokens") if isinstance(out, dict) else None
        return tokens if isinstance(tokens, list) else None

    async def content_keys(self, body: dict[str, Any], is_chat: bool, tenant: str | None,
                           session_key: str | None = None
                           ) -> tuple[list[int] | None, list[int]]:
        """(token ids, block keys) of the prompt: keys over its token ids, or over its
        text with ``tokenizer: text`` (no ids then, unless the client sent ids)."""
        if self.text_keys:
            text = prompt_text(body, is_chat)
            if text is not None:
                return None, text_keys(text, self._block_size.tokens * CHARS_PER_TOKEN,
                                       tenant)
            # Not text: ids the client sent (keyed as ids), or a batch (no keys; no
            # /tokenize call either, ``token_ids`` asks it only for a string).
        token_ids = await self.token_ids(body, is_chat, session_key)
        return token_ids, (request_keys(token_ids, self._block_size.tokens, salt=tenant)
                           if token_ids else [])


def _tokenize_request(body: dict[str, Any], is_chat: bool) -> dict[str, Any] | None:
    """The ``/tokenize`` body for a request's prompt; None for a batch of prompts."""
    if not is_chat:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        req = {"model": body.get("model"), "prompt": prompt}
        if "add_special_tokens" in body:
            req["add_special_tokens"] = body["add_special_tokens"]
        return req
    req = {k: body[k] for k in _CHAT_TOKENIZE_FIELDS if k in body}
    req.setdefault("add_generation_prompt", True)
    # Fields /tokenize lacks but the chat endpoint passes to the template (vLLM's
    # ChatCompletionRequest.build_chat_params): as template kwargs.
    kwargs = body.get("chat_template_kwargs") or {}
    effort = body.get("reasoning_effort")
    extra = {k: body[k] for k in ("documents", "reasoning_effort") if body.get(k) is not None}
    if effort is not None and isinstance(kwargs, dict) and "enable_thinking" not in kwargs:
        extra["enable_thinking"] = effort != "none"
    if extra and isinstance(kwargs, dict):
        req["chat_template_kwargs"] = {**kwargs, **extra}
    return req


def estimate_tokens(body: dict[str, Any], is_chat: bool) -> int:
    """The prompt's size in tokens, from its text (``CHARS_PER_TOKEN``)."""
    if not is_chat:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt) // CHARS_PER_TOKEN
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)
        return len(json.dumps(prompt, default=str)) // CHARS_PER_TOKEN
    chars = 0
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        chars += len(content) if isinstance(content, str) else \
            len(json.dumps(content, default=str))
    return chars // CHARS_PER_TOKEN


def prompt_text(body: dict[str, Any], is_chat: bool) -> bytes | None:
    """What ``tokenizer: text`` keys a prompt on: a completions string as UTF-8, a
    chat request's tools and messages as JSON (a conversation's next turn re-sends
    them with more at the end, so its text extends the last turn's); None for a
    batch of prompts."""
    if is_chat:
        tools = body.get("tools")
        messages = _json.encode(body.get("messages"))
        return _json.encode(tools) + messages if tools else messages
    prompt = body.get("prompt")
    return prompt.encode("utf-8", "surrogatepass") if isinstance(prompt, str) else None
