"""vLLM's torch.compile cache key without KV-transfer side-channel ports.

``route_compile_factors`` is installed by the plugin in every vLLM process, because a
worker compiles its model before it builds its connector.  Importing this module
costs only ``vllm.envs``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PORT_ENV_VARS", "compile_factors", "configures_connector", "route_compile_factors"]

# Listening ports of KV-transfer side channels, which must not split vLLM's
# torch.compile cache (see ``compile_factors``).
PORT_ENV_VARS = ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_P2P_SIDE_CHANNEL_PORT",
                 "VLLM_EC_SIDE_CHANNEL_PORT", "VLLM_MOONCAKE_BOOTSTRAP_PORT")


def route_compile_factors(connector_name: str) -> None:
    """Have vLLM's compile-cache factors computed by ``compile_factors``.

    Patches ``vllm.envs.compile_factors`` (idempotent); the wrapper leaves the factors
    unchanged unless the compiling engine is configured with ``connector_name``."""
    import vllm.envs as envs

    original = getattr(envs, "compile_factors", None)
    if original is None or hasattr(original, "__wrapped__"):
        return  # not this vLLM's hashing, or routed already

    @functools.wraps(original)
    def routed() -> dict[str, object]:
        return compile_factors(original, sys._getframe(1), connector_name)

    envs.compile_factors = routed


def configures_connector(vllm_config: Any, connector_name: str) -> bool:
    """Whether an engine's config uses our connector (registered as ``connector_name``,
    or loaded from this package by module path)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None:
        return False
    module_path = getattr(transfer, "kv_connector_module_path", None) or ""
    return (getattr(transfer, "kv_connector", None) == connector_name
            or module_path.startswith("vllm_sessionkv"))


def compile_factors(original: Callable[[], dict[str, object]], caller: Any,
                    connector_name: str) -> dict[str, object]:
    """vLLM's compile-cache factors (``envs.compile_factors``), without the KV-transfer
    side-channel ports in engines configured with SessionKVConnector.

    vLLM 0.32 hashes every VLLM_* env var not on its ignore list into the
    torch.compile cache key; it ignores VLLM_PORT and VLLM_DP_MASTER_PORT but not the
    side-channel ports (``PORT_ENV_VARS``).  Each P/D engine needs its own
    side-channel port, so each got its own cache entry and every engine start
    recompiled the model (45 s of a tiny model's 96 s start on 2 cores).  A port
    cannot change a compiled graph.

    Workers compile before they build their connector, so the engine's config is read
    from the caller: vLLM 0.32 calls this from ``VllmBackend.__call__`` and
    ``caching.aot_compile_hash_factors``, both with a local ``vllm_config``
    (``caller`` is that frame); otherwise from ``get_current_vllm_config_or_none``.
    Without a config naming our connector the factors are vLLM's own."""
    from vllm.config import get_current_vllm_config_or_none

    factors = original()
    config = caller.f_locals.get("vllm_config") if caller is not None else None
    if config is None:
        config = get_current_vllm_config_or_none()
    if configures_connector(config, connector_name):
        for name in PORT_ENV_VARS:
            factors.pop(name, None)
    return factors
