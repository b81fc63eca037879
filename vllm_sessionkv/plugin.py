"""vLLM general plugin: registers ``SessionKVConnector`` with the connector factory.

vLLM calls ``register`` in every process it starts (entry point group
``vllm.general_plugins``), possibly more than once, so it must be idempotent and
cheap: the connector module is only imported when a connector is created.  That is
also why the one vLLM internal touched here lives here and not in ``_vllm`` (whose
imports would cost the API server seconds at start-up).
"""

from __future__ import annotations

import functools

__all__ = ["CONNECTOR_NAME", "PORT_ENV_VARS", "register"]

CONNECTOR_NAME = "SessionKVConnector"

# Listening ports of KV-transfer side channels.  vLLM 0.32 hashes every VLLM_* env
# var not on its ignore list into the torch.compile cache key (envs.compile_factors);
# it ignores VLLM_PORT and VLLM_DP_MASTER_PORT but not these.  Each P/D engine needs
# its own side-channel port, so each got its own cache entry and every engine start
# recompiled the model (45 s of a tiny model's 96 s start on 2 cores).  A port
# cannot change a compiled graph.
PORT_ENV_VARS = ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_P2P_SIDE_CHANNEL_PORT",
                 "VLLM_EC_SIDE_CHANNEL_PORT", "VLLM_MOONCAKE_BOOTSTRAP_PORT")


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "vllm_sessionkv.connector", "SessionKVConnector")
    except ValueError:
        pass  # already registered in this process
    _share_compile_cache_across_ports()


def _share_compile_cache_across_ports() -> None:
    """Drop side-channel ports from the compile-cache key (written against vLLM 0.32.0)."""
    import vllm.envs as envs

    compile_factors = getattr(envs, "compile_factors", None)
    if compile_factors is None or hasattr(compile_factors, "__wrapped__"):
        return  # not this vLLM's hashing, or wrapped already

    @functools.wraps(compile_factors)
    def compile_factors_without_ports() -> dict[str, object]:
        factors = compile_factors()
        for name in PORT_ENV_VARS:
            factors.pop(name, None)
        return factors

    envs.compile_factors = compile_factors_without_ports
