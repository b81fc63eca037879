"""The capacity planner's sizing: what prefill costs on given hardware, what links
move, and how large P and D pools (and the host tier) must be for a workload.

``sessionkv-plan`` (``plan.py``) prints it; ``docs/planner.md`` documents every
formula.  The model's shape and FLOPs are ``model.py``; the runtime decisions (pull or
recompute, router credits) are ``wire/cost.py``: :func:`recompute_model_from_hardware`
derives their coefficients from the numbers here.  Pure functions over frozen msgspec
structs; only the standard library and msgspec are imported.
"""

from __future__ import annotations

import enum
import math
import statistics

import msgspec

from vllm_sessionkv.planner.model import (
    AttentionKind,
    KVDtype,
    ModelShape,
    kv_bytes_per_token,
    prefill_flops,
)
from vllm_sessionkv.wire.cost import LinkModel, RecomputeModel, transfer_time_s

__all__ = [
    "CachingRegime",
    "DecodeBandwidthPool",
    "DecodeResidencyPool",
    "Hardware",
    "HostRestore",
    "HostTierSizing",
    "LINKS",
    "LINK_100GBE",
    "LINK_200G",
    "LINK_400G",
    "LINK_NVLINK",
    "LINK_PCIE5_HOST",
    "LINK_TCP",
    "Link",
    "PrefillPool",
    "RegimeWork",
    "Workload",
    "decode_bandwidth_pool",
    "decode_residency_pool",
    "handoff_share_ratio",
    "host_restore",
    "host_tier_sizing",
    "kv_capacity_bytes_per_replica",
    "kv_copies_per_replica",
    "link_model",
    "prefill_pool",
    "prefill_time_s",
    "recompute_model_from_hardware",
    "replica_flops_per_s",
    "session_prefill_work",
    "step_new_tokens",
    "step_prompt_tokens",
    "weight_bytes",
]


# --------------------------------------------------------------------------- hardware


