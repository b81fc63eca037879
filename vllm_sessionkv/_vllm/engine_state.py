"""Reads of vLLM's own objects: a request's session and salt, a step's size, the KV
cache's shape, its block pool's free blocks and reference counts; and host-tier
changes as vLLM KV events."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = [
    "host_tier_events",
    "kv_bytes_per_block",
    "kv_block_ref_counts",
    "kv_bytes_per_token",
    "kv_free_blocks",
    "kv_cache_group_count",
    "kv_hash_tokens",
    "kv_num_blocks",
    "model_identity",
    "request_has_extra_keys",
    "request_finished_with_output",
    "request_cache_salt",
    "request_session_id",
    "scheduled_requests",
    "scheduled_work",
]


def request_session_id(request: Request) -> str | None:
    return getattr(request, "session_id", None) or None


def request_cache_salt(request: Request) -> str | None:
    return getattr(request, "cache_salt", None) or None


def request_finished_with_output(request: Request) -> bool:
    """Whether the request ended on an output of its own (a stop, its length, a
    repetition), not by an abort, an error or being ignored."""
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_STOPPED,
                              RequestStatus.FINISHED_LENGTH_CAPPED,
                              RequestStatus.FINISHED_REPETITION)


def scheduled_requests(scheduler_output: Any) -> int:
    """Number of requests that ran in a scheduler step: our engine-load signal."""
    return len(getattr(scheduler_output, "num_scheduled_tokens", None) or {})


def scheduled_work(scheduler_output: Any) -> list[tuple[int, int]]:
    """(new tokens, tokens computed before them) for each request a scheduler step
    runs: what the step's forward computes, for timing the engine's recompute speed."""
    num_scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    computed: dict[str, int] = {}
    for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        computed[new.req_id] = getattr(new, "num_computed_tokens", 0)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    computed.update(zip(getattr(cached, "req_ids", None) or (),
                        getattr(cached, "num_computed_tokens", None) or ()))
    return [(int(tokens), int(computed.get(req_id, 0)))
            for req_id, tokens in num_scheduled.items()]


def kv_bytes_per_token(kv_cache_config: Any, block_size: int) -> float:
    """KV bytes one token occupies across all layers (what a pull moves per token)."""
    total_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
    num_blocks = kv_cache_config.num_blocks
    if not total_bytes or not num_blocks:
        return 0.0
    return total_bytes / num_blocks / block_size


def kv_num_blocks(kv_cache_config: Any) -> int:
    """Blocks in the engine's KV cache (0 when not known)."""
    return getattr(kv_cache_config, "num_blocks", 0) or 0


def kv_free_blocks(kv_cache_manager: Any) -> int | None:
    """Blocks vLLM could allocate now (free or only cached), None when not known.
    Private state used (vLLM 0.32): ``KVCacheManager.block_pool``."""
    pool = getattr(kv_cache_manager, "block_pool", None)
    return None if pool is None else pool.get_num_free_blocks()


def kv_block_ref_counts(kv_cache_manager: Any, block_ids: Iterable[int]
                        ) -> dict[int, int] | None:
    """Each block's reference count in vLLM's block pool (how many requests, running
    or finished with their free delayed, hold it; 0 for the null block, whose count
    vLLM does not keep), None when not known.  Private state used (vLLM 0.32):
    ``KVCacheManager.block_pool``, ``BlockPool.blocks`` and ``.null_block``,
    ``KVCacheBlock.ref_cnt``.  Read with ``map`` (about 0.35 us a block, not 0.6
    in a loop): D counts every held block."""
    pool = getattr(kv_cache_manager, "block_pool", None)
    if pool is None:
        return None
    ids = list(block_ids)
    out = dict(zip(ids, map(operator.attrgetter("ref_cnt"),
                            map(pool.blocks.__getitem__, ids))))
    if pool.null_block.block_id in out:
        out[pool.null_block.block_id] = 0
    return out


def kv_bytes_per_block(kv_cache_config: Any) -> int:
    """Bytes one block occupies across all layers (host-tier slot size)."""
    if not kv_cache_config.num_blocks:
        return 0
    return sum(t.size for t in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks


def host_tier_events(events: list[tuple[str, str, list[bytes]]]) -> list[Any]:
    """Host- and disk-tier changes as vLLM KV events (``(medium, kind, hashes)``:
    ``medium="CPU"`` or ``"STORAGE"``, the media vLLM's own offloading tiers report),
    published by the scheduler in the same batch as the engine's own events.
    Placeholders (no token ids), as vLLM's OffloadingConnector emits by default: the
    router places them by the engine hash it already knows from the device-tier
    event."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: list[Any] = []
    for medium, kind, hashes in events:
        converted = [maybe_convert_block_hash(h) for h in hashes]
        if kind == "stored":
            out.append(BlockStored(block_hashes=converted, parent_block_hash=None,
                                   token_ids=[], block_size=0, lora_id=None, medium=medium,
                                   lora_name=None))
        else:
            out.append(BlockRemoved(block_hashes=converted, medium=medium))
    return out


def kv_cache_group_count(kv_cache_config: Any) -> int:
    """KV cache groups (more than one: a hybrid model, e.g. sliding-window layers)."""
    return len(getattr(kv_cache_config, "kv_cache_groups", None) or ())


def kv_hash_tokens(kv_cache_config: Any, block_size: int) -> int:
    """Tokens per prefix-cache block hash (``Request.block_hashes``): vLLM sets
    ``hash_block_size`` on the KV cache config before the scheduler is built; the
    block size where it is not set (a single group hashes per block)."""
    return getattr(kv_cache_config, "hash_block_size", None) or block_size


def request_has_extra_keys(request: Request) -> bool:
    """Whether vLLM's block hashes for this request carry keys beyond its tokens
    (``generate_block_hash_extra_keys``: a LoRA adapter, multimodal inputs, prompt
    embeddings; the cache salt is our tenant, checked on its own)."""
    return bool(getattr(request, "lora_request", None) or getattr(request, "mm_features", None)
                or getattr(request, "prompt_embeds", None) is not None)


def model_identity(vllm_config: Any) -> str:
    """What two engines must agree on for one's KV to stand for the other's: the
    model and its revision, tokenizer, quantization, dtypes, config overrides and
    RoPE settings (NIXL's handshake hash covers the model name, dtypes and shapes,
    not these).  "" where the operator turned NIXL's compatibility check off
    (``enforce_handshake_compat: false``), which tests do on purpose."""
    import hashlib
    import json

    transfer = vllm_config.kv_transfer_config
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    if extra.get("enforce_handshake_compat", True) is False:
        return ""
    model = vllm_config.model_config
    hf_config = getattr(model, "hf_config", None)
    factors = {
        "model": model.model, "revision": model.revision,
        "tokenizer": model.tokenizer, "tokenizer_revision": model.tokenizer_revision,
        "quantization": model.quantization, "dtype": str(model.dtype),
        "hf_overrides": getattr(model, "hf_overrides", None),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        **{key: getattr(hf_config, key, None)
           for key in ("rope_scaling", "rope_theta", "rope_parameters")},
    }
    text = json.dumps(factors, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
