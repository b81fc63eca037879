"""Reads of vLLM's own objects (``_vllm/engine_state.py``): a request's session and
salt, a step's size, the KV cache's shape, and host-tier changes as KV events.

With vLLM installed these tests fail, never skip: an ImportError here is the
likeliest sign of a vLLM upgrade.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import engine_state  # noqa: E402


def test_a_request_carries_its_session_and_cache_salt():
    from vllm.v1.request import Request

    src = inspect.getsource(Request.__init__)
    assert "self.session_id" in src and "self.cache_salt" in src
    request = SimpleNamespace(session_id="", cache_salt="tenant-a")
    assert engine_state.request_session_id(request) is None   # empty: no session
    assert engine_state.request_cache_salt(request) == "tenant-a"


def test_a_step_counts_the_requests_it_scheduled():
    from vllm.v1.core.sched.output import SchedulerOutput

    assert "num_scheduled_tokens" in {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert engine_state.scheduled_requests(SimpleNamespace(num_scheduled_tokens={"a": 3,
                                                                                 "b": 1})) == 2
    assert engine_state.scheduled_requests(SimpleNamespace(num_scheduled_tokens=None)) == 0


def test_a_step_names_each_requests_new_tokens_and_the_tokens_before_them():
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"scheduled_new_reqs", "scheduled_cached_reqs"} <= fields
    assert "num_computed_tokens" in {f.name for f in dataclasses.fields(NewRequestData)}
    assert {"req_ids", "num_computed_tokens"} <= {
        f.name for f in dataclasses.fields(CachedRequestData)}
    step = SimpleNamespace(
        num_scheduled_tokens={"new": 512, "chunk": 256, "decode": 1},
        scheduled_new_reqs=[SimpleNamespace(req_id="new", num_computed_tokens=64)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["chunk", "decode"],
                                              num_computed_tokens=[512, 900]))
    assert sorted(engine_state.scheduled_work(step)) == [(1, 900), (256, 512), (512, 64)]
    assert engine_state.scheduled_work(SimpleNamespace(num_scheduled_tokens=None)) == []


def test_kv_sizes_come_from_the_kv_cache_config():
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    assert {"num_blocks", "kv_cache_tensors"} <= {f.name for f in dataclasses.fields(KVCacheConfig)}
    assert "size" in {f.name for f in dataclasses.fields(KVCacheTensor)}
    config = SimpleNamespace(num_blocks=10, kv_cache_tensors=[SimpleNamespace(size=640),
                                                              SimpleNamespace(size=640)])
    assert engine_state.kv_bytes_per_block(config) == 128
    assert engine_state.kv_bytes_per_token(config, block_size=16) == 8.0
    assert engine_state.kv_num_blocks(config) == 10
    assert engine_state.kv_num_blocks(SimpleNamespace()) == 0


def test_host_and_disk_tier_changes_are_kv_events_of_their_medium():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    events = engine_state.host_tier_events([("CPU", "stored", [b"\x01" * 32]),
                                            ("CPU", "removed", [b"\x02" * 32]),
                                            ("STORAGE", "stored", [b"\x02" * 32])])
    assert isinstance(events[0], BlockStored) and events[0].medium == "CPU"
    assert isinstance(events[1], BlockRemoved) and events[1].medium == "CPU"
    assert isinstance(events[2], BlockStored) and events[2].medium == "STORAGE"
    assert len(events[0].block_hashes) == 1 and events[0].token_ids == []


def test_block_reference_counts_come_from_the_block_pool():
    """``kv_block_ref_counts``: each block's count in vLLM's ``BlockPool`` (one per
    request holding it), 0 for the null block; None without a block pool."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    blocks = pool.get_new_blocks(3)          # one request's: a reference each
    pool.touch(blocks[:2])                   # a second request hits the first two
    ids = [b.block_id for b in blocks]
    null = pool.null_block.block_id
    counts = engine_state.kv_block_ref_counts(SimpleNamespace(block_pool=pool), [null, *ids])
    assert counts == {null: 0, ids[0]: 2, ids[1]: 2, ids[2]: 1}
    assert engine_state.kv_block_ref_counts(SimpleNamespace(), ids) is None
