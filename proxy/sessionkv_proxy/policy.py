"""Pure routing policy: which prefill (P) and decode (D) worker serve a request.

Each pool goes through the same three steps as Dynamo's selector: **filter**
(unhealthy workers out; :class:`NoWorkerAvailable` if none is left), **score** (one
terms struct per candidate, every number the cost came from), **pick** (argmin, ties
and ``temperature > 0`` drawn from the caller's RNG).  :func:`route` returns a
:class:`RouteDecision` that carries those terms, so the caller logs one structured
line per decision.  No clock, I/O, globals or hidden randomness: time is
``RouteInput.now_s`` and randomness is the ``rng`` argument.

P cost, in blocks of prefill work (Dynamo's linear cost)::

    credit_blocks = decay * (w_device * device_blocks + w_host * host_blocks
                             + peer_weight * peer_blocks)
    cost = prefill_load_scale * max(0, active_prefill_blocks + prompt_blocks - credit_blocks)
         + decode_load_scale * active_decode_blocks

* ``active_prefill_blocks + prompt_blocks``: the work queued ahead of this request
  plus its own; what the worker must compute before the first token.
* ``credit_blocks``: prompt blocks the worker need not compute.  Tiers are disjoint
  increments of one prefix: ``device_blocks`` are its leading blocks in device KV
  (weight 1.0: free), ``host_blocks`` extend them from the host tier, ``peer_blocks``
  extend both from the D that holds the session.  A host block is a copy, cheap but
  not free: its weight is ``1 - restore_s / recompute_s`` over ``host_link`` (the
  connector's ``host_copy_*`` prior), near 1 for long context, lower for a short
  one, where Dynamo uses a fixed 0.75 (``weights.host``, used while the model's KV
  size is unknown).  A peer pull crosses the network, so its weight is priced per request by
  :func:`vllm_sessionkv.wire.cost.peer_credit_weight`, ``1 - pull_s / recompute_s``
  clamped to [0, 1]: near 1 for long context on a fast link, 0 on a slow one.
* ``decay = 1 / (1 + overlap_credit_decay * excess_blocks / prompt_blocks)``, with
  ``excess_blocks`` the worker's ``active_prefill_blocks`` above the least loaded
  healthy P.  Without it a worker holding a popular prefix keeps winning until its
  queue is a whole prompt deep, and becomes the hot spot Dynamo's and SGLang's users
  report.  Measuring the excess against the least loaded worker (Dynamo's
  ``--router-kv-overlap-score-credit-decay``, not the pool mean) leaves the credit
  whole at equal load, so a cache-rich worker still wins there; normalising by the
  request size makes the decay mean the same for short and long prompts.  Unlike
  Dynamo every tier's credit decays: a hot spot forms whatever tier draws it.
* ``active_decode_blocks``: KV the worker holds for running requests (on P: blocks
  waiting for D to pull).  It is memory, not compute, so it has its own scale.

D cost, in blocks: ``decode_load_scale * (active_decode_blocks + new_blocks * (1 +
decode_recent_weight * excess_recent_placements))``, where ``new_blocks =
prompt_blocks - device_blocks`` is what D must receive or compute; the prefix it holds
on device (index overlap, or the session's verified blocks on the session's D) it
reuses, and ``excess_recent_placements`` counts the placements the worker took in a
recent window beyond the least placed-on worker's count.  A placement is a request
the policy sent by cost, not by session or prefix affinity: a new session, a new
prefix, a request a load bound released.  Cache hits are short, so in-flight KV alone
would hand a cache-rich worker every new prefix and session; counting placements
spreads them by count.  Requests that follow their session or prefix are not
counted: they go where they must, and when they were, a burst of traffic from
conversations that had since ended steered every new one to the other worker for the
rest of the window (66 requests split 11 / 55 on two workers).  The surcharge
multiplies the new blocks, not the prompt, so a worker that already holds the
request's prefix adds little work however many placements it took lately.  Charged
on the whole prompt, one request more outweighed a prefix of 80% of the prompt, and
requests left the worker holding it whenever the load bound below released them.

*Session affinity* sends the request to the D that holds the session while its lease
runs, because that is where the longest prefix is and where the next turn's KV will
be.  It yields to load: when the holder has more work queued than the least loaded
other D (``queued_decode_blocks``: the prompt blocks each running request makes D
compute plus the outputs it may generate; a running request's cached prefix is no
work) by more than ``session_affinity_yield_weight`` times the blocks the session
saves there (``new_blocks`` on the other D minus on the holder, the recompute the
move costs), the request goes to that D instead.  Weighing whole in-flight contexts
instead moved sessions off engines whose requests were cache hits with little left to
do, and the prefix groups routed after them followed (router bench: 0.92-0.96 of the
oracle's hit rate, 1.00 with the rule off).  Without it a few hot sessions that
happen to share a D pile onto it while the other idles, and sticky sessions end up
slower than round robin (a published replay of agent sessions: mean TTFT 5.05 s
against 1.78 s).  KV pressure is D's ``kv_usage`` from ``/metrics``: it includes KV retained for
idle sessions, which the proxy's in-flight counts cannot see.  Above
``decode_kv_pressure_threshold`` affinity is dropped for the cheapest D under the
threshold; if every D is above it, affinity is kept, since moving then only adds a
transfer and evicts elsewhere.

*Prefix affinity*: without a live session, the D holding the longest prefix (index
overlap) gets the request while that prefix saves at least
``decode_affinity_min_gain`` of the prompt over the next best D and its in-flight
requests, the new one included, stay within ``max(decode_affinity_load_bound * mean,
mean + decode_affinity_load_slack)`` (bounded-load consistent hashing, plus an
absolute slack like the ``--balance-abs-threshold`` of SGLang's and vllm-router's
cache-aware policy); otherwise the cost argmin.  The slack is for low concurrency:
there a few requests of one prefix arriving together already exceed any multiple of
the small mean, a burst that random arrivals make common and that costs little while
the workers are far from saturated; at high concurrency the multiplicative bound is
the tighter one.
The cost alone cannot keep a prefix in place under concurrency: one extra in-flight
request on the holder outweighs the blocks it saves, so a plain argmin scatters a
prefix group over every D (what Dynamo's and vllm-router's users see), while the
bound caps the imbalance affinity may cause.

Conditional disaggregation: once D is chosen, the request skips P when
``uncached_tokens = prompt_tokens - D's device hit`` is at most
``decode_only_max_uncached_tokens`` and D is under ``decode_only_max_kv_usage`` and
``decode_only_max_active_requests``: a short increment costs less on D than a P hop
plus a transfer, but only while D has room (Dynamo's ``isl_bounding``, llm-d's
``prefix-based-pd-decider``).  Like theirs, the load check is advisory, not a
reservation.

*Prefill only*: a request that D does not take whole and that is capped at one new
token (``max_output_tokens <= 1``: scoring, classification, a probe) has nothing to
decode.  P computes that token as the last step of its prefill, so P serves the
request whole as a plain request, and neither a KV transfer nor D's fixed
per-request cost is paid for a decode that never runs.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from sessionkv_proxy.index.base import TIER_DEVICE, TIER_HOST, PrefixMatch
from vllm_sessionkv.wire.cost import (
    DEFAULT_HOST_LINK,
    LinkModel,
    PullQuote,
    OverlapWeights,
    RecomputeModel,
    decide_restore_for_pull,
    overlap_credit_blocks,
    peer_credit_weight,
)
from vllm_sessionkv.wire.protocol import HANDLE_EXPIRY_MARGIN_S, handle_expired

__all__ = [
    "DecodeTerms",
    "Mode",
    "NoWorkerAvailable",
    "PrefillTerms",
    "Role",
    "RouteDecision",
    "RouteInput",
    "RouteReason",
    "RoutingParams",
    "SessionView",
    "TierOverlap",
    "WorkerLoad",
    "healthy_workers",
    "overlaps_from_match",
    "pick",
    "route",
    "routing_params_from_config",
    "score_decode",
    "score_prefill",
]

# Costs closer than this (relative) count as equal, so float noise cannot break a tie.
_TIE_RTOL = 1e-9


class Role(str, enum.Enum):
    """An engine's pool; the proxy's one role type (``config.Role`` is this)."""

    PREFILL = "prefill"
    DECODE = "decode"


class Mode(str, enum.Enum):
    DISAGGREGATED = "disaggregated"  # P prefills, D pulls the KV and decodes
    DECODE_ONLY = "decode_only"  # D prefills the uncached rest itself
    PREFILL_ONLY = "prefill_only"  # nothing to decode: P serves the whole request


class RouteReason(str, enum.Enum):
    """Why a request went where it did, as a bounded metrics label (the free-text
    ``RouteDecision.reason`` carries the numbers)."""

    COLOCATED = "colocated"  # decode only: the deployment has no prefill pool
    NO_PREFILL_WORKER = "no_prefill_worker"  # decode only: no prefill worker is healthy
    SMALL_INCREMENT = "small_increment"  # decode only: few uncached tokens, D has room
    NO_DECODE = "no_decode"  # prefill only: at most one new token
    INCREMENT_TOO_LARGE = "increment_too_large"  # disaggregated
    DECODE_BUSY = "decode_busy"  # disaggregated: a small increment, but D has no room
    # Decode only: the increment is small because D restores the prompt's prefix from
    # its host tier.
    HOST_TIER = "host_tier"
    # Disaggregated: D restores the prompt's prefix from its host tier, P pulls it.
    HOST_TIER_PULL = "host_tier_pull"
    # Decode only: the request is several engine requests (n > 1, a batch of prompts),
    # and one P -> D hand-off carries one.
    SEVERAL_ENGINE_REQUESTS = "several_engine_requests"
    # Decided by the router without the policy:
    ROUND_ROBIN = "round_robin"
    SINGLE_DECODE_WORKER = "single_decode_worker"
    MODEL_UTILITY = "model_utility"  # tokenize, detokenize, ...: any D answers


class NoWorkerAvailable(RuntimeError):
    """A pool has no healthy worker; the caller answers 503."""

    def __init__(self, role: Role) -> None:
        super().__init__(f"no healthy {role.value} worker")
        self.role = role


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's health and load, as the proxy last saw it."""

    url: str
    role: Role
    healthy: bool = True
    active_requests: int = 0  # running + waiting on the engine
    active_prefill_blocks: float = 0.0  # prompt blocks routed here and not yet prefilled
    active_decode_blocks: float = 0.0  # KV blocks of requests routed here and still running
    # Work queued here, in blocks: of the requests routed here and still running, the
    # prompt blocks this D computes itself plus the outputs they may generate.
    queued_decode_blocks: float = 0.0
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc as a fraction in [0, 1]
    recent_placements: int = 0  # requests placed here by cost in the last window
    # A host-tier restore here gave a handle already inside the expiry margin (its
    # session lease is shorter): no restore for P's pull is asked of it.
    restores_expire: bool = False


