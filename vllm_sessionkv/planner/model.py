"""The planner's model of a model: its shape (from a Hugging Face ``config.json``),
what its KV weighs per token, and what its prefill costs in FLOPs.

Conventions.  Prefill FLOPs are ``2 * active_params * tokens`` (one multiply-add per
parameter per token, the usual published estimate; parameter counts include the
embedding and LM head as published counts do) plus an attention term,
``attention_flops_per_token_pair`` per (new token, earlier token) pair.  The reference
figures in ``docs/planner.md`` use the linear term alone, which is what published
rules of thumb quote; the attention term is reported separately because it only
matters once contexts reach tens of thousands of tokens.  Pure functions over frozen
msgspec structs; only the standard library and msgspec are imported.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import msgspec

from vllm_sessionkv.wire.cost import attention_pairs

__all__ = [
    "AttentionKind",
    "ConfigError",
    "KVDtype",
    "ModelShape",
    "attention_prefill_flops",
    "kv_bytes_per_element",
    "kv_bytes_per_token",
    "linear_prefill_flops",
    "model_shape_from_hf_config",
    "prefill_flops",
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


