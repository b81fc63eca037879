"""Reads of vLLM's own objects: a request's session and salt, a step's size, the KV
cache's shape; and host-tier changes as vLLM KV events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = [
    "host_tier_events",
    "kv_bytes_per_block",
    "kv_bytes_per_token",
    "kv_num_blocks",
    "request_cache_salt",
    "request_session_id",
    "scheduled_requests",
]


def request_session_id(request: Request) -> str | None:
    return getattr(request, "session_id", None) or None


def request_cache_salt(request: Request) -> str | None:
    return getattr(request, "cache_salt", None) or None


def scheduled_requests(scheduler_output: Any) -> int:
    """Number of requests that ran in a scheduler step: our engine-load signal."""
    return len(getattr(scheduler_output, "num_scheduled_tokens", None) or {})


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


def kv_bytes_per_block(kv_cache_config: Any) -> int:
    """Bytes one block occupies across all layers (host-tier slot size)."""
    if not kv_cache_config.num_blocks:
        return 0
    return sum(t.size for t in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks


def host_tier_events(events: list[tuple[str, list[bytes]]]) -> list[Any]:
    """Host-tier changes as vLLM KV events (``medium="CPU"``), published by the
    scheduler in the same batch as the engine's own events.  Placeholders (no token
    ids), as vLLM's OffloadingConnector emits by default: the router places them by
    the engine hash it already knows from the device-tier event."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: list[Any] = []
    for kind, hashes in events:
        converted = [maybe_convert_block_hash(h) for h in hashes]
        if kind == "stored":
            out.append(BlockStored(block_hashes=converted, parent_block_hash=None,
                                   token_ids=[], block_size=0, lora_id=None, medium="CPU",
                                   lora_name=None))
        else:
            out.append(BlockRemoved(block_hashes=converted, medium="CPU"))
    return out
