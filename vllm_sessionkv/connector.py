"""``SessionKVConnector``: vLLM 0.32's NIXL pull connector with session-aware reuse.

A thin facade, like vLLM's own: it builds the scheduler half or the worker half for
its role and delegates.  Load it with either form::

    --kv-transfer-config '{"kv_connector":"SessionKVConnector","kv_role":"kv_producer",
                           "kv_load_failure_policy":"recompute"}'
    --kv-transfer-config '{"kv_connector":"SessionKVConnector",
                           "kv_connector_module_path":"vllm_sessionkv.connector",
                           "kv_load_failure_policy":"recompute", ...}'

The engine's shape is checked first (``engine_shape.py``): hybrid models, a hash unit
other than the block size and a load-failure policy other than ``recompute`` are
refused at start-up, naming the setting.

Our options go under ``kv_connector_extra_config.sessionkv`` (see ``config.py``).
"""

from __future__ import annotations

import logging

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from vllm_sessionkv import engine_shape
from vllm_sessionkv._vllm import engine_state, nixl_state, pacing, version
from vllm_sessionkv.config import parse_config
from vllm_sessionkv.scheduler import SessionKVScheduler
from vllm_sessionkv.stats import SessionKVPromMetrics, SessionKVStats
from vllm_sessionkv.worker import SessionKVWorker

__all__ = ["SessionKVConnector"]

logger = logging.getLogger("vllm.sessionkv.connector")


class SessionKVConnector(nixl_state.NixlPullConnector):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        transfer_config = vllm_config.kv_transfer_config
        config = parse_config(transfer_config.kv_connector_extra_config)
        version.check_vllm_version(config.allow_untested_vllm)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("SessionKVConnector does not support "
                             "decode_context_parallel_size > 1 yet")
        if config.session_pulls:
            # Both pools must agree, or P parks turn k+1 waiting for a read it never
            # starts; setting it here keeps the two sides consistent by construction.
            transfer_config.kv_connector_extra_config["bidirectional_kv_xfer"] = True
        block_size = vllm_config.cache_config.block_size
        refused = engine_shape.refusal(
            num_kv_cache_groups=engine_state.kv_cache_group_count(kv_cache_config),
            block_size=block_size,
            hash_tokens=engine_state.kv_hash_tokens(kv_cache_config, block_size),
            kv_load_failure_policy=transfer_config.kv_load_failure_policy)
        if refused is not None:
            raise ValueError(f"SessionKVConnector cannot serve this engine: {refused}")
        self.sessionkv_config = config
        busy_poll_cap_s = config.busy_poll_cap_s(version.is_cpu_platform())
        if busy_poll_cap_s is not None:
            # Both roles: the scheduler half lives in the engine core, the worker half
            # in each worker process, and each process spins on its own queue.
            pacing.limit_engine_busy_poll(busy_poll_cap_s, config.engine_spin_while_busy)
        nixl_state.NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = SessionKVScheduler(
                vllm_config, self.engine_id, kv_cache_config, config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = SessionKVWorker(
                vllm_config, self.engine_id, kv_cache_config, config)
        else:
            raise ValueError(f"unsupported KVConnectorRole: {role}")

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            self.connector_scheduler.bind_kv_cache_manager(kv_cache_manager)

    def build_connector_worker_meta(self):
        if self.connector_worker is not None:
            return self.connector_worker.build_connector_worker_meta()
        return None

    def take_events(self):
        if self.connector_scheduler is not None:
            return self.connector_scheduler.take_events()
        return ()

    def reset_cache(self) -> bool | None:
        if self.connector_scheduler is not None:
            return self.connector_scheduler.reset_cache()
        return None

    def get_kv_connector_stats(self):
        if self.connector_scheduler is not None:
            return self.connector_scheduler.take_stats()
        return super().get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return SessionKVStats(data=data) if data is not None else SessionKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return SessionKVPromMetrics(vllm_config, metric_types, labelnames,
                                    per_engine_labelvalues)
