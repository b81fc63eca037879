"""The compile-cache key without side-channel ports (``_vllm/compile_cache.py``), installed
by the plugin (``plugin.py``).

The private vLLM 0.32 surface checked by name, and the patch or accessor checked on
vLLM's own objects.  With vLLM installed these tests fail, never skip: an ImportError
here is the likeliest sign of a vLLM upgrade.
"""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import compile_cache  # noqa: E402


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("sessionkv") == "vllm_sessionkv.plugin:register"


def test_connector_loads_through_factory_and_plugin():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_sessionkv.connector import SessionKVConnector
    from vllm_sessionkv.plugin import CONNECTOR_NAME, register

    register()
    register()  # idempotent
    assert KVConnectorFactory._registry[CONNECTOR_NAME]() is SessionKVConnector


def _engine_config(connector: str, module_path: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector=connector, kv_connector_module_path=module_path))


def test_an_engine_uses_the_connector_by_name_or_by_module_path():
    assert compile_cache.configures_connector(_engine_config("SessionKVConnector"),
                                              "SessionKVConnector")
    assert compile_cache.configures_connector(
        _engine_config("Other", "vllm_sessionkv.connector"), "SessionKVConnector")
    assert not compile_cache.configures_connector(_engine_config("NixlConnector"),
                                                  "SessionKVConnector")
    assert not compile_cache.configures_connector(None, "SessionKVConnector")


def test_side_channel_ports_do_not_split_the_compile_cache(monkeypatch):
    """Two engines with SessionKVConnector that differ only in their NIXL side-channel
    port share one torch.compile cache key (vLLM 0.32 hashed the port into it); an
    engine without the connector keeps vLLM's own key."""
    import vllm.envs as envs
    from vllm.config.utils import hash_factors

    from vllm_sessionkv.plugin import register

    def env_hash(port: str, vllm_config=None) -> str:
        # vLLM calls compile_factors with the compiling engine's config in a local
        # named vllm_config (VllmBackend.__call__, aot_compile_hash_factors).
        monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", port)
        return hash_factors(envs.compile_factors())

    ours = _engine_config("SessionKVConnector")
    stock = _engine_config("NixlConnector")
    unwrapped = getattr(envs.compile_factors, "__wrapped__", envs.compile_factors)
    monkeypatch.setattr(envs, "compile_factors", unwrapped)  # restored after the test
    assert env_hash("5600", ours) != env_hash("5700", ours)  # the vLLM behaviour
    register()
    register()  # wraps once
    assert envs.compile_factors.__wrapped__ is unwrapped
    assert env_hash("5600", ours) == env_hash("5700", ours)
    by_path = _engine_config("SessionKVConnector", "vllm_sessionkv.connector")
    assert env_hash("5600", by_path) == env_hash("5700", by_path)
    # Not our connector, or no config known: vLLM's own key.
    assert env_hash("5600", stock) != env_hash("5700", stock)
    assert env_hash("5600") != env_hash("5700")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    one_bind = env_hash("5600", ours)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert env_hash("5600", ours) != one_bind  # every other factor still counts


def test_vllm_computes_compile_factors_with_the_engine_config_at_hand():
    """``compile_cache.compile_factors`` reads the caller's ``vllm_config``: both of vLLM
    0.32's callers have one."""
    from vllm.compilation import backends, caching

    call = inspect.getsource(backends.VllmBackend.__call__)
    assert call.index("vllm_config = self.vllm_config") < call.index(
        "envs.compile_factors()")
    hash_factors = inspect.signature(caching.aot_compile_hash_factors)
    assert "vllm_config" in hash_factors.parameters
    assert "envs.compile_factors()" in inspect.getsource(caching.aot_compile_hash_factors)
