"""Token-block hash chains, shared by the connector, the proxy and the tests.

Two families of hash live here and must not be confused:

* **Engine hashes** reproduce vLLM 0.32's prefix-cache block hashes
  (``vllm/v1/core/kv_cache_utils.py::hash_block_tokens``).  The connector never
  recomputes them (it reads ``request.block_hashes``); they exist so that a test can
  pin our understanding against vLLM and so that hash chains can be exchanged in a
  compact form (``encode_chain`` / ``decode_chain``).
* **Request keys** are the router's own hash of token ids (blake2b, 8 bytes, chained).
  They do not depend on the engines' ``--prefix-caching-hash-algo`` or seed, so the
  proxy's index keeps working whatever the engines are configured with.

Only the standard library is used.
"""

from __future__ import annotations

import array
import base64
import hashlib
import pickle
import sys
from collections.abc import Sequence
from typing import NewType

__all__ = [
    "CHAIN_HASH_BYTES",
    "EngineHash",
    "RequestKey",
    "chained_keys",
    "decode_chain",
    "encode_chain",
    "engine_block_hashes",
    "engine_none_hash",
    "full_blocks",
    "request_keys",
    "truncate_hash",
    "verified_prefix_blocks",
]

RequestKey = NewType("RequestKey", int)
EngineHash = NewType("EngineHash", bytes)

# Chained hashes only need enough bits to make a false prefix match improbable: a
# mismatch anywhere changes every later hash, so 8 bytes per block (2^-64 per block)
# is ample and keeps a 128k-token chain at 8 KiB for block size 128.
CHAIN_HASH_BYTES = 8
# request_keys reads the digests as an array of these (a check that ``python -O`` keeps).
if array.array("Q").itemsize != CHAIN_HASH_BYTES:
    raise ImportError(f"array 'Q' items are {array.array('Q').itemsize} bytes on this "
                      f"platform, request_keys needs {CHAIN_HASH_BYTES}")

_NONE_HASH_SEED = "vllm-none-hash"


def full_blocks(num_tokens: int, block_size: int) -> int:
    """Number of complete blocks in ``num_tokens`` tokens."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return max(0, num_tokens) // block_size


def _hash_fn(algo: str):
    if algo == "sha256":
        return lambda obj: hashlib.sha256(
            pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algo == "sha256_cbor":
        import cbor2  # only needed for this algorithm; vLLM depends on it

        return lambda obj: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    raise ValueError(
        f"hash algorithm {algo!r} cannot be reproduced across processes; "
        "use --prefix-caching-hash-algo sha256 or sha256_cbor")


def engine_none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """vLLM's NONE_HASH: the parent of the first block (``init_none_hash``)."""
    return _hash_fn(algo)(seed if seed is not None else _NONE_HASH_SEED)


def engine_block_hashes(token_ids: Sequence[int], block_size: int, algo: str = "sha256",
                        cache_salt: str | None = None, seed: str | None = None) -> list[bytes]:
    """vLLM 0.32's block hashes of ``token_ids`` (full blocks only, no LoRA/mm keys).

    ``cache_salt`` enters the first block's extra keys, as in
    ``generate_block_hash_extra_keys``.
    """
    fn = _hash_fn(algo)
    parent = engine_none_hash(algo, seed)
    hashes: list[bytes] = []
    for block in range(full_blocks(len(token_ids), block_size)):
        tokens = tuple(token_ids[block * block_size:(block + 1) * block_size])
        extra = ("cache_salt", cache_salt) if (block == 0 and cache_salt) else None
        extra_keys = (extra,) if extra else None
        parent = fn((parent, tokens, extra_keys))
        hashes.append(parent)
    return hashes


def truncate_hash(block_hash: bytes) -> bytes:
    """The tail bytes kept in an exchanged chain (vLLM's int events also use the tail)."""
    return bytes(block_hash[-CHAIN_HASH_BYTES:])


def encode_chain(block_hashes: Sequence[bytes]) -> str:
    """Pack a hash chain for JSON transport: base64 of the 8-byte tails, concatenated."""
    return base64.b64encode(b"".join(truncate_hash(h) for h in block_hashes)).decode("ascii")


def decode_chain(encoded: str) -> list[bytes]:
    """Inverse of :func:`encode_chain`.  Raises ``ValueError`` on a malformed chain."""
    try:
        raw = base64.b64decode(encoded.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"hash chain is not valid base64: {exc}") from None
    if len(raw) % CHAIN_HASH_BYTES:
        raise ValueError(
            f"hash chain length {len(raw)} is not a multiple of {CHAIN_HASH_BYTES}")
    return [raw[i:i + CHAIN_HASH_BYTES] for i in range(0, len(raw), CHAIN_HASH_BYTES)]


def verified_prefix_blocks(local_hashes: Sequence[bytes], remote_chain: Sequence[bytes]) -> int:
    """Length of the longest common prefix of two hash chains, in blocks.

    Block hashes are chained (each covers every token before it), so the first
    disagreement ends the usable prefix: nothing after it may be attached, even if a
    later hash happened to match.  Hashes are compared on their truncated tails so a
    full 32-byte local hash matches its 8-byte exported form.
    """
    verified = 0
    for local, remote in zip(local_hashes, remote_chain):
        if truncate_hash(local) != truncate_hash(remote):
            break
        verified += 1
    return verified


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """How many leading items two sequences share (token ids, router keys)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def request_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                 lora_name: str | None = None,
                 parent: RequestKey | None = None) -> list[RequestKey]:
    """The router's content keys: one chained 64-bit key per full block.

    Tenant salt and LoRA name are folded into the first block, as vLLM does with its
    extra keys, so two tenants sharing a prompt never share index entries.  With
    ``parent`` the chain continues after that key (a KV event's run that extends an
    earlier one); salt and LoRA name are then already folded into the parent.
    """
    if parent is not None:
        prev = int(parent).to_bytes(CHAIN_HASH_BYTES, "little")
    elif salt or lora_name:
        prev = hashlib.blake2b(f"{salt or ''}\x00{lora_name or ''}".encode(),
                               digest_size=CHAIN_HASH_BYTES).digest()
    else:
        prev = b""
    n_blocks = full_blocks(len(token_ids), block_size)
    if not n_blocks:
        return []
    # One conversion for the whole prompt, one hash call per block, and the digests
    # read as little-endian 64-bit ints in one go (the hot path hashes every routed
    # prompt).
    data = array.array("I", token_ids[:n_blocks * block_size]).tobytes()
    return chained_keys(prev, data, block_size * 4)


def chained_keys(prev: bytes, data: bytes, step: int) -> list[RequestKey]:
    """One 64-bit key per full ``step``-byte block of ``data``, each hashing the one
    before it (``prev`` seeds the first): the chain under ``request_keys``."""
    blake2b = hashlib.blake2b
    digests: list[bytes] = []
    for offset in range(0, len(data) - step + 1, step):
        prev = blake2b(prev + data[offset:offset + step],
                       digest_size=CHAIN_HASH_BYTES).digest()
        digests.append(prev)
    keys = array.array("Q", b"".join(digests))
    if sys.byteorder != "little":
        keys.byteswap()
    return keys.tolist()
