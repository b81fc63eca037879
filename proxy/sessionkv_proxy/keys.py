"""Router request keys chained from a known parent key, and keys over a prompt's text.

``vllm_sessionkv.wire.hashing.request_keys`` hashes a whole prompt from block 0.  KV
events describe runs of blocks that continue an earlier run: ``BlockStored`` gives the
parent's *engine* hash, the index maps it back to the parent's *request* key (llm-d's
dual-key design), and this module continues the chain from there, with the one
implementation in ``hashing.request_keys``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from vllm_sessionkv.wire.hashing import CHAIN_HASH_BYTES, RequestKey, chained_keys, request_keys

__all__ = ["chain_request_keys", "text_keys"]


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


def text_keys(text: bytes, block_bytes: int, salt: str | None = None) -> list[int]:
    """Chained 64-bit keys over the full ``block_bytes``-byte blocks of a prompt's text
    (``tokenizer: text``): two prompts share their first n keys exactly when their
    first n blocks of text are the same, as ``request_keys`` does for token ids.

    The chain is seeded apart from ``request_keys``' (with ``text`` and the tenant's
    ``salt``): a text key and a token key agree only by a 64-bit collision, so the
    engines' KV events, keyed by tokens, do not match text keys.
    """
    prev = hashlib.blake2b(b"text\x00" + (salt or "").encode("utf-8", "surrogatepass"),
                           digest_size=CHAIN_HASH_BYTES).digest()
    return chained_keys(prev, text, block_bytes)
