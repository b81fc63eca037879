"""Router request keys chained from a known parent key.

``vllm_sessionkv.hashing.request_keys`` hashes a whole prompt from block 0.  KV
events describe runs of blocks that continue an earlier run: ``BlockStored`` gives the
parent's *engine* hash, the index maps it back to the parent's *request* key (llm-d's
dual-key design), and this module continues the chain from there.  The arithmetic
must stay identical to ``hashing.request_keys``; ``tests/proxy/test_keys.py`` checks
that they agree.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

from vllm_sessionkv.hashing import CHAIN_HASH_BYTES, RequestKey, full_blocks

__all__ = ["chain_request_keys"]


def _root_seed(salt: str | None, lora_name: str | None) -> bytes:
    # Same seed as hashing.request_keys: tenant salt and LoRA name fold into block 0.
    if salt or lora_name:
        return hashlib.blake2b(f"{salt or ''}\x00{lora_name or ''}".encode(),
                               digest_size=CHAIN_HASH_BYTES).digest()
    return b""


def chain_request_keys(token_ids: Sequence[int], block_size: int,
                       parent: RequestKey | None = None, salt: str | None = None,
                       lora_name: str | None = None) -> list[RequestKey]:
    """Request keys of the full blocks of ``token_ids``, continuing after ``parent``.

    With ``parent=None`` the tokens start at block 0 and this equals
    ``hashing.request_keys(token_ids, block_size, salt, lora_name)``.  With a parent,
    ``salt`` and ``lora_name`` are ignored: they are already folded into the parent.
    """
    if parent is None:
        prev = _root_seed(salt, lora_name)
    else:
        prev = int(parent).to_bytes(CHAIN_HASH_BYTES, "little")
    keys: list[RequestKey] = []
    for block in range(full_blocks(len(token_ids), block_size)):
        chunk = token_ids[block * block_size:(block + 1) * block_size]
        h = hashlib.blake2b(prev, digest_size=CHAIN_HASH_BYTES)
        h.update(array.array("I", chunk).tobytes())
        prev = h.digest()
        keys.append(RequestKey(int.from_bytes(prev, "little")))
    return keys
