"""Engine shapes the connector refuses at start-up, through the real connector
constructor on a real vLLM config: a hybrid model's two KV cache groups (a refuted
confirm would make vLLM raise in ``_handle_invalid_blocks`` and kill the engine), a
hash unit other than the block size, and vLLM's default ``fail`` load-failure policy.
The control: the same constructor on one full-attention group with ``recompute``
builds."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv.engine_shape import refusal  # noqa: E402

BLOCK = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from vllm_sessionkv.dev.tiny_model import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("shape") / "model")


@pytest.fixture(autouse=True)
def _restored(connector_process_state_restored):
    """The constructor patches vLLM for its process; put back after each test."""


def _kv_cache_config(groups: int, hash_block_size: int | None = None):
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                               dtype=torch.float32, sliding_window=64)
    specs = [KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], window)]
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[KVCacheTensor(size=64 * 8192, layers=list(LAYERS),
                                        layer_stride=64 * 4096, block_stride=4096)],
        kv_cache_groups=specs[:groups])
    config.hash_block_size = hash_block_size or BLOCK
    return config


def _connector(model_dir, kv_cache_config, policy="recompute"):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from vllm_sessionkv.connector import SessionKVConnector

    vllm_config = EngineArgs(
        model=str(model_dir), enable_prefix_caching=True, prefix_caching_hash_algo="sha256",
        block_size=BLOCK, max_model_len=1024,
        kv_transfer_config={"kv_connector": "SessionKVConnector", "kv_role": "kv_both",
                            "kv_load_failure_policy": policy},
    ).create_engine_config()
    return SessionKVConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def test_one_full_attention_group_with_recompute_builds(tiny_model_dir):
    connector = _connector(tiny_model_dir, _kv_cache_config(groups=1))
    try:
        assert connector.connector_scheduler is not None
    finally:
        connector.connector_scheduler.shutdown()


@pytest.mark.parametrize("groups, hash_block_size, policy, named", [
    (2, None, "recompute", "2 KV cache groups"),
    (1, 16, "recompute", "hash_block_size (16 tokens"),
    (1, None, "fail", "kv_load_failure_policy is 'fail'"),
])
def test_an_unsupported_shape_is_refused_naming_why(tiny_model_dir, groups,
                                                    hash_block_size, policy, named):
    with pytest.raises(ValueError, match="SessionKVConnector cannot serve") as refused:
        _connector(tiny_model_dir, _kv_cache_config(groups, hash_block_size), policy)
    assert named in str(refused.value)


def test_the_rule_is_pure_and_orders_its_reasons():
    assert refusal(num_kv_cache_groups=1, block_size=16, hash_tokens=16,
                   kv_load_failure_policy="recompute") is None
    assert "groups" in refusal(num_kv_cache_groups=3, block_size=16, hash_tokens=8,
                               kv_load_failure_policy="fail")
    assert "0 KV cache groups" not in (refusal(
        num_kv_cache_groups=0, block_size=16, hash_tokens=16,
        kv_load_failure_policy="recompute") or "")
