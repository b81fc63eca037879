"""vLLM general plugin: registers ``SessionKVConnector`` with the connector factory.

vLLM calls ``register`` in every process it starts (entry point group
``vllm.general_plugins``), possibly more than once, so it must be idempotent and
cheap: the connector module is only imported when a connector is created.  It also
has vLLM's compile-cache key computed without side-channel ports
(``_vllm.compile_cache``, which imports only ``vllm.envs``), here because a worker
compiles its model before it builds its connector.  This module touches no vLLM
internals: the factory's ``register_connector`` is its public registration call.
"""

from __future__ import annotations

__all__ = ["CONNECTOR_NAME", "register"]

CONNECTOR_NAME = "SessionKVConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_sessionkv._vllm.compile_cache import route_compile_factors

    try:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "vllm_sessionkv.connector", "SessionKVConnector")
    except ValueError:
        pass  # already registered in this process
    route_compile_factors(CONNECTOR_NAME)
