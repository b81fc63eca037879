"""vLLM general plugin: registers ``SessionKVConnector`` with the connector factory.

vLLM calls ``register`` in every process it starts (entry point group
``vllm.general_plugins``), possibly more than once, so it must be idempotent and
cheap: the connector module is only imported when a connector is created.
"""

from __future__ import annotations

__all__ = ["CONNECTOR_NAME", "register"]

CONNECTOR_NAME = "SessionKVConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "vllm_sessionkv.connector", "SessionKVConnector")
    except ValueError:
        pass  # already registered in this process
