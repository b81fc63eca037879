"""The routing vocabulary the proxy shares: the roles, modes and reasons (enums),
and the policy's frozen inputs and outputs (:mod:`sessionkv_proxy.policy` decides
on them; the router gathers them)."""

from __future__ import annotations

import enum
from collections.abc import Mapping

import msgspec

from vllm_sessionkv.wire.cost import (
    DEFAULT_DISK_LINK,
    DEFAULT_HOST_LINK,
    LinkModel,
    OverlapWeights,
    RecomputeModel,
)
from vllm_sessionkv.wire.protocol import HANDLE_EXPIRY_MARGIN_S

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
    "Tier",
    "TierOverlap",
    "WorkerLoad",
]


class Role(str, enum.Enum):
    """An engine's pool; the proxy's one role type (``config.Role`` is this)."""

    PREFILL = "prefill"
    DECODE = "decode"


class Mode(str, enum.Enum):
    DISAGGREGATED = "disaggregated"  # P prefills, D pulls the KV and decodes
    DECODE_ONLY = "decode_only"  # D prefills the uncached rest itself
    PREFILL_ONLY = "prefill_only"  # nothing to decode: P serves the whole request


class Tier(str, enum.Enum):
    """Where an engine holds a prompt's KV, cheapest to reuse first.  A request's
    route reason names the slowest tier D restores from (``RouteReason``)."""

    DEVICE = "device"  # the engine's KV cache: reused in place
    HOST = "host"  # host DRAM (host_tier_bytes): a copy into the KV cache
    DISK = "disk"  # files (disk_tier_bytes): a read into host DRAM, then that copy


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
    # As HOST_TIER and HOST_TIER_PULL, with part of the prefix read from D's disk tier
    # (beneath its host tier) first.
    DISK_TIER = "disk_tier"
    DISK_TIER_PULL = "disk_tier_pull"
    # Decode only: the request is several engine requests (n > 1, a batch of prompts),
    # and one P -> D hand-off carries one.
    SEVERAL_ENGINE_REQUESTS = "several_engine_requests"
    # Decode only: with P's queued prefill work the turn would have its prompt computed
    # later through P than on D alone (``policy._prefill_queued``).
    PREFILL_QUEUED = "prefill_queued"
    # Decode only: the session's handle would expire in P's queue (P would refuse it and
    # recompute the history), and the session's D, which holds it, has room
    # (``queue_expiry.handle_expires_in_queue``).
    HANDLE_EXPIRES_IN_QUEUE = "handle_expires_in_queue"
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
    # Prompt work queued here, in blocks of compute: of the requests routed here and
    # not yet answered (P) or still running (D), what this engine computes of their
    # prompts.  On P, each prompt less the credit for what P holds or pulls (a pull
    # counts at its price, the share of a recompute it costs); on D, the uncached
    # prompt of each request it serves alone (0 for a disaggregated one).  Counted
    # until the answer (P) or the request's end (D), so D's is an upper bound.
    queued_prefill_blocks: float = 0.0
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc as a fraction in [0, 1]
    # The share of that usage D frees on demand: blocks only session holds keep
    # (sessionkv_session_hold_blocks over the engine's blocks), which D ends for a
    # request it cannot admit.  0 where the engine does not say (stock vLLM, an older
    # connector).  The policy reads ``policy.net_kv_usage``.
    kv_reclaimable: float = 0.0
    # The engine's own recompute price per new token (P: its calibrated
    # sessionkv_recompute_seconds_per_token); None where it does not say.
    recompute_s_per_token: float | None = None
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
    disk_blocks: int = 0


class SessionView(msgspec.Struct, frozen=True, kw_only=True):
    """What the proxy knows of the request's session (from its stored handle)."""

    session_id: str
    last_decode: str | None = None  # URL of the D that holds the session's KV
    # The session handle's end (D's lease on the blocks, ``expires_at_unix_s``); None:
    # no handle goes with the request, or its end is unknown.
    expires_at_s: float | None = None


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
    # Price a P's queue with the recompute price P reports
    # (sessionkv_recompute_seconds_per_token, calibrated) in place of
    # recompute.s_per_token (prices.recompute_price).  routing_params_from_config
    # turns it off where ``recompute`` is configured: the operator's price rules.
    recompute_from_engines: bool = True
    link: LinkModel  # D -> P link used by peer pulls
    # Host DRAM -> engine KV copies: prices host-tier credits (the connector's
    # ``host_copy_*``), in place of a fixed host weight.
    host_link: LinkModel = DEFAULT_HOST_LINK
    # Disk-tier file -> host DRAM -> engine KV reads: prices disk-tier credits (the
    # connector's ``disk_read_*``).
    disk_link: LinkModel = DEFAULT_DISK_LINK
    weights: OverlapWeights = OverlapWeights()
    prefill_load_scale: float = 1.0
    decode_load_scale: float = 1.0
    overlap_credit_decay: float = 1.0  # 0: no hot-spot decay (Dynamo's default)
    decode_kv_pressure_threshold: float = 0.9
    decode_only_max_uncached_tokens: int = 256  # -1 turns decode-only off (every rule)
    decode_only_max_kv_usage: float = 0.8
    decode_only_max_active_requests: int = 32
    # Load-aware decode only: a turn that is not small goes to D alone when P's queued
    # prefill work would make it start later through P than on D alone, and D's queued
    # prefill work with this turn's stays within this many tokens (D's running
    # decodes share each step with that prefill: the bound keeps them from being
    # starved; vLLM's default step budget, max_num_batched_tokens, is 2048).  0 turns
    # it off (P's queue is then ignored, as before), and so does
    # ``decode_only_max_uncached_tokens: -1``.  See ``policy._prefill_queued``.
    decode_only_prefill_queued_max_tokens: int = 2048
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
                     "session_affinity_yield_weight",
                     "decode_only_prefill_queued_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"RoutingParams.{name} must be >= 0")
        for name in ("decode_kv_pressure_threshold", "decode_only_max_kv_usage",
                     "decode_affinity_min_gain"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"RoutingParams.{name} must be in [0, 1]")


