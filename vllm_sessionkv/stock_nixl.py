"""vLLM's stock ``NixlConnector``, only with our CPU NIXL agent options
(``_vllm.nixl_agent_options``: no spinning progress thread, shared-memory transports).

Used for control experiments (the upstream #43094 behaviour) so that a stock pair
does not burn two cores idling next to ours.  Behaviour is otherwise unchanged: no
verification, stock thresholds and TTLs.  Keep the class name: vLLM checks
``has_connector("NixlConnector")`` in its config validation.
"""

from __future__ import annotations

from vllm_sessionkv import _vllm

__all__ = ["NixlConnector"]


class NixlConnector(_vllm.NixlPullConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        cpu = _vllm.is_cpu_platform()
        with _vllm.nixl_agent_options(not cpu, "none" if cpu else None):
            super().__init__(vllm_config, role, kv_cache_config)
