"""What the proxy learns from the engines at start-up, each as a value returned.

:func:`check_tokenizer` compares the local tokenizer and chat template with an
engine's ``/tokenize`` and returns a :class:`TokenizerVerdict`, which
:class:`~sessionkv_proxy.prompt_keys.PromptKeys` applies; :func:`discover_models`
returns the served models.  Neither changes anything itself.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from sessionkv_proxy.chat_template import PROBES as CHAT_PROBES
from sessionkv_proxy.chat_template import REQUEST_TEMPLATE_PROBE, ChatRenderer
from sessionkv_proxy.errors import ApiError
from sessionkv_proxy.tokenizer import PROBES, LocalTokenizer, first_mismatch

__all__ = ["ModelCatalog", "ServedModels", "TokenizerVerdict", "Verdict", "check_tokenizer",
           "discover_models"]

logger = logging.getLogger("sessionkv_proxy.startup_checks")

EngineIds = Callable[[dict[str, Any], bool], Awaitable[list[int] | None]]


class Verdict(enum.Enum):
    UNKNOWN = "unknown"    # no engine answered: ask again on a later request
    MATCH = "match"
    MISMATCH = "mismatch"


@dataclass(frozen=True, slots=True)
class TokenizerVerdict:
    """Whether the local tokenizer gives the engine's ids (completions), the local
    chat template too (chat), and whether the engines accept a request's own
    chat_template and render it as the proxy does."""

    completions: Verdict
    chat: Verdict = Verdict.UNKNOWN
    request_templates: bool = False


async def check_tokenizer(local: LocalTokenizer, chat: ChatRenderer | None,
                          engine_ids: EngineIds, completions_known: bool
                          ) -> TokenizerVerdict:
    """Compare the local tokenizer with an engine's /tokenize on a few probes
    (unless ``completions_known``: an earlier check matched), then the local chat
    template (``chat``; None: not to check) on a few conversations.  A mismatch
    would make every index lookup miss, so it is a verdict for the rest of the
    process life; when no engine answers there is none yet."""
    completions = Verdict.MATCH if completions_known else \
        await _check_completions(local, engine_ids)
    if completions is not Verdict.MATCH or chat is None:
        return TokenizerVerdict(completions)
    chat_verdict, request_templates = await _check_chat(chat, engine_ids)
    return TokenizerVerdict(completions, chat_verdict, request_templates)


async def _check_completions(local: LocalTokenizer, engine_ids: EngineIds) -> Verdict:
    cases = [(p, special) for special in (True, False) for p in PROBES]

    async def theirs_of(case: tuple[str, bool]) -> list[int] | None:
        return await engine_ids({"prompt": case[0], "add_special_tokens": case[1]}, False)

    try:
        # One probe first: an unreachable engine costs one timeout, not one per probe.
        theirs = [await theirs_of(cases[0])]
        if theirs[0] is not None:
            theirs += await asyncio.gather(*map(theirs_of, cases[1:]))
    except ApiError as exc:
        theirs = [None]
        logger.warning("local tokenizer check: an engine refused a probe: %s", exc.message)
    if any(ids is None for ids in theirs):
        logger.info("local tokenizer check: no engine answered /tokenize; trying again "
                    "on a later request, the engine tokenizes until then")
        return Verdict.UNKNOWN
    bad = first_mismatch(cases, [local.encode(p, special) for p, special in cases], theirs)
    if bad is not None:
        logger.error("local tokenizer %s differs from the engine's /tokenize on probe %r "
                     "(add_special_tokens=%s); the engine tokenizes from now on",
                     local.path, bad[0], bad[1])
        return Verdict.MISMATCH
    logger.info("local tokenizer %s matches the engine on %d probes; completions "
                "prompts are tokenized in the proxy", local.path, len(cases))
    return Verdict.MATCH


async def _check_chat(chat: ChatRenderer, engine_ids: EngineIds) -> tuple[Verdict, bool]:
    """The chat probes: each conversation's ids from the local template against the
    engine's /tokenize with ``messages`` (both refusing a probe counts as agreeing).
    Then whether the engines accept a request's own chat_template and render it the
    same; until seen, such requests go to /tokenize."""

    async def engine_outcome(body: dict[str, Any]) -> list[int] | str | None:
        try:
            return await engine_ids(dict(body), True)
        except ApiError:
            return "refused"

    def local_outcome(body: dict[str, Any], request_templates: bool) -> list[int] | str:
        try:
            return chat.ids(dict(body), request_templates)
        except Exception:
            return "refused"

    theirs = await asyncio.gather(*map(engine_outcome, CHAT_PROBES))
    if any(ids is None for ids in theirs):
        logger.info("local chat template check: no engine answered /tokenize; trying "
                    "again on a later request, the engine tokenizes chat until then")
        return Verdict.UNKNOWN, False
    ours = [local_outcome(body, False) for body in CHAT_PROBES]
    bad = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if bad is not None or all(ids == "refused" for ids in theirs):
        probe = 0 if bad is None else bad
        logger.error("local chat template of %s differs from the engine's /tokenize on "
                     "probe %d %s (local: %s, engine: %s); the engine tokenizes chat "
                     "prompts from now on", chat.model_dir, probe,
                     json.dumps(CHAT_PROBES[probe], ensure_ascii=False)[:300],
                     str(ours[probe])[:200], str(theirs[probe])[:200])
        return Verdict.MISMATCH, False
    template_ids = await engine_outcome(REQUEST_TEMPLATE_PROBE)
    request_templates = (isinstance(template_ids, list) and template_ids
                         == local_outcome(REQUEST_TEMPLATE_PROBE, True))
    logger.info("local chat template of %s matches the engine on %d conversations; chat "
                "prompts are tokenized in the proxy (a request's own chat_template: %s)",
                chat.model_dir, len(CHAT_PROBES),
                "in the proxy" if request_templates else "by the engine")
    return Verdict.MATCH, request_templates


@dataclass(frozen=True, slots=True)
class ServedModels:
    """The engines' ``/v1/models``: the ids a request may name, and the body the
    proxy answers ``/v1/models`` with."""

    ids: frozenset[str]
    body: bytes


async def discover_models(http: aiohttp.ClientSession, urls: Sequence[str]
                          ) -> ServedModels | None:
    """The first engine's answer to ``/v1/models`` (in ``urls`` order), or None."""
    for url in urls:
        try:
            async with http.get(url + "/v1/models",
                                timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    continue
                data = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            continue
        out = msgspec.json.decode(data)
        ids = {m.get("id") for m in out.get("data", []) if isinstance(m, dict)}
        return ServedModels(frozenset(i for i in ids if isinstance(i, str)), data)
    return None


class ModelCatalog:
    """The served models, as the first engine that answers ``/v1/models`` names them
    (decode engines asked first); empty until one has answered."""

    def __init__(self, http: aiohttp.ClientSession, urls: Sequence[str]) -> None:
        self._http = http
        self._urls = list(urls)
        self.ids: frozenset[str] = frozenset()
        self.body = b""

    def set_urls(self, urls: Sequence[str]) -> None:
        """The engines to ask from now on (the engine set changed)."""
        self._urls = list(urls)

    async def refresh(self) -> None:
        served = await discover_models(self._http, self._urls)
        if served is not None:
            self.ids, self.body = served.ids, served.body
