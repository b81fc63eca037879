"""Router request keys chained from a known parent key.

``vllm_sessionkv.hashing.request_keys`` hashes a whole prompt from block 0.  KV
events describe runs of blocks that continue an earlier run: ``BlockStored`` gives the
parent's *engine* hash, the index maps it back to the parent's *request* key (llm-d's
dual-key design), and this module continues the chain from there, with the one
implementation in ``hashing.request_keys``.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_sessionkv.hashing import RequestKey, request_keys

__all__ = ["chain_request_keys"]


def chain_request_keys(token_ids: Sequence[int], block_size: int,
                       parent: RequestKey | None = None, salt: str | None = None,
                       lora_name: str | None = None) -> list[RequestKey]:
    """Request keys of the full blocks of ``token_ids``, continuing after ``parent``.

    With ``parent=None`` the tokens start at block 0 and this equals
    ``hashing.request_keys(token_ids, block_size, salt, lora_name)``.  With a parent,
    ``salt`` and ``lora_name`` are ignored: they are already folded into the parent.
    """
    return request_keys(token_ids, block_size, salt=salt, lora_name=lora_name,
                        parent=parent)
