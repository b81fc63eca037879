"""vLLM's stock ``NixlConnector``, only without the spinning
progress thread on CPU (``nixl_agent.nixl_agent_options``).

Used for control experiments (the upstream #43094 behaviour) so that a stock pair
does not burn two cores idling next to ours.  Behaviour is otherwise unchanged: no
verification, stock thresholds and TTLs.  Keep the class name: vLLM checks
``has_connector("NixlConnector")`` in its config validation.
"""

from __future__ import annotations

from vllm_sessionkv._vllm import nixl_agent, nixl_state, version

__all__ = ["NixlConnector"]


class NixlConnector(nixl_state.NixlPullConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        # NIXL's own UCX error handling (peer): the control stays as stock as it can.
        with nixl_agent.nixl_agent_options(not version.is_cpu_platform(), None):
            super().__init__(vllm_config, role, kv_cache_config)