class PrefillTerms(msgspec.Struct, frozen=True, kw_only=True):
    """One P candidate's cost and every term in it (docs/routing.md)."""

    url: str
    active_prefill_blocks: float
    prompt_blocks: int
    device_blocks: int
    host_blocks: int  # beyond device_blocks
    host_weight: float  # credit per host block: the share of its recompute a restore saves
    peer_blocks: int  # beyond device_blocks, host_blocks and disk_blocks
    peer_weight: float
    raw_credit_blocks: float
    excess_blocks: float  # active_prefill_blocks above the least loaded P
    decay: float
    credit_blocks: float
    adjusted_prefill_blocks: float
    active_decode_blocks: float
    cost: float
    # ``WorkerLoad.queued_prefill_blocks`` (P's queued compute), for the load-aware
    # decode-only rule; not part of ``cost``.
    queued_prefill_blocks: float = 0.0
    recompute_s_per_token: float | None = None  # ``WorkerLoad.recompute_s_per_token``
    disk_blocks: int = 0  # beyond device_blocks and host_blocks, on P's disk tier
    disk_weight: float = 0.0  # credit per disk block

    @property
    def work_blocks(self) -> float:
        """What P computes for this request, in blocks: the prompt less the credit for
        what it holds or pulls (a pull at its price, no hot-spot decay)."""
        return max(0.0, self.prompt_blocks - self.raw_credit_blocks)


class DecodeTerms(msgspec.Struct, frozen=True, kw_only=True):
    """One D candidate's cost, pressure and affinity."""

    url: str
    active_decode_blocks: float
    queued_decode_blocks: float = 0.0  # ``WorkerLoad.queued_decode_blocks``
    queued_prefill_blocks: float = 0.0  # ``WorkerLoad.queued_prefill_blocks``
    device_blocks: int  # prompt blocks D holds on device (index or verified session)
    host_blocks: int = 0  # beyond device_blocks, on D's host tier (restored, not computed)
    host_weight: float = 0.0  # share of their recompute a restore saves
    disk_blocks: int = 0  # beyond device and host blocks, on D's disk tier
    disk_weight: float = 0.0  # share of their recompute a disk restore saves
    new_blocks: int  # blocks D must receive or compute: the prompt less all three
    kv_usage: float  # ``WorkerLoad.kv_usage``, vLLM's own figure
    kv_reclaimable: float = 0.0  # ``WorkerLoad.kv_reclaimable``
    # What the pressure and room checks read: ``policy.net_kv_usage``.
    net_kv_usage: float = 0.0
    active_requests: int
    affinity: bool  # holds the request's live session
    over_pressure: bool  # net_kv_usage over decode_kv_pressure_threshold
    recent_placements: int = 0
    prefix_affinity: bool = False  # chosen for its prefix, within the load bound
    cost: float

    @property
    def restored_from(self) -> Tier | None:
        """The slowest tier D restores this prompt's prefix from (host or disk), or
        None when it restores nothing."""
        if self.disk_blocks:
            return Tier.DISK
        return Tier.HOST if self.host_blocks else None


class RouteDecision(msgspec.Struct, frozen=True, kw_only=True):
    mode: Mode
    prefill_url: str | None
    decode_url: str  # with PREFILL_ONLY: the D that would have decoded, not called
    reason: str
    label: RouteReason
    uncached_tokens: int  # prompt tokens the chosen D holds on no tier (device, host, disk)
    # HOST_TIER_PULL, DISK_TIER_PULL: prompt tokens D restores from its host (and disk)
    # tier for P to pull (the
    # router asks D for them first, as a one-token session turn); 0 otherwise.
    restore_tokens: int = 0
    # The session's handle would expire in P's queue (``queue_expiry``): it is not sent
    # to P (the router counts the handle ``expires_in_queue``), whether D serves the
    # turn alone or P recomputes it.
    handle_expires_in_queue: bool = False
    prefill_candidates: tuple[PrefillTerms, ...] = ()
    decode_candidates: tuple[DecodeTerms, ...] = ()

    @property
    def prefill_work_blocks(self) -> float:
        """What the chosen P computes for this request (``PrefillTerms.work_blocks``);
        0 when no P serves it."""
        chosen = next((t for t in self.prefill_candidates if t.url == self.prefill_url),
                      None)
        return chosen.work_blocks if chosen is not None else 0.0

    @property
    def decode_placed(self) -> bool:
        """D was chosen by cost, not by session or prefix affinity, and is sent the
        request: the caller counts it as a placement for ``recent_placements``."""
        if self.mode is Mode.PREFILL_ONLY:
            return False
        chosen = next(t for t in self.decode_candidates if t.url == self.decode_url)
        return not (chosen.affinity or chosen.prefix_affinity)