class TierOverlap(msgspec.Struct, frozen=True):
    """Leading prompt blocks a worker holds, per tier, as the index reports them.

    Each count is from block 0 on that tier alone (``index.lookup`` semantics), not an
    increment over the other tier; the policy turns them into increments.
    """

    device_blocks: int = 0
    host_blocks: int = 0


class SessionView(msgspec.Struct, frozen=True, kw_only=True):
    """What the proxy knows of the request's session (from its stored handle)."""

    session_id: str
    last_decode: str | None = None  # URL of the D that holds the session's KV
    expires_at_s: float | None = None  # end of D's lease on the blocks; None: unknown


class RouteInput(msgspec.Struct, frozen=True, kw_only=True):
    """One request, seen through the index and the session store."""

    prompt_tokens: int
    block_size: int
    now_s: float
    # Worker URL -> its overlap with this prompt.  Workers absent hold nothing.
    overlaps: Mapping[str, TierOverlap] = msgspec.field(default_factory=dict)
    session: SessionView | None = None
    # Blocks of this prompt the session's D holds, verified by the proxy: the
    # handle's num_tokens capped by the common prefix of the session's stored request
    # keys with this prompt's (the proxy cannot see engine hashes).
    peer_pullable_blocks: int = 0
    kv_bytes_per_token: float = 0.0  # 0: unknown, the peer is credited weights.peer
    # The request's cap on new tokens (max_tokens / max_completion_tokens); None when
    # the request sets none, so the engine's default applies.
    max_output_tokens: int | None = None
    # D may be asked to restore for P's pull: the router has the prompt's ids and a
    # session to hold the restored turn under, and no usable handle offers P the
    # session's blocks already.
    restore_allowed: bool = True
    # The engine requests vLLM makes of this one: ``n`` samples, one per prompt of a
    # batch.  A P -> D hand-off carries one request's KV, so a request of several is
    # not split over P and D (see ``route``).
    engine_requests: int = 1

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if self.engine_requests < 1:
            raise ValueError(f"engine_requests must be >= 1, got {self.engine_requests}")

    @property
    def prompt_blocks(self) -> int:
        # A partial last block is still work to compute and KV to hold.
        return -(-self.prompt_tokens // self.block_size)


class RoutingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    recompute: RecomputeModel  # prices the peer credit; the connector's own model
    link: LinkModel  # D -> P link used by peer pulls
    # Host DRAM -> engine KV copies: prices host-tier credits (the connector's
    # ``host_copy_*``), in place of a fixed host weight.
    host_link: LinkModel = DEFAULT_HOST_LINK
    weights: OverlapWeights = OverlapWeights()
    prefill_load_scale: float = 1.0
    decode_load_scale: float = 1.0
    overlap_credit_decay: float = 1.0  # 0: no hot-spot decay (Dynamo's default)
    decode_kv_pressure_threshold: float = 0.9
    decode_only_max_uncached_tokens: int = 256  # -1 turns decode-only off
    decode_only_max_kv_usage: float = 0.8
    decode_only_max_active_requests: int = 32
    # Prefix affinity without a session: the decode worker holding the longest prefix
    # gets the request while its in-flight requests stay within this factor of the
    # pool mean ("consistent hashing with bounded loads", Mirrokni et al.); beyond
    # it, the cheapest worker.  0 turns prefix affinity off (pure cost argmin).
    decode_affinity_load_bound: float = 1.25
    # ... or within this many requests above the mean, whichever allows more.  On
    # two workers at a concurrency of 8 (benchmarks/router_bench.py), a slack of 1
    # released requests when the holder ran 2 against 0 or 5 against 1, and 3 still
    # released them at 6 against 0: bursts of prefix groups homed on one worker, each
    # released request recomputing its prefix on the other (about 2% of the hits
    # each).  4 keeps them; the multiplicative bound takes over from a mean of 16.
    decode_affinity_load_slack: float = 4.0
    # ... and only while its prefix saves at least this share of the prompt over the
    # next best worker: a short prefix every prompt shares (a tag, a common system
    # prompt held by one worker so far) must not pull new groups onto one worker.
    decode_affinity_min_gain: float = 0.25
    # Each placement a decode worker took in the recent window, beyond the least
    # placed-on worker's count, adds this share of the request's new blocks on that
    # worker (those it does not hold) to its cost.  In-flight KV alone lets a worker
    # whose requests are cache hits (short) look idle and collect every new prefix
    # and session; this spreads placements by count as well.  A placement brings a
    # conversation's later requests with it, so one placement more weighs as much as
    # that many in-flight requests' worth of new blocks.  0 turns it off.
    decode_recent_weight: float = 4.0
    # Session affinity yields when the holder's queued work (uncached prompt blocks it
    # computes plus outputs, of the requests running there) exceeds the least loaded
    # other D's by more than this many times the blocks the session saves on the
    # holder.  Above 1 because moving also leaves the session's KV behind on the
    # holder, and the next turn then pays for it again.  0 keeps affinity whatever the
    # load.
    session_affinity_yield_weight: float = 2.0
    # With no healthy P, let D prefill (Dynamo does) rather than refuse the request.
    decode_only_without_prefill: bool = True
    # A request capped at one new token has nothing to decode: P computes that token
    # while prefilling, so a hop to D would only add D's per-request cost and a KV
    # transfer.  P then serves it whole, as a plain request.  False sends it P -> D.
    prefill_only_without_decode: bool = True
    temperature: float = 0.0  # 0: argmin; > 0: softmax over normalised costs
    # A session handle this close to its expiry is not used, by the router (which
    # then leaves it unconsumed) or here (``protocol.handle_expired``).  At least the
    # engines' ``expiry_margin_s``, or the router spends handles P refuses.
    handle_expiry_margin_s: float = HANDLE_EXPIRY_MARGIN_S

    def __post_init__(self) -> None:
        for name in ("prefill_load_scale", "decode_load_scale", "overlap_credit_decay",
                     "temperature", "decode_only_max_active_requests",
                     "decode_affinity_load_bound", "decode_affinity_load_slack",
                     "decode_recent_weight", "handle_expiry_margin_s",
                     "session_affinity_yield_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"RoutingParams.{name} must be >= 0")
        for name in ("decode_kv_pressure_threshold", "decode_only_max_kv_usage",
                     "decode_affinity_min_gain"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"RoutingParams.{name} must be in [0, 1]")


class PrefillTerms(msgspec.Struct, frozen=True, kw_only=True):
    """One P candidate's cost and every term in it (see the module docstring)."""

    url: str
    active_prefill_blocks: float
    prompt_blocks: int
    device_blocks: int
    host_blocks: int  # beyond device_blocks
    host_weight: float  # credit per host block: the share of its recompute a restore saves
    peer_blocks: int  # beyond device_blocks and host_blocks
    peer_weight: float
    raw_credit_blocks: float
    excess_blocks: float  # active_prefill_blocks above the least loaded P
    decay: float
    credit_blocks: float
    adjusted_prefill_blocks: float
    active_decode_blocks: float
    cost: float


class DecodeTerms(msgspec.Struct, frozen=True, kw_only=True):
    """One D candidate's cost, pressure and affinity."""

    url: str
    active_decode_blocks: float
    queued_decode_blocks: float = 0.0  # ``WorkerLoad.queued_decode_blocks``
    device_blocks: int  # prompt blocks D holds on device (index or verified session)
    host_blocks: int = 0  # beyond device_blocks, on D's host tier (restored, not computed)
    host_weight: float = 0.0  # share of their recompute a restore saves
    new_blocks: int  # blocks D must receive or compute: the prompt less both
    kv_usage: float
    active_requests: int
    affinity: bool  # holds the request's live session
    over_pressure: bool
    recent_placements: int = 0
    prefix_affinity: bool = False  # chosen for its prefix, within the load bound
    cost: float


class RouteDecision(msgspec.Struct, frozen=True, kw_only=True):
    mode: Mode
    prefill_url: str | None
    decode_url: str  # with PREFILL_ONLY: the D that would have decoded, not called
    reason: str
    label: RouteReason
    uncached_tokens: int  # prompt tokens the chosen D holds on neither device nor host
    # HOST_TIER_PULL: prompt tokens D restores from its host tier for P to pull (the
    # router asks D for them first, as a one-token session turn); 0 otherwise.
    restore_tokens: int = 0
    prefill_candidates: tuple[PrefillTerms, ...] = ()
    decode_candidates: tuple[DecodeTerms, ...] = ()

    @property
    def decode_placed(self) -> bool:
        """D was chosen by cost, not by session or prefix affinity, and is sent the
        request: the caller counts it as a placement for ``recent_placements``."""
        if self.mode is Mode.PREFILL_ONLY:
            return False
        chosen = next(t for t in self.decode_candidates if t.url == self.decode_url)
        return not (chosen.affinity or chosen.prefix_affinity)


# --------------------------------------------------------------------------- filter


def healthy_workers(workers: Sequence[WorkerLoad], role: Role) -> list[WorkerLoad]:
    """The healthy workers of ``role``; raises :class:`NoWorkerAvailable` if none."""
    kept = [w for w in workers if w.role is role and w.healthy]
    if not kept:
        raise NoWorkerAvailable(role)
    return kept


def overlaps_from_match(match: PrefixMatch) -> dict[str, TierOverlap]:
    """The index's ``lookup`` answer as :class:`TierOverlap` per engine.

    Tiers other than device and host (e.g. storage) are not credited: no engine in
    this deployment restores from them.
    """
    return {
        engine: TierOverlap(tiers.get(TIER_DEVICE, 0), tiers.get(TIER_HOST, 0))
        for engine, tiers in match.items()
    }


def _live_session_holder(inp: RouteInput, healthy_decode: set[str],
                         params: RoutingParams) -> str | None:
    # The session's D counts only while its handle is usable (protocol.handle_expired)
    # and it is up: after that its blocks may be freed, and a pull from it would fail.
    s = inp.session
    if s is None or s.last_decode is None or s.last_decode not in healthy_decode:
        return None
    if s.expires_at_s is not None and handle_expired(s.expires_at_s, inp.now_s,
                                                     params.handle_expiry_margin_s):
        return None
    return s.last_decode


# --------------------------------------------------------------------------- score


def _host_weight(host_blocks: int, context_blocks: int, inp: RouteInput,
                 params: RoutingParams) -> float:
    """Credit per host-tier block: the share of its recompute a restore saves
    (``peer_credit_weight`` over the host link), or ``weights.host`` while the model's
    KV size is unknown."""
    if host_blocks <= 0:
        return 0.0
    if inp.kv_bytes_per_token <= 0:
        return params.weights.host
    return peer_credit_weight(host_blocks * inp.block_size, context_blocks * inp.block_size,
                              inp.kv_bytes_per_token, params.recompute, params.host_link)


def score_prefill(
    inp: RouteInput, workers: Sequence[WorkerLoad], params: RoutingParams
) -> tuple[PrefillTerms, ...]:
    """Filter and score the P pool; one :class:`PrefillTerms` per healthy P, by URL."""
    prefill = sorted(healthy_workers(workers, Role.PREFILL), key=lambda w: w.url)
    healthy_decode = {w.url for w in workers if w.role is Role.DECODE and w.healthy}
    holder = _live_session_holder(inp, healthy_decode, params)
    peer_total = min(max(0, inp.peer_pullable_blocks), inp.prompt_blocks) if holder else 0
    prompt_blocks = inp.prompt_blocks
    least_loaded = min(w.active_prefill_blocks for w in prefill)
    out = []
    for w in prefill:
        ov = inp.overlaps.get(w.url, TierOverlap())
        device = min(max(0, ov.device_blocks), prompt_blocks)
        host_reach = max(device, min(max(0, ov.host_blocks), prompt_blocks))
        host = host_reach - device
        peer = max(0, peer_total - host_reach)
        if peer and inp.kv_bytes_per_token > 0:
            # Engine load 0: the load term below already charges for a busy worker.
            peer_weight = peer_credit_weight(
                peer * inp.block_size, host_reach * inp.block_size, inp.kv_bytes_per_token,
                params.recompute, params.link,
            )
        else:
            peer_weight = params.weights.peer if peer else 0.0
        host_weight = _host_weight(host, device, inp, params)
        raw_credit = overlap_credit_blocks(device, host, peer, params.weights, peer_weight,
                                           host_weight)
        excess = w.active_prefill_blocks - least_loaded
        decay = 1.0 / (1.0 + params.overlap_credit_decay * excess / max(1, prompt_blocks))
        credit = decay * raw_credit
        adjusted = max(0.0, w.active_prefill_blocks + prompt_blocks - credit)
        cost = (params.prefill_load_scale * adjusted
                + params.decode_load_scale * w.active_decode_blocks)
        out.append(PrefillTerms(
            url=w.url, active_prefill_blocks=w.active_prefill_blocks,
            prompt_blocks=prompt_blocks, device_blocks=device, host_blocks=host,
            host_weight=host_weight, peer_blocks=peer, peer_weight=peer_weight, raw_credit_blocks=raw_credit,
            excess_blocks=excess, decay=decay, credit_blocks=credit,
            adjusted_prefill_blocks=adjusted, active_decode_blocks=w.active_decode_blocks,
            cost=cost,
        ))
    return tuple(out)


def score_decode(
    inp: RouteInput, workers: Sequence[WorkerLoad], params: RoutingParams
) -> tuple[DecodeTerms, ...]:
    """Filter and score the D pool; one :class:`DecodeTerms` per healthy D, by URL."""
    decode = sorted(healthy_workers(workers, Role.DECODE), key=lambda w: w.url)
    holder = _live_session_holder(inp, {w.url for w in decode}, params)
    prompt_blocks = inp.prompt_blocks
    fewest_placed = min(w.recent_placements for w in decode)
    out = []
    for w in decode:
        ov = inp.overlaps.get(w.url, TierOverlap())
        device = ov.device_blocks
        if w.url == holder:
            # The index may lag D's own events; the session's verified blocks do not.
            device = max(device, inp.peer_pullable_blocks)
        device = min(max(0, device), prompt_blocks)
        host = max(device, min(max(0, ov.host_blocks), prompt_blocks)) - device
        host_weight = _host_weight(host, device, inp, params)
        new = prompt_blocks - device - host
        out.append(DecodeTerms(
            url=w.url, active_decode_blocks=w.active_decode_blocks,
            queued_decode_blocks=w.queued_decode_blocks, device_blocks=device,
            host_blocks=host, host_weight=host_weight,
            new_blocks=new, kv_usage=w.kv_usage, active_requests=w.active_requests,
            affinity=w.url == holder,
            over_pressure=w.kv_usage > params.decode_kv_pressure_threshold,
            recent_placements=w.recent_placements,
            # The placements surcharge prices the work this request adds here (its
            # new blocks), not its whole prompt: a worker that already holds the
            # prefix adds little work however many placements it took lately.
            # A host block is a restore, priced at the share of a recompute it costs.
            cost=params.decode_load_scale * (
                w.active_decode_blocks
                + (1.0 - host_weight) * host
                + new * (1.0 + params.decode_recent_weight
                         * (w.recent_placements - fewest_placed))),
        ))
    return tuple(out)


# --------------------------------------------------------------------------- pick


def pick(costs: Mapping[str, float], temperature: float, rng: random.Random) -> str:
    """The URL to use: argmin at ``temperature == 0``, else a softmax draw.

    Ties at the minimum are drawn uniformly, so equal workers share the load instead of
    the first one in the list taking it all.  The softmax runs over costs normalised to
    [0, 1] by their spread, so ``temperature`` means the same whatever the cost scale.
    """
    if not costs:
        raise ValueError("pick() needs at least one candidate")
    urls = sorted(costs)  # input order must not matter for a given seed
    lo, hi = min(costs.values()), max(costs.values())
    tol = _TIE_RTOL * max(1.0, abs(lo))
    if temperature == 0 or hi - lo <= tol:
        return rng.choice([u for u in urls if costs[u] - lo <= tol])
    spread = hi - lo
    weights = [math.exp(-(costs[u] - lo) / spread / temperature) for u in urls]
    return rng.choices(urls, weights=weights)[0]


def _prefix_holder(terms: Sequence[DecodeTerms], params: RoutingParams) -> DecodeTerms | None:
    """The worker holding the longest prefix, if that prefix is worth keeping the
    request there and the worker's load is within the bound."""
    if params.decode_affinity_load_bound <= 0 or len(terms) < 2:
        return None
    # Reach: the prompt blocks a worker need not compute, on device or host.
    ranked = sorted(terms, key=lambda t: (t.new_blocks, t.cost, t.url))
    best, runner_up = ranked[0], ranked[1]
    prompt_blocks = best.device_blocks + best.host_blocks + best.new_blocks
    gain = runner_up.new_blocks - best.new_blocks
    if gain <= 0 or gain < params.decode_affinity_min_gain * prompt_blocks:
        return None  # nobody, several alike, or too little to be worth a hot spot
    # With the new request counted: at most ``bound`` times the mean, or ``slack``
    # requests above it, so that at low concurrency a short burst of one prefix
    # group stays where its prefix is.
    total = sum(t.active_requests for t in terms) + 1
    mean = total / len(terms)
    limit = max(params.decode_affinity_load_bound * mean,
                mean + params.decode_affinity_load_slack)
    return best if best.active_requests + 1 <= limit else None


def _lighter_than_holder(holder: DecodeTerms, under: Sequence[DecodeTerms],
                         params: RoutingParams) -> DecodeTerms | None:
    """The cheapest other D (not over kv pressure; by ``cost``, as any placement) if
    the session's holder has more work queued than it by more than the session's
    reuse there is worth; else None.

    Queued work, not in-flight KV: a running request's cached prefix costs its D
    nothing more, so weighing whole contexts moved sessions (and the prefix groups
    routed after them) off engines that had little left to do."""
    if params.session_affinity_yield_weight <= 0:
        return None
    others = sorted((t for t in under if t.url != holder.url), key=lambda t: (t.cost, t.url))
    if not others:
        return None
    best = others[0]
    work_gap = holder.queued_decode_blocks - best.queued_decode_blocks
    reuse = best.new_blocks - holder.new_blocks
    return best if work_gap > params.session_affinity_yield_weight * max(0, reuse) else None


def _pick_decode(
    terms: tuple[DecodeTerms, ...], params: RoutingParams, rng: random.Random
) -> tuple[str, str, bool]:
    """(url, reason, chosen for its prefix)."""
    holder = next((t for t in terms if t.affinity), None)
    under = [t for t in terms if not t.over_pressure]
    if holder is not None and not holder.over_pressure:
        lighter = _lighter_than_holder(holder, under, params)
        if lighter is None:
            return holder.url, "session affinity", False
        return (lighter.url, f"session affinity yielded to load ({holder.queued_decode_blocks:.0f}"
                f" vs {lighter.queued_decode_blocks:.0f} queued decode blocks, "
                f"{lighter.new_blocks - holder.new_blocks} blocks reuse)", False)
    if holder is not None and not under:
        return (holder.url, "session affinity kept: every decode worker over kv pressure",
                False)
    if holder is not None:
        reason = "session affinity dropped: kv pressure"
    elif under:
        reason = "least loaded decode"
        prefix = _prefix_holder(under, params)
        if prefix is not None:
            if prefix.host_blocks:
                return (prefix.url, f"prefix affinity ({_blocks(prefix.host_blocks)} on "
                        "its host tier)", True)
            return prefix.url, "prefix affinity", True
    else:
        reason = "least loaded decode: every decode worker over kv pressure"
    pool = under or list(terms)
    return pick({t.url: t.cost for t in pool}, params.temperature, rng), reason, False


def route(
    inp: RouteInput,
    workers: Sequence[WorkerLoad],
    params: RoutingParams,
    rng: random.Random,
) -> RouteDecision:
    """Choose D, decide whether P is needed, then choose P.

    D comes first (as in llm-d's P/D handler) because whether to skip P depends on
    what the chosen D already holds.  Raises :class:`NoWorkerAvailable` when no D is
    healthy, or when P is needed, none is healthy and ``decode_only_without_prefill``
    is off.
    """
    decode_terms = score_decode(inp, workers, params)
    decode_url, decode_reason, by_prefix = _pick_decode(decode_terms, params, rng)
    if by_prefix:
        decode_terms = tuple(msgspec.structs.replace(t, prefix_affinity=True)
                             if t.url == decode_url else t for t in decode_terms)
    chosen = next(t for t in decode_terms if t.url == decode_url)
    uncached = max(0, inp.prompt_tokens
                   - (chosen.device_blocks + chosen.host_blocks) * inp.block_size)
    small = uncached <= params.decode_only_max_uncached_tokens
    room = (chosen.kv_usage < params.decode_only_max_kv_usage
            and chosen.active_requests < params.decode_only_max_active_requests)
    if small and room:
        host_note = (f", {_blocks(chosen.host_blocks)} restored from its host tier"
                     if chosen.host_blocks else "")
        return RouteDecision(
            mode=Mode.DECODE_ONLY, prefill_url=None, decode_url=decode_url,
            reason=f"{decode_reason}; decode only: {uncached} uncached tokens{host_note}",
            label=RouteReason.HOST_TIER if chosen.host_blocks else RouteReason.SMALL_INCREMENT,
            uncached_tokens=uncached, decode_candidates=decode_terms,
        )
    no_decode = (params.prefill_only_without_decode and inp.max_output_tokens is not None
                 and inp.max_output_tokens <= 1)
    if inp.engine_requests > 1 and not no_decode:
        # P answers with one hand-off, naming one engine request's KV (vLLM returns one
        # set of kv_transfer_params per client request), while D would run several:
        # the others would compute their prompts anyway, after verification refused
        # P's blocks, or wait out an early-decode hold meant for one.  D computes them
        # from the start instead.  (Prefill only is fine: P serves them all.)
        return RouteDecision(
            mode=Mode.DECODE_ONLY, prefill_url=None, decode_url=decode_url,
            reason=f"{decode_reason}; decode only: {inp.engine_requests} engine requests "
                   "(n or a batch of prompts), one P -> D hand-off carries one",
            label=RouteReason.SEVERAL_ENGINE_REQUESTS,
            uncached_tokens=uncached, decode_candidates=decode_terms,
        )
    # A deployment without P (co-located) is not one whose P are down.
    if not any(w.role is Role.PREFILL for w in workers):
        return RouteDecision(
            mode=Mode.DECODE_ONLY, prefill_url=None, decode_url=decode_url,
            reason=f"{decode_reason}; decode only: co-located, no prefill pool",
            label=RouteReason.COLOCATED, uncached_tokens=uncached,
            decode_candidates=decode_terms,
        )
    try:
        # A prefill-only request is a plain request on P: no handle, so no peer pull.
        prefill_terms = score_prefill(
            msgspec.structs.replace(inp, peer_pullable_blocks=0) if no_decode else inp,
            workers, params)
    except NoWorkerAvailable:
        if not params.decode_only_without_prefill:
            raise
        return RouteDecision(
            mode=Mode.DECODE_ONLY, prefill_url=None, decode_url=decode_url,
            reason=f"{decode_reason}; decode only: no healthy prefill worker",
            label=RouteReason.NO_PREFILL_WORKER, uncached_tokens=uncached,
            decode_candidates=decode_terms,
        )
    prefill_url = pick({t.url: t.cost for t in prefill_terms}, params.temperature, rng)
    if no_decode:
        return RouteDecision(
            mode=Mode.PREFILL_ONLY, prefill_url=prefill_url, decode_url=decode_url,
            reason=f"{decode_reason}; prefill only: at most {inp.max_output_tokens} new "
                   f"token, computed by the prefill ({uncached} tokens uncached on D)",
            label=RouteReason.NO_DECODE,
            uncached_tokens=uncached, prefill_candidates=prefill_terms,
            decode_candidates=decode_terms,
        )
    why = "increment too large" if not small else "decode worker busy"
    label = RouteReason.INCREMENT_TOO_LARGE if not small else RouteReason.DECODE_BUSY
    prefill_chosen = next(t for t in prefill_terms if t.url == prefill_url)
    restore = _restore_for_pull(inp, chosen, prefill_chosen, params)
    not_asked = ""
    if restore:
        decode_worker = next(w for w in workers if w.url == decode_url)
        if decode_worker.restores_expire:
            not_asked = ("; not asked: this D's session lease is shorter than the handle "
                         "expiry margin")
        elif not inp.restore_allowed:
            not_asked = "; not asked: no session or token ids"
    if not_asked:
        restore = 0
    elif restore:
        why += f"; D restores {restore} tokens from its host tier for P to pull"
        label = RouteReason.HOST_TIER_PULL
    return RouteDecision(
        mode=Mode.DISAGGREGATED, prefill_url=prefill_url, decode_url=decode_url,
        reason=f"{decode_reason}; disaggregated: {why} ({uncached} uncached tokens)"
               f"{not_asked}",
        label=label, uncached_tokens=uncached, restore_tokens=restore,
        prefill_candidates=prefill_terms, decode_candidates=decode_terms,
    )


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _restore_for_pull(inp: RouteInput, decode: DecodeTerms, prefill: PrefillTerms,
                      params: RoutingParams) -> int:
    """Prompt tokens D should restore from its host tier for P to pull, or 0.

    Only where no handle already offers P the session's blocks on D (a handle's
    blocks are ``peer_pullable_blocks``) and D's reach (device and host) goes beyond
    P's own: P would
    pull that difference after D's restore, and
    :func:`vllm_sessionkv.wire.cost.decide_restore_for_pull` prices the restore and the
    pull against P recomputing it.  P's connector prices the pull again itself."""
    if decode.host_blocks <= 0 or (decode.affinity and inp.peer_pullable_blocks > 0):
        return 0
    decode_reach = decode.device_blocks + decode.host_blocks
    prefill_reach = prefill.device_blocks + prefill.host_blocks
    if decode_reach <= prefill_reach:
        return 0
    priced = decide_restore_for_pull(
        PullQuote(pull_tokens=(decode_reach - prefill_reach) * inp.block_size,
                  context_tokens=prefill_reach * inp.block_size,
                  kv_bytes_per_token=inp.kv_bytes_per_token, engine_load=0.0),
        params.recompute, params.host_link, params.link)
    return decode_reach * inp.block_size if priced.pull else 0


def routing_params_from_config(raw: Mapping[str, Any]) -> RoutingParams:
    """``RoutingParams`` from the proxy config; the connector's cost defaults where
    ``recompute`` and ``link`` are unset.  ``kv_bytes_per_token`` is a request-level
    input, not a policy parameter, and is skipped here."""
    from vllm_sessionkv.wire.cost import DEFAULT_LINK, DEFAULT_RECOMPUTE

    values = {k: v for k, v in raw.items() if k != "kv_bytes_per_token"}
    values.setdefault("recompute", msgspec.to_builtins(DEFAULT_RECOMPUTE))
    values.setdefault("link", msgspec.to_builtins(DEFAULT_LINK))
    try:
        return msgspec.convert(values, RoutingParams)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"invalid routing.params: {exc}") from None
