"""Keeping a synchronous read's blocks out of vLLM's prefix cache
(``_vllm/prefix_cache.py``), on vLLM's own ``KVCacheManager``: a request allocated
with externally computed tokens is hashed at once (what a synchronous load gets);
``hide`` makes those blocks unfindable to a second request with the same prompt,
emitting ``BlockRemoved``; ``restore`` caches them again, emitting ``BlockStored``;
a request freed meanwhile is not restored.

With vLLM installed these tests fail, never skip: an ImportError or AttributeError
here is the likeliest sign of a vLLM upgrade."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import prefix_cache  # noqa: E402

BLOCK = 16
PROMPT = list(range(100, 100 + 5 * BLOCK + 3))   # 5 full blocks and 3 tokens


@pytest.fixture
def manager():
    import torch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    init_none_hash(get_hash_fn_by_name("sha256"))
    layer = "model.layers.0.self_attn.attn"
    config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[KVCacheTensor(size=32 * 4096, layers=[layer],
                                        layer_stride=32 * 4096, block_stride=4096)],
        kv_cache_groups=[KVCacheGroupSpec([layer], FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32))])
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK,
                          hash_block_size=BLOCK, enable_kv_cache_events=True)


def _request(request_id: str):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(request_id, list(PROMPT), SamplingParams(max_tokens=4), None,
                   block_hasher=get_request_block_hasher(BLOCK,
                                                         get_hash_fn_by_name("sha256")))


def _hit_tokens(manager, request_id: str) -> int:
    return manager.get_computed_blocks(_request(request_id))[1]


def _loaded(manager, external_tokens: int):
    """A request whose first ``external_tokens`` come from a synchronous load, as
    vLLM's scheduler allocates it (hashed at allocation), plus one new token."""
    request = _request("reader")
    new_tokens = len(PROMPT) - external_tokens
    blocks = manager.allocate_slots(request, new_tokens,
                                    num_external_computed_tokens=external_tokens)
    assert blocks is not None
    request.num_computed_tokens = len(PROMPT)
    return request


def _events(manager) -> list[str]:
    return [type(e).__name__ for e in manager.block_pool.take_events()]


def test_hidden_blocks_are_not_found_until_restored(manager):
    request = _loaded(manager, external_tokens=4 * BLOCK)
    assert _hit_tokens(manager, "other") == 5 * BLOCK        # vLLM hashes them at once
    _events(manager)
    block_ids = list(manager.get_block_ids("reader")[0])
    prefix_cache.hide(manager, "reader", block_ids[1:], 1)   # one block was a local hit
    assert _hit_tokens(manager, "other") == BLOCK
    assert "BlockRemoved" in _events(manager)
    assert prefix_cache.restore(manager, request)
    assert _hit_tokens(manager, "other") == 5 * BLOCK        # the step's computed block too
    assert "BlockStored" in _events(manager)


def test_a_freed_request_is_not_restored(manager):
    request = _loaded(manager, external_tokens=4 * BLOCK)
    prefix_cache.hide(manager, "reader", list(manager.get_block_ids("reader")[0]), 0)
    manager.free(request)
    assert not prefix_cache.restore(manager, request)
    assert _hit_tokens(manager, "other") == 0
