"""Worker half of the connector: stock NIXL reads, tuned for the platform.

The transfer logic is vLLM's own.  We change how the NIXL agent is built (on CPU: no
spinning progress thread, thread-safe UCX workers, shared-memory transports) and
give the worker the stats container the scheduler uses, so both halves aggregate.
"""

from __future__ import annotations

import time

from vllm_sessionkv import _vllm
from vllm_sessionkv.config import SessionKVConfig
from vllm_sessionkv.host_tier import HostBlockPool
from vllm_sessionkv.stats import SessionKVStats

__all__ = ["SessionKVWorker"]


class SessionKVWorker(_vllm.NixlPullConnectorWorker):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config, config: SessionKVConfig):
        with _vllm.nixl_agent_options(*config.nixl_agent_options(_vllm.is_cpu_platform())):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        _vllm.worker_set_stats(self, SessionKVStats())
        self.sessionkv_config = config
        self._kv_cache_config = kv_cache_config
        self.host_pool: HostBlockPool | None = None

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        if self.sessionkv_config.host_tier_bytes:
            block_bytes = _vllm.kv_bytes_per_block(self._kv_cache_config)
            self.host_pool = HostBlockPool(
                kv_caches, self._kv_cache_config.num_blocks,
                self.sessionkv_config.host_tier_bytes // block_bytes,
                pin_memory=not _vllm.is_cpu_platform())

    def start_load_kv(self, metadata):
        # Host copies first, in the scheduler's order: a restore may read a slot a
        # store in the same step wrote.
        for kind, first, second in getattr(metadata, "sessionkv_host_ops", None) or ():
            if self.host_pool is None:
                continue
            started = time.perf_counter()
            if kind == "store":
                self.host_pool.store(first, second)
                self.xfer_stats.record("host_store_s", time.perf_counter() - started)
            else:
                self.host_pool.load(first, second)
                self.xfer_stats.record("host_restore_s", time.perf_counter() - started)
        super().start_load_kv(metadata)
