"""The capacity planner's model: what KV weighs, what prefill costs on given
hardware, what links move, and how large P and D pools must be for a workload.

``sessionkv-plan`` (``plan.py``) prints it; ``docs/planner.md`` documents every
formula.  The runtime decisions (pull or recompute, router credits) are ``cost.py``;
:func:`recompute_model_from_hardware` derives their coefficients from the numbers
here.  Pure functions over frozen msgspec structs; only the standard library and
msgspec are imported.

Conventions.  Prefill FLOPs are ``2 * active_params * tokens`` (one multiply-add per
parameter per token, the usual published estimate; parameter counts include the
embedding and LM head as published counts do) plus an attention term,
``attention_flops_per_token_pair`` per (new token, earlier token) pair.  The reference
figures in ``docs/planner.md`` use the linear term alone, which is what published
rules of thumb quote; the attention term is reported separately because it only
matters once contexts reach tens of thousands of tokens.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Mapping
from typing import Any

import msgspec

from vllm_sessionkv.cost import LinkModel, RecomputeModel, attention_pairs, transfer_time_s

__all__ = [
    "AttentionKind",
    "CachingRegime",
    "ConfigError",
    "DecodeBandwidthPool",
    "DecodeResidencyPool",
    "Hardware",
    "HostRestore",
    "HostTierSizing",
    "KVDtype",
    "LINKS",
    "LINK_100GBE",
    "LINK_200G",
    "LINK_400G",
    "LINK_NVLINK",
    "LINK_PCIE5_HOST",
    "LINK_TCP",
    "Link",
    "ModelShape",
    "PrefillPool",
    "RegimeWork",
    "Workload",
    "attention_prefill_flops",
    "decode_bandwidth_pool",
    "decode_residency_pool",
    "handoff_share_ratio",
    "host_restore",
    "host_tier_sizing",
    "kv_bytes_per_element",
    "kv_bytes_per_token",
    "kv_capacity_bytes_per_replica",
    "kv_copies_per_replica",
    "linear_prefill_flops",
    "link_model",
    "model_shape_from_hf_config",
    "prefill_flops",
    "prefill_pool",
    "prefill_time_s",
    "recompute_model_from_hardware",
    "replica_flops_per_s",
    "session_prefill_work",
    "step_new_tokens",
    "step_prompt_tokens",
    "weight_bytes",
]


# --------------------------------------------------------------------------- model shape


class ConfigError(ValueError):
    """An HF ``config.json`` lacks a key the estimate needs, or holds a bad value."""

    def __init__(self, key: str, problem: str = "missing") -> None:
        super().__init__(f"{problem} key {key!r} in the HF config")
        self.key = key


class AttentionKind(enum.Enum):
    GQA = "gqa"  # K and V per KV head (MHA and MQA are the cases kv_heads = heads and 1)
    MLA = "mla"  # DeepSeek: one compressed latent (+ rope key) per layer, shared by heads


class KVDtype(enum.Enum):
    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


# NVFP4 stores 4-bit values with one FP8 (E4M3) scale per 16 values: 0.5 + 1/16 bytes.
# Its per-tensor FP32 scale is a constant, not per token, and is left out.
_BYTES_PER_ELEMENT: Mapping[KVDtype, float] = {
    KVDtype.BF16: 2.0,
    KVDtype.FP8: 1.0,
    KVDtype.NVFP4: 0.5 + 1.0 / 16.0,
}


def kv_bytes_per_element(kv_dtype: KVDtype) -> float:
    return _BYTES_PER_ELEMENT[kv_dtype]


class ModelShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the cost model needs to know about a model, and nothing else."""

    name: str
    attention: AttentionKind
    layers: int
    kv_heads: int  # 1 for MLA: the latent is shared by all heads
    kv_head_dim: int  # for MLA: kv_lora_rank + qk_rope_head_dim
    kv_tensors_per_layer: int  # 2 (K and V) for GQA, 1 (the latent) for MLA
    attention_flops_per_token_pair: float  # QK^T and AV, all layers, per (new, earlier) pair
    total_params: float  # what the weights weigh
    active_params: float  # what one token multiplies by (MoE: routed top-k + shared)

    @property
    def kv_elements_per_token(self) -> int:
        return self.layers * self.kv_tensors_per_layer * self.kv_heads * self.kv_head_dim


