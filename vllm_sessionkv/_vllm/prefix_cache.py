"""Keep a synchronous read's blocks out of vLLM's prefix cache until the read is good.

vLLM caches (hashes) a request's blocks when it allocates them, before the forward:
right for tokens the forward computes, which any later reader of those blocks finds
written.  A synchronous load's blocks are allocated and hashed the same way
(``allocate_slots`` with ``delay_cache_blocks=False``), but written by a NIXL read
that can fail.  Under ``kv_load_failure_policy: recompute`` vLLM keeps a failed
read's blocks in the prefix cache under the prompt's hashes and counts on the request
recomputing them (``Scheduler._handle_invalid_blocks``); if the request is aborted or
preempted first, or its recompute is chunked, another request with that prefix reads
KV nothing wrote.  So the blocks a synchronous read writes are taken out of the
prefix cache at allocation (``hide``) and put back only once the read is known good
(``restore``).  A failed read leaves them out; the request's recompute caches them
the usual way, as it schedules the tokens that rewrite them.

Private state used (vLLM 0.32): ``KVCacheManager.block_pool`` and ``.coordinator``,
``BlockPool.evict_blocks`` (drops a block's hash from the cache, emitting
``BlockRemoved``), and each single-type manager's ``num_cached_block`` (how many of a
request's blocks vLLM has cached, so it caches the rest again later).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["hide", "restore"]


def hide(kv_cache_manager: Any, request_id: str, block_ids: list[int],
         first_block: int) -> None:
    """Take ``block_ids`` (a request's blocks from its ``first_block``-th on, first KV
    cache group) out of the prefix cache, and have vLLM cache that request's blocks
    from ``first_block`` on again when it next caches them."""
    if kv_cache_manager is None or not block_ids:
        return
    kv_cache_manager.block_pool.evict_blocks(set(block_ids))
    for manager in kv_cache_manager.coordinator.single_type_managers:
        cached = manager.num_cached_block.get(request_id)
        if cached is not None and cached > first_block:
            manager.num_cached_block[request_id] = first_block


def restore(kv_cache_manager: Any, request: Request) -> bool:
    """Cache a request's computed blocks again (after ``hide``), as vLLM would have at
    allocation.  Only while vLLM still tracks the request's blocks (not freed,
    preempted or finished); returns whether it did."""
    if kv_cache_manager is None:
        return False
    managers = kv_cache_manager.coordinator.single_type_managers
    if not all(request.request_id in m.num_cached_block for m in managers):
        return False
    kv_cache_manager.cache_blocks(request, min(request.num_computed_tokens,
                                               request.num_tokens))
    return True
