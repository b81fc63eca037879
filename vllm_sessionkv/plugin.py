"""vLLM general plugin: registers ``SessionKVConnector`` with the connector factory.

vLLM calls ``register`` in every process it starts (entry point group
``vllm.general_plugins``), possibly more than once, so it must be idempotent and
cheap: the connector module is only imported when a connector is created, and
``_vllm`` (whose imports cost a process about a second) only when vLLM computes a
compile-cache key, and then only to decide whether this engine uses the connector.
"""

from __future__ import annotations

import functools
import sys

__all__ = ["CONNECTOR_NAME", "PORT_ENV_VARS", "register"]

CONNECTOR_NAME = "SessionKVConnector"

# Listening ports of KV-transfer side channels, which must not split vLLM's
# torch.compile cache (see ``_vllm.compile_factors``).
PORT_ENV_VARS = ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_P2P_SIDE_CHANNEL_PORT",
                 "VLLM_EC_SIDE_CHANNEL_PORT", "VLLM_MOONCAKE_BOOTSTRAP_PORT")


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "vllm_sessionkv.connector", "SessionKVConnector")
    except ValueError:
        pass  # already registered in this process
    _route_compile_factors_through_adapter()


def _route_compile_factors_through_adapter() -> None:
    """Have vLLM's compile-cache factors computed by ``_vllm.compile_factors``.

    Installed here, in every vLLM process, because a worker compiles its model before
    it builds its connector; the call goes to ``_vllm`` (imported then), which leaves
    the factors unchanged unless the compiling engine is configured with
    SessionKVConnector."""
    import vllm.envs as envs

    original = getattr(envs, "compile_factors", None)
    if original is None or hasattr(original, "__wrapped__"):
        return  # not this vLLM's hashing, or routed already

    @functools.wraps(original)
    def compile_factors() -> dict[str, object]:
        from vllm_sessionkv import _vllm

        return _vllm.compile_factors(original, sys._getframe(1))

    envs.compile_factors = compile_factors