def _require(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise ConfigError(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(key, "non-positive or non-integer")
    return value


def _optional(cfg: Mapping[str, Any], key: str, default: int) -> int:
    return _require(cfg, key) if cfg.get(key) is not None else default


def _mlp_params(hidden: int, intermediate: int) -> int:
    # Gated MLP (gate, up, down), as in Llama, Mistral, Qwen and DeepSeek.
    return 3 * hidden * intermediate


def model_shape_from_hf_config(
    cfg: Mapping[str, Any],
    *,
    name: str | None = None,
    total_params: float | None = None,
    active_params: float | None = None,
) -> ModelShape:
    """Read a :class:`ModelShape` from an HF ``config.json`` dict.

    Parameter counts are estimated from the config (embeddings, attention, gated MLP,
    routed and shared experts, router; norms and biases are negligible and left out)
    unless given.  A multimodal config's ``text_config`` is used when present.
    Raises :class:`ConfigError` naming the first missing key.
    """
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg, **cfg["text_config"]}
    layers = _require(cfg, "num_hidden_layers")
    hidden = _require(cfg, "hidden_size")
    heads = _require(cfg, "num_attention_heads")

    if cfg.get("kv_lora_rank") is not None:
        attention = AttentionKind.MLA
        kv_lora_rank = _require(cfg, "kv_lora_rank")
        rope_dim = _require(cfg, "qk_rope_head_dim")
        nope_dim = _require(cfg, "qk_nope_head_dim")
        v_dim = _require(cfg, "v_head_dim")
        kv_heads, kv_head_dim, kv_tensors = 1, kv_lora_rank + rope_dim, 1
        # Prefill runs MLA un-absorbed: per head, QK^T over nope+rope dims and AV over v.
        attn_pair_flops = 2.0 * layers * heads * (nope_dim + rope_dim + v_dim)
        q_lora_rank = cfg.get("q_lora_rank")
        q_params = (
            hidden * q_lora_rank + q_lora_rank * heads * (nope_dim + rope_dim)
            if q_lora_rank
            else hidden * heads * (nope_dim + rope_dim)
        )
        attn_params = (
            q_params
            + hidden * (kv_lora_rank + rope_dim)
            + kv_lora_rank * heads * (nope_dim + v_dim)
            + heads * v_dim * hidden
        )
    else:
        attention = AttentionKind.GQA
        # HF convention: absent num_key_value_heads means plain multi-head attention.
        kv_heads = _optional(cfg, "num_key_value_heads", heads)
        if hidden % heads and cfg.get("head_dim") is None:
            raise ConfigError("head_dim")
        head_dim = _optional(cfg, "head_dim", hidden // heads)
        kv_head_dim, kv_tensors = head_dim, 2
        attn_pair_flops = 2.0 * layers * heads * (head_dim + head_dim)
        attn_params = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim

    if total_params is None or active_params is None:
        est_total, est_active = _estimate_params(cfg, layers, hidden, attn_params)
        if total_params is None:
            # A dense model's one override is its only count.
            dense = est_total == est_active
            total_params = active_params if dense and active_params is not None else est_total
        if active_params is None:
            active_params = est_active
    if active_params <= 0 or total_params < active_params:
        raise ValueError(
            f"need 0 < active_params <= total_params, got {active_params:g} and {total_params:g}"
        )
    return ModelShape(
        name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "model"),
        attention=attention,
        layers=layers,
        kv_heads=kv_heads,
        kv_head_dim=kv_head_dim,
        kv_tensors_per_layer=kv_tensors,
        attention_flops_per_token_pair=attn_pair_flops,
        total_params=float(total_params),
        active_params=float(active_params),
    )


def _estimate_params(
    cfg: Mapping[str, Any], layers: int, hidden: int, attn_params: int
) -> tuple[float, float]:
    vocab = _require(cfg, "vocab_size")
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    experts = next(
        (cfg[k] for k in ("n_routed_experts", "num_local_experts", "num_experts") if cfg.get(k)),
        0,
    )
    if not experts:
        per_layer = attn_params + _mlp_params(hidden, _require(cfg, "intermediate_size"))
        return float(embed + layers * per_layer), float(embed + layers * per_layer)

    top_k = _require(cfg, "num_experts_per_tok")
    expert_inter = (
        _require(cfg, "moe_intermediate_size")
        if cfg.get("moe_intermediate_size") is not None
        else _require(cfg, "intermediate_size")
    )
    expert = _mlp_params(hidden, expert_inter)
    # DeepSeek counts shared experts; Qwen-MoE gives one shared expert's width instead.
    shared = cfg.get("n_shared_experts") or 0
    shared_params = shared * expert
    if cfg.get("shared_expert_intermediate_size"):
        shared_params += _mlp_params(hidden, cfg["shared_expert_intermediate_size"])
    router = hidden * experts
    # DeepSeek keeps its first layers dense, with their own (wider) intermediate size.
    dense_layers = min(layers, cfg.get("first_k_dense_replace") or 0)
    moe_layers = layers - dense_layers
    dense_params = (
        dense_layers * (attn_params + _mlp_params(hidden, _require(cfg, "intermediate_size")))
        if dense_layers
        else 0
    )
    moe_common = moe_layers * (attn_params + shared_params + router)
    total = embed + dense_params + moe_common + moe_layers * experts * expert
    active = embed + dense_params + moe_common + moe_layers * top_k * expert
    return float(total), float(active)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: KVDtype) -> float:
    """Logical KV bytes one token adds, over all layers (one copy, however sharded)."""
    return shape.kv_elements_per_token * kv_bytes_per_element(kv_dtype)


# --------------------------------------------------------------------------- FLOPs, time


def linear_prefill_flops(shape: ModelShape, new_tokens: int) -> float:
    """The weight matmuls: one multiply-add per active parameter per token."""
    return 2.0 * shape.active_params * max(0, new_tokens)


def attention_prefill_flops(shape: ModelShape, new_tokens: int, context_tokens: int = 0) -> float:
    """QK^T and AV for ``new_tokens`` tokens placed after ``context_tokens`` cached ones."""
    return shape.attention_flops_per_token_pair * attention_pairs(new_tokens, context_tokens)


def prefill_flops(
    shape: ModelShape, new_tokens: int, context_tokens: int = 0, *, attention: bool = True
) -> float:
    """Prefill FLOPs; ``attention=False`` gives the linear estimate published figures use."""
    flops = linear_prefill_flops(shape, new_tokens)
    if attention:
        flops += attention_prefill_flops(shape, new_tokens, context_tokens)
    return flops


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
