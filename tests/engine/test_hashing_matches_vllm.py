"""Pin our understanding of vLLM 0.32's block hashes against vLLM itself."""

from __future__ import annotations

import importlib.util

import pytest

from vllm_sessionkv.wire.hashing import (
    decode_chain,
    encode_chain,
    engine_block_hashes,
    engine_none_hash,
    request_keys,
    verified_prefix_blocks,
)

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

# With vLLM installed a moved module fails these tests, never skips them.
from vllm.utils import hashing as vllm_hashing  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_engine_hashes_equal_vllm(algo, salt, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = vllm_hashing.get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    assert kv_cache_utils.NONE_HASH == engine_none_hash(algo)
    tokens = [(i * 13) % 500 + 3 for i in range(32 * 5 + 7)]
    parent = None
    expected = []
    for b in range(5):
        extra = (("cache_salt", salt),) if (salt and b == 0) else None
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[b * 32:(b + 1) * 32],
                                                  extra)
        expected.append(bytes(parent))
    assert engine_block_hashes(tokens, 32, algo, cache_salt=salt) == expected


def test_chain_round_trip_and_prefix():
    hashes = engine_block_hashes(list(range(100, 356)), 32)
    chain = decode_chain(encode_chain(hashes))
    assert verified_prefix_blocks(hashes, chain) == 8
    with pytest.raises(ValueError):
        decode_chain("not base64!")
    with pytest.raises(ValueError):
        decode_chain("AAAA")  # 3 bytes: not a whole number of hashes


def test_request_keys_are_chained_and_salted():
    a = request_keys(list(range(96)), 32)
    b = request_keys(list(range(96)), 32, salt="t")
    c = request_keys([0] + list(range(1, 96)), 32)
    assert len(a) == 3 and a != b and a == c
    d = request_keys([1] + list(range(1, 96)), 32)
    assert all(x != y for x, y in zip(a, d))   # an early change changes every later key
