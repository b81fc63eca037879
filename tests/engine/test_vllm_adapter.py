"""The private vLLM 0.32 surface the connector relies on, checked by name.

``_vllm.py`` is the only module that touches these; if vLLM moves one, this test names
it, instead of a server failing at run time.
"""

from __future__ import annotations

import inspect

import pytest

_vllm = pytest.importorskip("vllm_sessionkv._vllm")


def test_pinned_version_is_installed():
    import vllm

    assert vllm.__version__.startswith(_vllm.VLLM_VERSION_TESTED)


def test_scheduler_private_state_exists():
    src = inspect.getsource(_vllm.NixlPullConnectorScheduler.__mro__[1].__init__)
    for attr in ("_reqs_need_send", "_reqs_not_processed", "_reqs_in_batch",
                 "kv_recompute_threshold", "is_bidirectional_kv_xfer_enabled", "block_size"):
        assert f"self.{attr}" in src, attr
    assert hasattr(_vllm.NixlPullConnectorScheduler, "_get_remote_prefill_token_count")


def test_worker_agent_config_hook_exists():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    assert hasattr(base_worker, "nixl_agent_config")
    assert "self.xfer_stats" in inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)


def test_progress_thread_patch_is_scoped():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    original = base_worker.nixl_agent_config
    with _vllm.nixl_progress_thread(False):
        if original is not None:
            assert base_worker.nixl_agent_config is not original
            assert base_worker.nixl_agent_config.keywords == {"enable_prog_thread": False}
    assert base_worker.nixl_agent_config is original


def test_connector_loads_through_factory_and_plugin():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_sessionkv.connector import SessionKVConnector
    from vllm_sessionkv.plugin import CONNECTOR_NAME, register

    register()
    register()  # idempotent
    assert KVConnectorFactory._registry[CONNECTOR_NAME]() is SessionKVConnector


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("sessionkv") == "vllm_sessionkv.plugin:register"
