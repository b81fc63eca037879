"""vLLM's stock ``NixlConnector``, only with the CPU progress-thread fix.

Used for control experiments (the upstream #43094 behaviour) so that a stock pair
does not burn two cores idling next to ours.  Behaviour is otherwise unchanged: no
verification, stock thresholds and TTLs.  Keep the class name: vLLM checks
``has_connector("NixlConnector")`` in its config validation.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from vllm_sessionkv import _vllm

__all__ = ["NixlConnector"]


class NixlConnector(_vllm.NixlPullConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        enabled = not _vllm.is_cpu_platform() or role != KVConnectorRole.WORKER
        with _vllm.nixl_progress_thread(enabled):
            super().__init__(vllm_config, role, kv_cache_config)
