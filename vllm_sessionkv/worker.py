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

# Poll interval of an idle step's wait for its reads: short against a read (~1 ms),
# long enough to leave the core to the peer engine.
_IDLE_POLL_S = 100e-6


class SessionKVWorker(_vllm.NixlPullConnectorWorker):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config, config: SessionKVConfig):
        with _vllm.nixl_agent_options(*config.nixl_agent_options(_vllm.is_cpu_platform())):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        _vllm.worker_set_stats(self, SessionKVStats())
        self.sessionkv_config = config
        self._kv_cache_config = kv_cache_config
        self.host_pool: HostBlockPool | None = None
        self._idle_step = False

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
        self._idle_step = bool(getattr(metadata, "sessionkv_idle_step", False))
        super().start_load_kv(metadata)

    def get_transfer_results(self):
        wait_s = self.sessionkv_config.idle_step_recv_wait_s
        waits = bool(self._idle_step and wait_s and _vllm.reads_in_flight(self))
        started = time.perf_counter()
        results = super().get_transfer_results()
        if not waits:
            return results
        # No model to run this step, so waiting here costs nothing but lets the
        # scheduler see a read that lands now in this step's output, not a later one.
        deadline = started + wait_s
        while _vllm.reads_in_flight(self) and time.perf_counter() < deadline:
            time.sleep(_IDLE_POLL_S)
            more = super().get_transfer_results()
            results.finished_sending |= more.finished_sending
            results.finished_recving |= more.finished_recving
            results.failed_recving |= more.failed_recving
        self.xfer_stats.record("idle_step_recv_wait_s", time.perf_counter() - started)
        return results