class Link(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A link in the planner's catalog: line rate and the share of it a bulk read gets."""

    name: str
    line_bytes_per_s: float  # per direction
    efficiency: float  # effective / line rate for large transfers
    per_transfer_s: float = 0.0

    @property
    def effective_bytes_per_s(self) -> float:
        return self.line_bytes_per_s * self.efficiency


# Assumptions, per direction, for one link per replica.  Efficiencies are what large
# (MB-sized) one-sided reads reach in practice, not a benchmark of any one system:
# NVLink 4 (H100/H200): 900 GB/s bidirectional = 450 GB/s each way; NCCL reaches ~80 %.
LINK_NVLINK = Link("nvlink", 450e9, 0.80)
# 400G / 200G InfiniBand NDR/HDR or RoCE (ConnectX-7): RDMA reads reach ~90 % of line rate.
LINK_400G = Link("400g", 400e9 / 8, 0.90)
LINK_200G = Link("200g", 200e9 / 8, 0.90)
LINK_100GBE = Link("100gbe", 100e9 / 8, 0.90)
# Kernel TCP (e.g. UCX's tcp transport) on a 100GbE port: one stream manages ~1-3 GB/s.
LINK_TCP = Link("tcp", 100e9 / 8, 0.16)
# Host DRAM tier, per GPU: PCIe Gen5 x16 is 64 GB/s per direction; pinned H2D copies
# reach ~50 GB/s.
LINK_PCIE5_HOST = Link("pcie5-host", 64e9, 0.80)

LINKS: tuple[Link, ...] = (LINK_NVLINK, LINK_400G, LINK_200G, LINK_100GBE, LINK_TCP)


class Hardware(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model replica (a TP group) and the GPUs it is made of."""

    gpu_peak_flops_per_s: float  # dense BF16 per GPU
    flops_utilisation: float  # achieved / peak during prefill (MFU)
    gpus_per_replica: int
    hbm_bytes_per_gpu: float
    hbm_bytes_per_s_per_gpu: float
    hbm_efficiency: float = 0.8  # achieved / peak bandwidth during decode
    memory_utilisation: float = 0.9  # vLLM's gpu_memory_utilization; activations live in the rest
    weight_bytes_per_param: float = 2.0
    host_link: Link = LINK_PCIE5_HOST  # per GPU

    def __post_init__(self) -> None:
        for field in ("gpu_peak_flops_per_s", "hbm_bytes_per_gpu", "hbm_bytes_per_s_per_gpu"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Hardware.{field} must be positive")
        for field in ("flops_utilisation", "hbm_efficiency", "memory_utilisation"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"Hardware.{field} must be in (0, 1]")
        if self.gpus_per_replica < 1:
            raise ValueError("Hardware.gpus_per_replica must be >= 1")


def replica_flops_per_s(hw: Hardware) -> float:
    return hw.gpu_peak_flops_per_s * hw.flops_utilisation * hw.gpus_per_replica


def prefill_time_s(flops: float, hw: Hardware) -> float:
    return flops / replica_flops_per_s(hw)


def weight_bytes(shape: ModelShape, hw: Hardware) -> float:
    return shape.total_params * hw.weight_bytes_per_param


def kv_copies_per_replica(shape: ModelShape, hw: Hardware) -> int:
    """How many copies of each token's KV a TP group stores.

    TP shards GQA by KV head, so once TP exceeds the KV heads they are replicated.  vLLM
    does not shard the MLA latent at all: every rank holds all of it.
    """
    if shape.attention is AttentionKind.MLA:
        return hw.gpus_per_replica
    return max(1, math.ceil(hw.gpus_per_replica / shape.kv_heads))


def kv_capacity_bytes_per_replica(shape: ModelShape, hw: Hardware) -> float:
    """Logical KV bytes a replica can hold after weights (negative: weights do not fit)."""
    usable = hw.gpus_per_replica * hw.hbm_bytes_per_gpu * hw.memory_utilisation
    return (usable - weight_bytes(shape, hw)) / kv_copies_per_replica(shape, hw)


def handoff_share_ratio(
    shape: ModelShape, kv_dtype: KVDtype, hw: Hardware, link_bytes_per_s: float
) -> float:
    """Handoff time over (linear) prefill time, which is independent of prompt length.

    Both sides are linear in the prompt length L, so L cancels:
    ``(L * kv_bytes_per_token / B) / (2 * active_params * L / F)
    = kv_bytes_per_token * F / (2 * active_params * B)``.
    """
    return (
        kv_bytes_per_token(shape, kv_dtype)
        * replica_flops_per_s(hw)
        / (2.0 * shape.active_params * link_bytes_per_s)
    )


# --------------------------------------------------------------------------- the connector's coefficients


def recompute_model_from_hardware(
    shape: ModelShape, hw: Hardware, load_slowdown_per_unit: float = 1.0
) -> RecomputeModel:
    """The connector's coefficients derived from the planner's numbers.

    With it, ``recompute_time_s(n, c, model, 0)`` equals
    ``prefill_time_s(prefill_flops(shape, n, c), hw)``.  A deployment that measures its
    own coefficients passes a :class:`RecomputeModel` directly instead.
    """
    flops_per_s = replica_flops_per_s(hw)
    return RecomputeModel(
        s_per_token=2.0 * shape.active_params / flops_per_s,
        s_per_token_per_context_token=shape.attention_flops_per_token_pair / flops_per_s,
        load_slowdown_per_unit=load_slowdown_per_unit,
    )


def link_model(link: Link) -> LinkModel:
    return LinkModel(bytes_per_s=link.effective_bytes_per_s, per_transfer_s=link.per_transfer_s)


# --------------------------------------------------------------------------- the planner


class Workload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An agent session: a shared prefix, a task, then ``steps`` model calls.

    Step k's prompt is prefix + task + (k-1) * (generated + tool output): each call
    generates a tool call, the tool runs for ``tool_delay_s`` and returns its output.
    """

    shared_prefix_tokens: int
    task_tokens: int
    steps: int
    tool_output_tokens: int
    generated_tokens: int
    concurrent_sessions: int
    tool_delay_s: float
    tpot_s: float  # target time per output token while decoding

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError("Workload.steps must be >= 1")
        if self.tpot_s <= 0:
            raise ValueError("Workload.tpot_s must be positive")
        for field in ("shared_prefix_tokens", "task_tokens", "tool_output_tokens",
                      "generated_tokens", "concurrent_sessions", "tool_delay_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"Workload.{field} must be >= 0")


class CachingRegime(enum.Enum):
    NONE = "none"  # every step re-prefills the whole prompt
    PREFIX = "prefix"  # the shared prefix is cached; the session history is recomputed
    SESSION = "session"  # the session's KV is kept: only tool output (and the task) is new


def step_prompt_tokens(w: Workload, step: int) -> int:
    """Prompt length of step ``step`` (1-based)."""
    return (
        w.shared_prefix_tokens
        + w.task_tokens
        + (step - 1) * (w.generated_tokens + w.tool_output_tokens)
    )


def step_new_tokens(w: Workload, step: int, regime: CachingRegime) -> tuple[int, int]:
    """(tokens to prefill, tokens already cached before them) at step ``step``.

    Under SESSION the last sampled token of the previous step, which has no KV yet, is
    ignored: one token per step.
    """
    prompt = step_prompt_tokens(w, step)
    if regime is CachingRegime.NONE:
        return prompt, 0
    if regime is CachingRegime.PREFIX or step == 1:
        return prompt - w.shared_prefix_tokens, w.shared_prefix_tokens
    return w.tool_output_tokens, prompt - w.tool_output_tokens


class RegimeWork(msgspec.Struct, frozen=True):
    regime: CachingRegime
    prefill_tokens: int  # per session, all steps
    prefill_flops: float  # per session, all steps, attention included
    prefill_s: float  # per session on an idle replica


def session_prefill_work(
    shape: ModelShape, w: Workload, hw: Hardware, regime: CachingRegime
) -> RegimeWork:
    tokens, flops = 0, 0.0
    for step in range(1, w.steps + 1):
        new, context = step_new_tokens(w, step, regime)
        tokens += new
        flops += prefill_flops(shape, new, context)
    return RegimeWork(regime, tokens, flops, prefill_time_s(flops, hw))


class HostRestore(msgspec.Struct, frozen=True):
    tokens: int
    restore_bytes: float
    restore_s: float
    recompute_s: float


def host_restore(
    shape: ModelShape, kv_dtype: KVDtype, hw: Hardware, tokens: int, context_tokens: int
) -> HostRestore:
    """Restoring ``tokens`` of KV from host DRAM against recomputing them.

    Each GPU copies its own shard over its own PCIe link, so bytes per GPU are the
    stored bytes divided by the TP size (MLA's replicated latent: the full latent each).
    """
    stored = tokens * kv_bytes_per_token(shape, kv_dtype) * kv_copies_per_replica(shape, hw)
    restore_s = transfer_time_s(
        stored / hw.gpus_per_replica, hw.host_link.effective_bytes_per_s, hw.host_link.per_transfer_s
    )
    recompute_s = prefill_time_s(prefill_flops(shape, tokens, context_tokens), hw)
    return HostRestore(tokens, tokens * kv_bytes_per_token(shape, kv_dtype), restore_s, recompute_s)


class PrefillPool(msgspec.Struct, frozen=True):
    regime: CachingRegime
    step_cycle_s: float  # prefill + decode + tool delay, per step
    steps_per_s: float  # arrival rate of model calls, all sessions
    prefill_flops_per_s: float  # demand
    replicas: int
    gpus: int


def _mean_step_prefill(
    shape: ModelShape, w: Workload, hw: Hardware, regime: CachingRegime
) -> tuple[float, float]:
    work = session_prefill_work(shape, w, hw, regime)
    return work.prefill_flops / w.steps, work.prefill_s / w.steps


def _step_cycle_s(shape: ModelShape, w: Workload, hw: Hardware, regime: CachingRegime) -> float:
    _, prefill_s = _mean_step_prefill(shape, w, hw, regime)
    return prefill_s + w.generated_tokens * w.tpot_s + w.tool_delay_s


def prefill_pool(shape: ModelShape, w: Workload, hw: Hardware, regime: CachingRegime) -> PrefillPool:
    """P replicas by throughput: FLOP/s demanded over FLOP/s a replica delivers.

    Each session issues one call per cycle, so calls arrive at
    ``concurrent_sessions / step_cycle_s`` (Little's law) and each brings the mean
    per-step prefill.  Queueing is not modelled: the MFU is the headroom.
    """
    flops_per_step, _ = _mean_step_prefill(shape, w, hw, regime)
    cycle_s = _step_cycle_s(shape, w, hw, regime)
    steps_per_s = w.concurrent_sessions / cycle_s
    demand = steps_per_s * flops_per_step
    replicas = math.ceil(demand / replica_flops_per_s(hw))
    return PrefillPool(regime, cycle_s, steps_per_s, demand, replicas, replicas * hw.gpus_per_replica)


def _mean_session_kv_tokens(w: Workload, *, include_prefix: bool) -> float:
    # What a session holds while it waits on its tool: its prompt plus what it generated.
    held = sum(step_prompt_tokens(w, k) + w.generated_tokens for k in range(1, w.steps + 1))
    mean = held / w.steps
    return mean if include_prefix else mean - w.shared_prefix_tokens


class DecodeResidencyPool(msgspec.Struct, frozen=True):
    kv_dtype: KVDtype
    prefix_dedup: bool
    retained: bool  # True: sessions keep KV through tool calls; False: freed after each call
    resident_sessions: float
    kv_bytes_per_session: float
    replica_kv_capacity_bytes: float
    replicas: int | None  # None: weights (and the deduped prefix) leave no room for KV
    gpus: int | None


def decode_residency_pool(
    shape: ModelShape,
    kv_dtype: KVDtype,
    hw: Hardware,
    w: Workload,
    *,
    prefix_dedup: bool,
    retained: bool = True,
) -> DecodeResidencyPool:
    """D replicas needed to hold the KV that is resident, by Little's law.

    Resident sessions = arrival rate x residency time.  Retained sessions stay for the
    whole cycle (so all ``concurrent_sessions`` are resident); otherwise only while
    decoding.  With prefix dedup the shared prefix is stored once per replica.
    """
    per_token = kv_bytes_per_token(shape, kv_dtype)
    cycle_s = _step_cycle_s(shape, w, hw, CachingRegime.SESSION if retained else CachingRegime.PREFIX)
    residency_s = cycle_s if retained else w.generated_tokens * w.tpot_s
    resident = w.concurrent_sessions / cycle_s * residency_s
    per_session = _mean_session_kv_tokens(w, include_prefix=not prefix_dedup) * per_token
    capacity = kv_capacity_bytes_per_replica(shape, hw)
    room = capacity - (w.shared_prefix_tokens * per_token if prefix_dedup else 0.0)
    if room <= 0:
        return DecodeResidencyPool(kv_dtype, prefix_dedup, retained, resident, per_session,
                                   capacity, None, None)
    replicas = max(1, math.ceil(resident * per_session / room))
    return DecodeResidencyPool(kv_dtype, prefix_dedup, retained, resident, per_session, capacity,
                               replicas, replicas * hw.gpus_per_replica)


class DecodeBandwidthPool(msgspec.Struct, frozen=True):
    kv_dtype: KVDtype
    decoding_sessions: float
    kv_read_bytes_per_session: float  # per decode step
    max_batch_sessions: float  # per replica, at the target TPOT
    replicas: int | None  # None: reading the weights alone takes longer than tpot_s
    gpus: int | None


def decode_bandwidth_pool(
    shape: ModelShape, kv_dtype: KVDtype, hw: Hardware, w: Workload
) -> DecodeBandwidthPool:
    """D replicas needed to decode at ``tpot_s``: each step reads the weights once and
    every batched session's KV (prefix dedup saves memory, not these reads).

    Decoding sessions = call rate x decode time (Little's law).  MoE weights are
    counted in full: at serving batch sizes nearly every expert is touched each step.
    """
    # Each rank reads its own copy, so replicated KV (MLA, or TP > KV heads) costs more.
    read_per_session = (
        _mean_session_kv_tokens(w, include_prefix=True)
        * kv_bytes_per_token(shape, kv_dtype)
        * kv_copies_per_replica(shape, hw)
    )
    cycle_s = _step_cycle_s(shape, w, hw, CachingRegime.SESSION)
    decoding = w.concurrent_sessions / cycle_s * w.generated_tokens * w.tpot_s
    budget = w.tpot_s * hw.hbm_bytes_per_s_per_gpu * hw.hbm_efficiency * hw.gpus_per_replica
    spare = budget - weight_bytes(shape, hw)
    if spare <= 0:
        return DecodeBandwidthPool(kv_dtype, decoding, read_per_session, 0.0, None, None)
    batch = spare / read_per_session
    replicas = max(1, math.ceil(decoding / batch))
    return DecodeBandwidthPool(kv_dtype, decoding, read_per_session, batch, replicas,
                               replicas * hw.gpus_per_replica)


class HostTierSizing(msgspec.Struct, frozen=True):
    target_warm_share_ratio: float  # of sessions whose next turn finds their KV
    gap_p50_s: float
    gap_p99_s: float
    gap_mean_s: float
    lease_s: float
    outliving_lease_ratio: float  # of gaps: the turns only the host tier keeps warm
    warm_gap_s: float  # the gap quantile at the target share
    sessions_per_replica: float
    finished_sessions_per_s: float  # per D
    kv_bytes_per_session: float  # beyond the shared prefix (stored once)
    host_sessions_per_replica: float
    host_bytes_per_replica: float


def host_tier_sizing(
    shape: ModelShape,
    kv_dtype: KVDtype,
    hw: Hardware,
    w: Workload,
    *,
    decode_replicas: int,
    gap_p50_s: float,
    gap_p99_s: float,
    lease_s: float,
    warm_share: float,
) -> HostTierSizing:
    """Host DRAM per D that keeps ``warm_share`` of sessions' KV reachable
    across their tool gaps.

    Gaps are lognormal through (p50, p99); ``w.tool_delay_s`` is replaced by their
    mean.  The host tier is written through at the end of every turn and evicts the
    least recently used blocks, so a session's KV survives a gap ``g`` iff the turns
    its D finishes during ``g`` (each one a session's KV, written) fit beside it:
    ``finished_sessions_per_s * g`` sessions.  Keeping the ``warm_share``
    quantile of gaps warm takes that many sessions' KV (the shared prefix once).
    Gaps shorter than the lease are also served from device while the hold lasts;
    ``outliving_lease_ratio`` is the share only the host tier keeps.
    """
    if not 0.0 < warm_share < 1.0:
        raise ValueError("target warm share must be in (0, 1)")
    if not 0.0 < gap_p50_s < gap_p99_s:
        raise ValueError("gaps: need 0 < p50 < p99")
    if decode_replicas < 1 or lease_s < 0:
        raise ValueError("decode replicas must be >= 1 and the lease >= 0")
    normal = statistics.NormalDist()
    mu = math.log(gap_p50_s)
    sigma = (math.log(gap_p99_s) - mu) / normal.inv_cdf(0.99)
    mean_gap = math.exp(mu + sigma * sigma / 2)
    outliving = 1.0 - normal.cdf((math.log(lease_s) - mu) / sigma) if lease_s > 0 else 1.0
    warm_gap = math.exp(mu + sigma * normal.inv_cdf(warm_share))
    w_gaps = msgspec.structs.replace(w, tool_delay_s=mean_gap)
    cycle_s = _step_cycle_s(shape, w_gaps, hw, CachingRegime.SESSION)
    sessions = w.concurrent_sessions / decode_replicas
    finished_per_s = sessions / cycle_s
    host_sessions = min(sessions, finished_per_s * warm_gap)
    per_token = kv_bytes_per_token(shape, kv_dtype)
    per_session = _mean_session_kv_tokens(w, include_prefix=False) * per_token
    host_bytes = host_sessions * per_session + w.shared_prefix_tokens * per_token
    return HostTierSizing(warm_share, gap_p50_s, gap_p99_s, mean_gap, lease_s,
                          outliving, warm_gap, sessions, finished_per_s, per_session,
                          host_sessions, host_bytes)
