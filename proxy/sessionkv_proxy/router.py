"""Gathers what a routing decision needs and asks the policy.

The policy (``policy.py``) is a pure function of plain data.  This module does the
I/O around it: token ids for the prompt (the engine's ``/tokenize``, or, once
they matched the engine's at start-up, the same tokenizer in-process for
completions text and the model's chat template rendered in-process for chat, so
they equal vLLM's; or, with ``tokenizer: text``, no ids: keys over the prompt's
text, for pools without KV events), then the session record, the engines' published
handle and the index lookup in one read (``KVIndex.route_read``: one Redis round
trip, or none in-process), and the engines' load.  What the decision writes (a
consumed handle cleared from the record, an unused published handle given back, the
record after the answer) goes out behind the request.  A wrong or stale answer here costs speed
only: the connector verifies every block it attaches.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_sessionkv.wire.hashing import request_keys
from vllm_sessionkv.wire.protocol import (
    SessionHandle,
    handle_expired,
    session_store_key,
)

from sessionkv_proxy.block_size import BlockSize
from sessionkv_proxy import policy
from sessionkv_proxy.config import ProxyConfig
from sessionkv_proxy.policy import Mode, Role, RouteReason
from sessionkv_proxy.engines import Engine, EnginePool
from sessionkv_proxy.errors import ApiError
from sessionkv_proxy.index.base import TIER_DEVICE, KVIndex, RouteRead
from sessionkv_proxy.keys import text_keys
from sessionkv_proxy.recent import RecentRoutes
from sessionkv_proxy.chat_template import ChatRenderer
from sessionkv_proxy.tokenizer import LocalTokenizer
from sessionkv_proxy.upstream import UpstreamPool
from sessionkv_proxy.sessions import (
    HandleUnreadable,
    SessionRecord,
    decode_published_handle,
    decode_record,
    encode_record,
)

__all__ = ["CHARS_PER_TOKEN", "RoutePlan", "Router", "engine_requests", "prompt_text",
           "request_tenant"]

logger = logging.getLogger("sessionkv_proxy.router")

_json = msgspec.json.Encoder()


@dataclass
class RoutePlan:
    mode: Mode
    prefill: Engine | None
    decode: Engine
    reason: RouteReason
    prefill_params: dict[str, Any] | None = None   # kv_transfer_params for P
    prompt_keys: list[int] = field(default_factory=list)
    terms: dict[str, Any] = field(default_factory=dict)
    handle_outcome: str = "none"
    prompt_tokens: int = 0
    max_output_tokens: int | None = None  # the request's cap on new tokens, as vLLM reads it
    # The request's tenant (vLLM's cache_salt): read once, here, for every store key.
    tenant: str | None = None
    # Why this decision had less to go on than usual (e.g. Redis unavailable: the
    # index and sessions were read from this replica's own copy); None when not.
    degraded: str | None = None
    # HOST_TIER_PULL: D first restores this many prompt tokens (``prompt_token_ids``)
    # from its host tier as a one-token session turn, and P pulls them by its handle.
    restore_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    # Prompt tokens the chosen D holds on neither device nor host (the policy's
    # ``uncached_tokens``); the whole prompt where no policy ran.
    uncached_tokens: int | None = None

    @property
    def decode_work_tokens(self) -> int:
        """What this request queues on D while it runs: the prompt tokens D prefills
        itself (none when P prefills) plus the output tokens it may generate."""
        outputs = self.max_output_tokens or DEFAULT_OUTPUT_ESTIMATE
        if self.mode is not Mode.DECODE_ONLY:
            return outputs
        uncached = self.prompt_tokens if self.uncached_tokens is None else self.uncached_tokens
        return uncached + outputs


class Router:
    def __init__(self, config: ProxyConfig, pool: EnginePool, index: KVIndex,
                 upstream: UpstreamPool, rng: random.Random | None = None):
        self.config = config
        self.upstream = upstream  # the hot path's client, also for /tokenize
        self.pool = pool
        self.index = index
        # The index reads the engines' published handles too (``route_read``).
        # Writes behind the requests (session records, handles given back): the newest
        # record per session key not yet written, its writer, and every such task.
        self._unwritten: dict[str, bytes] = {}
        self._writers: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self.on_write_error: Callable[[str], None] = lambda kind: None
        self.rng = rng or random.Random()
        self.params = policy.routing_params_from_config(config.routing.params)
        # KV bytes per token of the served model, to price peer pulls; 0 = unknown,
        # then the policy credits pullable blocks with a fixed weight.
        self.kv_bytes_per_token = float(config.routing.params.get("kv_bytes_per_token", 0.0))
        self._rr = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}
        self.recent = RecentRoutes(ttl_s=config.routing.recent_routes_ttl_s)
        # The engines' KV block size (configured, or learned by the event consumer).
        self.block_size = BlockSize(config.block_size)
        # Completions string prompts are tokenized here once these ids matched an
        # engine's (``local_tokenizer_ok``); the app sets ``check_local_tokenizer``,
        # run in the background on a request while no check has given a verdict, and
        # drops ``local_tokenizer`` on a mismatch.
        self.local_tokenizer = (None if config.tokenizer in ("engine", "none", "text")
                                else LocalTokenizer.load(config.tokenizer))
        # Keys over the prompt's text instead of its token ids (``tokenizer: text``).
        self.text_keys = config.tokenizer == "text"
        self.local_tokenizer_ok = False
        # Chat requests likewise, with the model's chat template, once probe
        # conversations matched an engine's (``local_chat_ok``); a request's own
        # chat_template only once the engines were seen to accept one and render it
        # the same (``request_templates_ok``).  A request the renderer declines goes
        # to the engine's /tokenize.
        self.local_chat: ChatRenderer | None = None
        if self.local_tokenizer is not None:
            renderer = ChatRenderer(self.local_tokenizer)
            if renderer.unusable:
                logger.info("chat prompts are tokenized by the engine: %s", renderer.unusable)
            else:
                self.local_chat = renderer
        self.local_chat_ok = False
        self.request_templates_ok = False
        self.check_local_tokenizer: Callable[[], Awaitable[None]] | None = None
        self._tokenizer_check: asyncio.Task | None = None

    def _check_later(self) -> None:
        """Start the check against the engine, unless one is running."""
        if self.check_local_tokenizer is not None and (
                self._tokenizer_check is None or self._tokenizer_check.done()):
            self._tokenizer_check = asyncio.create_task(self.check_local_tokenizer())

    # ------------------------------------------------------------ token ids
    async def prompt_token_ids(self, body: dict[str, Any], is_chat: bool,
                               engine_only: bool = False) -> list[int] | None:
        """The prompt's token ids exactly as the engines will see them, or None.
        ``engine_only`` asks the engine even where the local tokenizer could answer."""
        if not is_chat:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            local = self.local_tokenizer
            if local is not None and isinstance(prompt, str) and not engine_only:
                if self.local_tokenizer_ok:
                    ids = local.ids_for_completion(body)
                    if ids is not None:
                        return ids
                else:
                    self._check_later()
        elif self.local_chat is not None and not engine_only:
            if self.local_chat_ok:
                try:
                    return self.local_chat.ids(body, self.request_templates_ok)
                except Exception as exc:   # declined, or the template refused it
                    logger.debug("chat prompt tokenized by the engine: %r", exc)
            else:
                self._check_later()
        if self.config.tokenizer == "none":
            return None
        engines = [e for e in self.pool.engines if e.available] or self.pool.engines
        engine = engines[0]
        if is_chat:
            req = {k: body[k] for k in ("model", "messages", "add_generation_prompt",
                                        "continue_final_message", "chat_template",
                                        "chat_template_kwargs", "tools",
                                        "add_special_tokens") if k in body}
            req.setdefault("add_generation_prompt", True)
            # Fields /tokenize lacks but the chat endpoint passes to the template
            # (vLLM's ChatCompletionRequest.build_chat_params): as template kwargs.
            kwargs = body.get("chat_template_kwargs") or {}
            effort = body.get("reasoning_effort")
            extra = {k: body[k] for k in ("documents", "reasoning_effort")
                     if body.get(k) is not None}
            if effort is not None and isinstance(kwargs, dict) \
                    and "enable_thinking" not in kwargs:
                extra["enable_thinking"] = effort != "none"
            if extra and isinstance(kwargs, dict):
                req["chat_template_kwargs"] = {**kwargs, **extra}
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return None  # batched prompts: route on load only
            req = {"model": body.get("model"), "prompt": prompt}
            if "add_special_tokens" in body:
                req["add_special_tokens"] = body["add_special_tokens"]
        try:
            resp = await self.upstream.post(engine.url, "/tokenize", _json.encode(req))
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

    async def content_keys(self, body: dict[str, Any], is_chat: bool, tenant: str | None
                           ) -> tuple[list[int] | None, list[int]]:
        """(token ids, block keys) of the prompt: keys over its token ids, or over its
        text with ``tokenizer: text`` (no ids then, unless the client sent ids)."""
        block_size = self.block_size.tokens
        if self.text_keys:
            text = prompt_text(body, is_chat)
            if text is not None:
                return None, text_keys(text, block_size * CHARS_PER_TOKEN, tenant)
            # Not text: ids the client sent (keyed as ids), or a batch (no keys; no
            # /tokenize call either, ``prompt_token_ids`` asks it only for a string).
        token_ids = await self.prompt_token_ids(body, is_chat)
        return token_ids, (request_keys(token_ids, block_size, salt=tenant)
                           if token_ids else [])

    # ------------------------------------------------------------ sessions
    def _session_raw(self, key: str, stored: bytes | None) -> bytes | None:
        """This replica's own newest record for ``key`` while its write is still on
        the way (read your own writes), else what the store returned."""
        return self._unwritten.get(key, stored)

    def _record(self, raw: bytes | None, tenant: str | None) -> SessionRecord | None:
        record = decode_record(raw) if raw else None
        # A record stored under this key is this tenant's; the check guards old ones.
        return record if record is not None and record.tenant == tenant else None

    async def load_session(self, session_id: str | None, tenant: str | None
                           ) -> SessionRecord | None:
        if not session_id:
            return None
        key = session_store_key(session_id, tenant)
        raw = self._unwritten.get(key)
        if raw is None:
            raw = await self.index.get_session(key)
        return self._record(raw, tenant)

    def save_session_later(self, record: SessionRecord) -> None:
        """Write ``record`` behind the request: it is readable by this replica at once
        (``_unwritten``), and written to the store by one writer per session, newest
        last, so the request never waits for the store.  A failed write is counted
        (``on_write_error``) and costs the next turn's reuse, never the request."""
        record.updated_at_unix_s = time.time()
        key = session_store_key(record.session_id, record.tenant)
        self._unwritten[key] = encode_record(record)
        if key not in self._writers:
            self._writers[key] = self._spawn(self._write_session(key))

    async def save_session(self, record: SessionRecord) -> None:
        """``save_session_later``, waiting for the write."""
        self.save_session_later(record)
        writer = self._writers.get(session_store_key(record.session_id, record.tenant))
        if writer is not None:
            await asyncio.shield(writer)

    async def _write_session(self, key: str) -> None:
        try:
            while (raw := self._unwritten.get(key)) is not None:
                try:
                    await self.index.put_session(key, raw, self.config.session_ttl_s)
                except Exception as exc:
                    self._write_failed("session_store", key, exc)
                if self._unwritten.get(key) is raw:   # else a newer one: write it next
                    del self._unwritten[key]
        finally:
            self._writers.pop(key, None)

    def _give_back(self, read: RouteRead, session_id: str | None, tenant: str | None
                   ) -> None:
        """A published handle ``route_read`` took and no P request will use goes back,
        behind the request (unless a newer one was published meanwhile)."""
        if read.handle_taken and read.handle is not None and session_id:
            self._spawn(self._return_handle(session_store_key(session_id, tenant),
                                            read.handle, read.handle_ttl_ms))

    async def _return_handle(self, key: str, raw: bytes, ttl_ms: int) -> None:
        try:
            await self.index.return_handle(key, raw, ttl_ms)
        except Exception as exc:
            self._write_failed("handle_return", key, exc)

    def _write_failed(self, kind: str, key: str, exc: BaseException) -> None:
        self.on_write_error(kind)
        logger.warning("%s for %s failed: %r", kind, key, exc)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def flush(self) -> None:
        """Wait until the writes behind earlier requests are done (tests, stop)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def _usable_handle(self, record: SessionRecord | None, session_id: str | None,
                             tenant: str | None, published: bytes | None = None
                             ) -> tuple[SessionHandle | None, str, str]:
        """(handle, outcome, source): the session's live handle, if any, and whether it
        came from the session record or from the engines' published copy (its bytes,
        ``published``, as ``route_read`` returned them)."""
        if not session_id:
            return None, "none", ""
        handle, source = (record.handle if record else None), "record"
        if handle is None:
            handle, source = decode_published_handle(published), "published"
        if isinstance(handle, HandleUnreadable):
            return None, handle.reason, ""
        if handle is None:
            return None, "none", ""
        if handle.tenant != tenant:
            return None, "other_tenant", ""
        holder = self.pool.get(handle.engine_url or "")
        if holder is not None and record is not None and \
                holder.lost_at_unix_s > record.updated_at_unix_s:
            # The D that held it refused connections since this turn: if it is back,
            # it is a new process (P's read would fail against its new NIXL agent).
            return None, "engine_lost", ""
        # The engine's rule and margin: a handle P would refuse is left unconsumed.
        if handle_expired(handle.expires_at_unix_s, time.time(),
                          self.params.handle_expiry_margin_s):
            return None, "expired", ""
        return handle, "attached", source

    # ------------------------------------------------------------ decision
    def _next(self, role: Role, exclude: set[str] = frozenset()) -> Engine:
        engines = [e for e in self.pool.by_role(role) if e.available and e.url not in exclude]
        if not engines:
            engines = [e for e in self.pool.by_role(role) if e.url not in exclude]
        if not engines:
            raise ApiError(503, f"no {role.value} engine available", type_="server_error")
        return engines[next(self._rr[role]) % len(engines)]

    def alternative(self, role: Role, tried: set[str]) -> Engine | None:
        try:
            return self._next(role, exclude=tried)
        except ApiError:
            return None

    async def plan(self, body: dict[str, Any], is_chat: bool, session_id: str | None
                   ) -> RoutePlan:
        tenant = request_tenant(body)
        max_output = _max_output_tokens(body, is_chat)
        has_prefill_pool = bool(self.pool.by_role(Role.PREFILL))
        if self.config.routing.policy == "round_robin":
            decode = self._next(Role.DECODE)
            if not has_prefill_pool:
                return RoutePlan(Mode.DECODE_ONLY, None, decode, RouteReason.COLOCATED,
                                 max_output_tokens=max_output, tenant=tenant)
            if engine_requests(body, is_chat) > 1:   # as the policy rules (``route``)
                return RoutePlan(Mode.DECODE_ONLY, None, decode,
                                 RouteReason.SEVERAL_ENGINE_REQUESTS,
                                 max_output_tokens=max_output, tenant=tenant)
            prefill = self._next(Role.PREFILL)
            return RoutePlan(Mode.DISAGGREGATED, prefill, decode, RouteReason.ROUND_ROBIN,
                             prefill_params=_fresh_prefill_params(),
                             max_output_tokens=max_output, tenant=tenant)

        started = time.perf_counter()
        # Content (token ids, block keys, index overlap) and the policy only matter
        # when there is a choice to make: several decode workers, or a prefill pool
        # (whether to use it, which P, how much the session's D can hand over).  A
        # lone decode worker gets the request whatever its content.
        if not has_prefill_pool:
            healthy = [e for e in self.pool.by_role(Role.DECODE) if e.available]
            if len(healthy) == 1:
                return RoutePlan(Mode.DECODE_ONLY, None, healthy[0],
                                 RouteReason.SINGLE_DECODE_WORKER, tenant=tenant,
                                 terms={"decision_s": time.perf_counter() - started,
                                        "detail": "single decode worker; decode only"},
                                 prompt_tokens=_estimate_tokens(body, is_chat),
                                 max_output_tokens=max_output)
        token_ids, keys = await self.content_keys(body, is_chat, tenant)
        # Everything the decision reads from the store, in one round trip.  Only a P
        # request can use the session's handle, so only then is the published copy
        # taken: atomically, so that of several replicas one gets it (single use).
        session_key = session_store_key(session_id, tenant) if session_id else None
        # Text keys are never in the index (it holds what KV events name, in tokens).
        read = await self.index.route_read(
            session_key, [] if self.text_keys else keys,
            take_handle=bool(session_id) and has_prefill_pool)
        record = self._record(self._session_raw(session_key, read.record)
                              if session_key else None, tenant)
        handle, outcome, source = await self._usable_handle(record, session_id, tenant,
                                                            read.handle)
        matches = read.matches
        degraded = "redis_unavailable" if getattr(self.index, "degraded", False) else None
        now_s = time.time()
        for engine, depth in self.recent.overlaps(keys, now_s).items():
            tiers = matches.setdefault(engine, {})
            tiers[TIER_DEVICE] = max(tiers.get(TIER_DEVICE, 0), depth)
        peer_blocks = 0
        expires_at = None
        if handle is not None:
            expires_at = handle.expires_at_unix_s or None
            if record is not None and record.prompt_keys:
                peer_blocks = _common_prefix(keys, record.prompt_keys)
        session_view = None
        if record is not None and record.last_decode:
            session_view = policy.SessionView(session_id=record.session_id,
                                              last_decode=record.last_decode,
                                              expires_at_s=expires_at)
        block_size = self.block_size.tokens
        placed = self.recent.placement_counts(now_s)
        # A stalled engine takes no new requests while another of its role can; when
        # every D looks stalled, the D pool is tried anyway (slow beats a 503).
        any_decode = any(e.available for e in self.pool.by_role(Role.DECODE))
        workers = [policy.WorkerLoad(
            url=e.url, role=e.role,
            healthy=e.available or (e.healthy and not any_decode and e.role is Role.DECODE),
            active_requests=max(e.active_requests,
                                int(e.running_requests + e.waiting_requests)),
            active_prefill_blocks=e.active_prefill_tokens / block_size,
            active_decode_blocks=e.active_decode_tokens / block_size,
            queued_decode_blocks=e.active_decode_work_tokens / block_size,
            kv_usage=e.kv_usage, recent_placements=placed.get(e.url, 0),
            restores_expire=e.restore_handles_expire)
            for e in self.pool.engines]
        # Without token ids, estimate the size from the text (about 3 characters a
        # token) so a long prompt is not mistaken for a small increment.
        num_tokens = len(token_ids) if token_ids else _estimate_tokens(body, is_chat)
        try:
            decision = policy.route(
                policy.RouteInput(prompt_tokens=num_tokens, block_size=block_size,
                                  now_s=now_s,
                                  overlaps=policy.overlaps_from_match(matches),
                                  session=session_view, peer_pullable_blocks=peer_blocks,
                                  kv_bytes_per_token=self.kv_bytes_per_token,
                                  max_output_tokens=max_output,
                                  # A restore needs the prompt's ids and a session for
                                  # D to hold the turn under; a usable handle already
                                  # names the session's blocks.
                                  restore_allowed=bool(token_ids and session_id
                                                       and handle is None),
                                  engine_requests=engine_requests(body, is_chat)),
                workers, self.params, self.rng)
        except policy.NoWorkerAvailable as exc:
            self._give_back(read, session_id, tenant)
            raise ApiError(503, str(exc), type_="server_error") from None
        decode = self.pool.get(decision.decode_url)
        prefill = self.pool.get(decision.prefill_url) if decision.prefill_url else None
        # Only the engines the request is sent to: a prefill-only request never
        # reaches the D the policy scored, which will not hold its prefix.
        sent_to = ([decision.prefill_url] if decision.mode is policy.Mode.PREFILL_ONLY
                   else [u for u in (decision.decode_url, decision.prefill_url) if u])
        self.recent.record(keys, sent_to, now_s)
        if decision.decode_placed:
            self.recent.record_placement(decision.decode_url, now_s)
        mode = decision.mode
        prefill_params = None
        used = mode is Mode.DISAGGREGATED and handle is not None
        if mode is Mode.DISAGGREGATED:
            prefill_params = (handle.prefill_params() if handle is not None
                              else _fresh_prefill_params())
        elif handle is not None:
            outcome = f"unused_{mode.value}"
        # After the decision, behind the request.  A handle is single use: P's read
        # tells D to release the blocks, so a second read could fetch reused memory.
        # The published copy was taken by the read itself (one replica gets it); a
        # record-held one leaves this replica's view now (``_unwritten``) and the
        # store with the write behind.
        if used and source == "record" and record is not None:
            record.handle = None
            self.save_session_later(record)
        if not used:
            self._give_back(read, session_id, tenant)
        restore = decision.restore_tokens
        terms = {"decision_s": time.perf_counter() - started, "prompt_tokens": num_tokens,
                 "peer_pullable_blocks": peer_blocks, "uncached_tokens": decision.uncached_tokens,
                 "detail": decision.reason + (
                     "; index and sessions from this replica (redis unavailable)"
                     if degraded else "")}
        if logger.isEnabledFor(logging.DEBUG):   # only the debug log reads the costs
            terms["prefill"] = {t.url: round(t.cost, 3) for t in decision.prefill_candidates}
            terms["decode"] = {t.url: round(t.cost, 3) for t in decision.decode_candidates}
        return RoutePlan(mode, prefill, decode, decision.label,
                         prefill_params=prefill_params, prompt_keys=list(keys), terms=terms,
                         handle_outcome=outcome,
                         prompt_tokens=len(token_ids) if token_ids else num_tokens,
                         max_output_tokens=max_output, degraded=degraded, tenant=tenant,
                         restore_tokens=restore,
                         prompt_token_ids=token_ids if restore else None,
                         uncached_tokens=decision.uncached_tokens)


def request_tenant(body: dict[str, Any]) -> str | None:
    """A request's tenant: vLLM's ``cache_salt``, which the engines hash into every
    block, so KV is never shared across tenants."""
    return body.get("cache_salt")


def engine_requests(body: dict[str, Any], is_chat: bool) -> int:
    """The engine requests vLLM makes of a validated request: ``n`` samples of each
    prompt, one per prompt of a completions batch (a list of strings or of token-id
    lists; a list of ints is one prompt); beam search counts as several."""
    n = body.get("n")
    count = n if n.__class__ is int and n > 1 else 1
    if not is_chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            count *= len(prompt)
    if body.get("use_beam_search"):
        count = max(count, 2)
    return count


# Characters per token for a prompt the router has no token ids of: enough to tell a
# long prompt from a short one, and the size of a text key's block in tokens.
CHARS_PER_TOKEN = 3
# Output tokens assumed for a request with no cap, in the in-flight load terms.
DEFAULT_OUTPUT_ESTIMATE = 16


def _estimate_tokens(body: dict[str, Any], is_chat: bool) -> int:
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


def _max_output_tokens(body: dict[str, Any], is_chat: bool) -> int | None:
    """The request's cap on new tokens as vLLM reads it (chat: max_completion_tokens
    before the deprecated max_tokens); None when it sets none."""
    value = body.get("max_completion_tokens") if is_chat else None
    if value is None:
        value = body.get("max_tokens")
    return value if isinstance(value, int) else None


def _fresh_prefill_params() -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
