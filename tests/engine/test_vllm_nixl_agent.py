"""How NIXL's worker builds its agent, and the thread affinity it changes
(``_vllm/nixl_agent.py``).

The private vLLM 0.32 surface checked by name, and the patch or accessor checked on
vLLM's own objects.  With vLLM installed these tests fail, never skip: an ImportError
here is the likeliest sign of a vLLM upgrade.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import nixl_agent  # noqa: E402


def test_worker_agent_config_hook_exists():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    assert hasattr(base_worker, "nixl_agent_config")


def test_nixl_agent_options_are_applied_and_scoped():
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    original = base_worker.nixl_agent_config
    if original is None:
        pytest.skip("nixl not installed")
    api = importlib.import_module(original.__module__)
    create_backend = api.nixl_agent.create_backend
    seen = []

    def recording_create_backend(agent, backend, initParams=None):  # noqa: N803
        seen.append((backend, dict(initParams or {})))
        return create_backend(agent, backend, initParams)

    api.nixl_agent.create_backend = recording_create_backend
    try:
        with nixl_agent.nixl_agent_options(False, "none"):
            # What vLLM 0.32's worker passes (base_worker.py l.641).
            config = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
            # Thread off: the agent must ask for RW sync, or NIXL builds
            # single-threaded UCX workers that vLLM's handshake thread and engine
            # step would use at once.
            assert config.enable_pthread is False
            assert config.sync_mode.name == "NIXL_THREAD_SYNC_RW"
            agent = api.nixl_agent("sessionkv-adapter-test", config)
        assert "UCX" in agent.backends
        assert seen == [("UCX", {"num_threads": "4", "ucx_error_handling_mode": "none"})]
        assert base_worker.nixl_agent_config is original
        assert api.nixl_agent.create_backend is recording_create_backend
        with nixl_agent.nixl_agent_options(True, None):  # stock: nothing patched
            assert base_worker.nixl_agent_config is original
            assert api.nixl_agent.create_backend is recording_create_backend
    finally:
        api.nixl_agent.create_backend = create_backend


def test_nixl_worker_pins_its_thread_and_keep_thread_affinity_undoes_it():
    """0.32's NIXL worker moves the thread that builds it (the one that runs the
    model) onto the last core of each NUMA node on CPU; ours puts it back."""
    import os
    import threading

    source = inspect.getsource(nixl_agent._nixl_base_worker.NixlBaseConnectorWorker.__init__)
    assert "os.sched_setaffinity(0, rsv_cores_for_kv)" in source

    seen = {}

    def in_thread():   # a thread of its own: affinity is per thread
        before = os.sched_getaffinity(0)
        with nixl_agent.keep_thread_affinity():
            os.sched_setaffinity(0, {max(before)})
            seen["inside"] = os.sched_getaffinity(0)
        seen["before"], seen["after"] = before, os.sched_getaffinity(0)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen["inside"] == {max(seen["before"])}
    assert seen["after"] == seen["before"]


def test_cpu_defaults_for_nixl_agent():
    from vllm_sessionkv.config import ConfigError, SessionKVConfig, parse_config

    assert SessionKVConfig().nixl_agent_options(cpu_platform=True) == (False, "none")
    assert SessionKVConfig().nixl_agent_options(cpu_platform=False) == (True, None)
    explicit = SessionKVConfig(nixl_progress_thread=True, nixl_ucx_error_handling="peer")
    assert explicit.nixl_agent_options(cpu_platform=True) == (True, "peer")
    with pytest.raises(ConfigError, match="nixl_ucx_error_handling"):
        parse_config({"sessionkv": {"nixl_ucx_error_handling": "sometimes"}})
