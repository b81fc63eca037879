"""Gathers what a routing decision needs, asks the policy, and carries out its effects.

The policy (``policy.py``) is a pure function of plain data.  :meth:`Router.plan`
is the I/O around it, in three steps: **gather** (the prompt's token ids and block
keys from :class:`~sessionkv_proxy.prompt_keys.PromptKeys`, then the session record,
the engines' published handle and the index lookup in one read
(``KVIndex.route_read``: one Redis round trip, or none in-process), and the engines'
load), **route** (``policy.route``), **effects** (the routes remembered, a consumed
handle cleared from the record, an unused published handle given back, all behind
the request through :class:`~sessionkv_proxy.session_store.SessionStore`).  A wrong
or stale answer here costs speed only: the connector verifies every block it
attaches.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_sessionkv.wire.hashing import common_prefix_len
from vllm_sessionkv.wire.protocol import SessionHandle, session_store_key

from sessionkv_proxy import handoff, policy, prices
from sessionkv_proxy.block_size import BlockSize
from sessionkv_proxy.config import ProxyConfig
from sessionkv_proxy.engines import Engine, EnginePool
from sessionkv_proxy.errors import ApiError
from sessionkv_proxy.index.base import TIER_DEVICE, KVIndex, RouteRead
from sessionkv_proxy.route_types import Mode, Role, RouteReason
from sessionkv_proxy.prompt_keys import PromptKeys, estimate_tokens
from sessionkv_proxy.recent import RecentRoutes
from sessionkv_proxy.session_store import SessionStore, usable_handle
from sessionkv_proxy.sessions import SessionRecord
from sessionkv_proxy.upstream import UpstreamPool

__all__ = ["DEFAULT_OUTPUT_ESTIMATE", "RoutePlan", "Router", "engine_requests",
           "request_tenant"]

logger = logging.getLogger("sessionkv_proxy.router")

# Output tokens assumed for a request with no cap, in the in-flight load terms.
DEFAULT_OUTPUT_ESTIMATE = 16


@dataclass(frozen=True)
class RoutePlan:
    """Where a request goes and what goes with it; read, never changed."""

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
    # What the chosen P computes of the prompt (``RouteDecision.prefill_work_blocks``
    # in tokens); 0 when no P serves it.
    prefill_work_tokens: float = 0.0

    @property
    def output_tokens(self) -> int:
        """The output tokens the load terms count for it: its cap, or an estimate."""
        return self.max_output_tokens or DEFAULT_OUTPUT_ESTIMATE

    @property
    def decode_work_tokens(self) -> int:
        """What this request queues on D while it runs: the prompt tokens D prefills
        itself (none when P prefills) plus the output tokens it may generate."""
        return self.decode_prefill_tokens + self.output_tokens

    @property
    def decode_prefill_tokens(self) -> int:
        """The prompt tokens D computes itself: the uncached ones when it serves the
        request alone, none when P prefills."""
        if self.mode is not Mode.DECODE_ONLY:
            return 0
        return self.prompt_tokens if self.uncached_tokens is None else self.uncached_tokens


@dataclass(frozen=True)
class _Gathered:
    """Everything the decision reads, gathered before it."""

    session_id: str | None
    tenant: str | None
    max_output: int | None
    token_ids: list[int] | None
    keys: list[int]
    read: RouteRead
    record: SessionRecord | None
    handle: SessionHandle | None
    outcome: str
    source: str
    now_s: float
    num_tokens: int
    peer_blocks: int
    degraded: bool   # the index answered from this replica's own copy


class Router:
    def __init__(self, config: ProxyConfig, pool: EnginePool, index: KVIndex,
                 upstream: UpstreamPool, rng: random.Random | None = None,
                 on_error: Callable[[str], None] = lambda kind: None):
        self.config = config
        self.pool = pool
        self.index = index
        self.rng = rng or random.Random()
        self.params = prices.routing_params_from_config(config.routing.params)
        # KV bytes per token of the served model, to price peer pulls; 0 = unknown,
        # then the policy credits pullable blocks with a fixed weight.
        self.kv_bytes_per_token = float(config.routing.params.get("kv_bytes_per_token", 0.0))
        self._rr = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}
        self.recent = RecentRoutes(ttl_s=config.routing.recent_routes_ttl_s)
        # The engines' KV block size (configured, or learned by the event consumer).
        self.block_size = BlockSize(config.block_size)
        self.prompt_keys = PromptKeys(config, self.block_size, pool, upstream, on_error)
        self.sessions = SessionStore(index, config.session_ttl_s, on_error)

    def usable_handle(self, record: SessionRecord | None, session_id: str | None,
                      tenant: str | None, published: bytes | None = None,
                      read: RouteRead | None = None
                      ) -> tuple[SessionHandle | None, str, str]:
        """The session's live handle (``session_store.usable_handle``)."""
        if not session_id:
            return None, "none", ""

        def lost_at(url: str) -> float | None:
            holder = self.pool.get(url)
            return holder.lost_at_unix_s if holder is not None else None

        handle, outcome, source = usable_handle(
            record, published, tenant, lost_at, time.time(),
            self.params.handle_expiry_margin_s,
            read.withdrawn if read is not None else (),
            read.epochs if read is not None else None)
        if handle is not None and handle.engine_url in self.pool.removed:
            # Its D left the engine set: no pull from it (it may be shutting down).
            return None, "engine_removed", ""
        return handle, outcome, source

    # ------------------------------------------------------------ engines
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

    # ------------------------------------------------------------ the plan
    async def plan(self, body: dict[str, Any], is_chat: bool, session_id: str | None
                   ) -> RoutePlan:
        """Gather, route, effects (the module doc)."""
        tenant = request_tenant(body)
        max_output = _max_output_tokens(body, is_chat)
        started = time.perf_counter()
        shortcut = self._plan_without_content(body, is_chat, tenant, max_output, started)
        if shortcut is not None:
            return shortcut
        gathered = await self._gather(body, is_chat, session_id, tenant, max_output)
        try:
            decision = policy.route(self._route_input(gathered, body, is_chat),
                                    self._workers(gathered.now_s), self.params, self.rng)
        except policy.NoWorkerAvailable as exc:
            self.sessions.give_back(gathered.read, session_id, tenant)
            raise ApiError(503, str(exc), type_="server_error") from None
        return self._effects(decision, gathered, started)

    def _plan_without_content(self, body: dict[str, Any], is_chat: bool,
                              tenant: str | None, max_output: int | None,
                              started: float) -> RoutePlan | None:
        """The plan when the prompt's content cannot change it: round robin, or a
        lone decode worker and no prefill pool.  Content (token ids, block keys,
        index overlap) and the policy only matter when there is a choice to make:
        several decode workers, or a prefill pool (whether to use it, which P, how
        much the session's D can hand over)."""
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
            return RoutePlan(Mode.DISAGGREGATED, self._next(Role.PREFILL), decode,
                             RouteReason.ROUND_ROBIN,
                             prefill_params=handoff.fresh_prefill_params(),
                             max_output_tokens=max_output, tenant=tenant)
        if has_prefill_pool:
            return None
        healthy = [e for e in self.pool.by_role(Role.DECODE) if e.available]
        if len(healthy) != 1:
            return None
        return RoutePlan(Mode.DECODE_ONLY, None, healthy[0], RouteReason.SINGLE_DECODE_WORKER,
                         tenant=tenant,
                         terms={"decision_s": time.perf_counter() - started,
                                "detail": "single decode worker; decode only"},
                         prompt_tokens=estimate_tokens(body, is_chat),
                         max_output_tokens=max_output)

    async def _gather(self, body: dict[str, Any], is_chat: bool, session_id: str | None,
                      tenant: str | None, max_output: int | None) -> _Gathered:
        session_key = session_store_key(session_id, tenant) if session_id else None
        token_ids, keys = await self.prompt_keys.content_keys(body, is_chat, tenant,
                                                              session_key)
        # Everything the decision reads from the store, in one round trip.  Only a P
        # request can use the session's handle, so only then is the published copy
        # taken: atomically, so that of several replicas one gets it (single use).
        # Text keys are never in the index (it holds what KV events name, in tokens).
        read = await self.index.route_read(
            session_key, [] if self.prompt_keys.text_keys else keys,
            take_handle=bool(session_id) and bool(self.pool.by_role(Role.PREFILL)))
        record = (self.sessions.record(session_key, read.record, tenant)
                  if session_key else None)
        handle, outcome, source = self.usable_handle(record, session_id, tenant,
                                                     read.handle, read)
        degraded = bool(getattr(self.index, "degraded", False))
        now_s = time.time()
        for engine, depth in self.recent.overlaps(keys, now_s).items():
            tiers = read.matches.setdefault(engine, {})
            tiers[TIER_DEVICE] = max(tiers.get(TIER_DEVICE, 0), depth)
        peer_blocks = 0
        if handle is not None and record is not None and record.prompt_keys:
            peer_blocks = common_prefix_len(keys, record.prompt_keys)
        # Without token ids, estimate the size from the text (about 3 characters a
        # token) so a long prompt is not mistaken for a small increment.
        num_tokens = len(token_ids) if token_ids else estimate_tokens(body, is_chat)
        return _Gathered(session_id=session_id, tenant=tenant, max_output=max_output,
                         token_ids=token_ids, keys=keys, read=read, record=record,
                         handle=handle, outcome=outcome, source=source, now_s=now_s,
                         num_tokens=num_tokens, peer_blocks=peer_blocks,
                         degraded=degraded)

    def _route_input(self, g: _Gathered, body: dict[str, Any], is_chat: bool
                     ) -> policy.RouteInput:
        session_view = None
        if g.record is not None and g.record.last_decode:
            session_view = policy.SessionView(
                session_id=g.record.session_id, last_decode=g.record.last_decode,
                expires_at_s=(g.handle.expires_at_unix_s or None) if g.handle else None)
        return policy.RouteInput(
            prompt_tokens=g.num_tokens, block_size=self.block_size.tokens, now_s=g.now_s,
            overlaps=policy.overlaps_from_match(g.read.matches), session=session_view,
            peer_pullable_blocks=g.peer_blocks, kv_bytes_per_token=self.kv_bytes_per_token,
            max_output_tokens=g.max_output,
            # A restore needs the prompt's ids and a session for D to hold the turn
            # under; a usable handle already names the session's blocks.
            restore_allowed=bool(g.token_ids and g.session_id and g.handle is None),
            engine_requests=engine_requests(body, is_chat))

    def _workers(self, now_s: float) -> list[policy.WorkerLoad]:
        block_size = self.block_size.tokens
        placed = self.recent.placement_counts(now_s)
        # A stalled engine takes no new requests while another of its role can; when
        # every D looks stalled, the D pool is tried anyway (slow beats a 503).
        any_decode = any(e.available for e in self.pool.by_role(Role.DECODE))
        return [policy.WorkerLoad(
            url=e.url, role=e.role,
            healthy=e.available or (e.healthy and not any_decode and e.role is Role.DECODE),
            active_requests=max(e.active_requests,
                                int(e.running_requests + e.waiting_requests)),
            active_prefill_blocks=e.active_prefill_tokens / block_size,
            active_decode_blocks=e.active_decode_tokens / block_size,
            queued_decode_blocks=e.active_decode_work_tokens / block_size,
            queued_prefill_blocks=e.active_prefill_work_tokens / block_size,
            kv_usage=e.kv_usage, kv_reclaimable=e.kv_reclaimable,
            recompute_s_per_token=e.recompute_s_per_token,
            recent_placements=placed.get(e.url, 0),
            restores_expire=e.restore_handles_expire)
            for e in self.pool.engines]

    def _effects(self, decision: policy.RouteDecision, g: _Gathered, started: float
                 ) -> RoutePlan:
        """What the decision changes (all behind the request), and its plan."""
        mode = decision.mode
        # Only the engines the request is sent to: a prefill-only request never
        # reaches the D the policy scored, which will not hold its prefix.
        sent_to = ([decision.prefill_url] if mode is Mode.PREFILL_ONLY
                   else [u for u in (decision.decode_url, decision.prefill_url) if u])
        self.recent.record(g.keys, sent_to, g.now_s)
        if decision.decode_placed:
            self.recent.record_placement(decision.decode_url, g.now_s)
        # Not sent to P: a handle that would expire in P's queue (P would refuse it).
        used = (mode is Mode.DISAGGREGATED and g.handle is not None
                and not decision.handle_expires_in_queue)
        prefill_params, outcome = None, g.outcome
        if mode is Mode.DISAGGREGATED:
            prefill_params = (g.handle.prefill_params() if used
                              else handoff.fresh_prefill_params())
        if g.handle is not None and not used:
            outcome = ("expires_in_queue" if decision.handle_expires_in_queue
                       else f"unused_{mode.value}")
        # A handle is single use: P's read tells D to release the blocks, so a second
        # read could fetch reused memory.  The published copy was taken by the read
        # itself (one replica gets it); a record-held one leaves this replica's view
        # now (the store's unwritten copy) and the store with the write behind.
        if used and g.source == "record" and g.record is not None:
            g.record.handle = None
            self.sessions.save_later(g.record)
        if not used:
            self.sessions.give_back(g.read, g.session_id, g.tenant, g.outcome)
        return RoutePlan(
            mode, self.pool.get(decision.prefill_url) if decision.prefill_url else None,
            self.pool.get(decision.decode_url), decision.label,
            prefill_params=prefill_params, prompt_keys=list(g.keys),
            terms=self._terms(decision, g, started), handle_outcome=outcome,
            prompt_tokens=len(g.token_ids) if g.token_ids else g.num_tokens,
            max_output_tokens=g.max_output, tenant=g.tenant,
            degraded="redis_unavailable" if g.degraded else None,
            restore_tokens=decision.restore_tokens,
            prompt_token_ids=g.token_ids if decision.restore_tokens else None,
            uncached_tokens=decision.uncached_tokens,
            prefill_work_tokens=decision.prefill_work_blocks * self.block_size.tokens)

    def _terms(self, decision: policy.RouteDecision, g: _Gathered, started: float
               ) -> dict[str, Any]:
        terms = {"decision_s": time.perf_counter() - started, "prompt_tokens": g.num_tokens,
                 "peer_pullable_blocks": g.peer_blocks,
                 "uncached_tokens": decision.uncached_tokens,
                 "detail": decision.reason + (
                     "; index and sessions from this replica (redis unavailable)"
                     if g.degraded else "")}
        if logger.isEnabledFor(logging.DEBUG):   # only the debug log reads the costs
            terms["prefill"] = {t.url: round(t.cost, 3) for t in decision.prefill_candidates}
            terms["decode"] = {t.url: round(t.cost, 3) for t in decision.decode_candidates}
        return terms


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


def _max_output_tokens(body: dict[str, Any], is_chat: bool) -> int | None:
    """The request's cap on new tokens as vLLM reads it (chat: max_completion_tokens
    before the deprecated max_tokens); None when it sets none."""
    value = body.get("max_completion_tokens") if is_chat else None
    if value is None:
        value = body.get("max_tokens")
    return value if isinstance(value, int) else None
