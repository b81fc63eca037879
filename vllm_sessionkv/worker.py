"""Worker half of the connector: stock NIXL reads, tuned for the platform.

The transfer logic is vLLM's own.  We change how the NIXL agent is built (no
busy-polling progress thread on CPU, where it burns about a core per engine) and
give the worker the stats container the scheduler uses, so both halves aggregate.
"""

from __future__ import annotations

from vllm_sessionkv import _vllm
from vllm_sessionkv.config import SessionKVConfig
from vllm_sessionkv.stats import SessionKVStats

__all__ = ["SessionKVWorker"]


class SessionKVWorker(_vllm.NixlPullConnectorWorker):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config, config: SessionKVConfig):
        progress_thread = config.nixl_progress_thread
        if progress_thread is None:
            progress_thread = not _vllm.is_cpu_platform()
        with _vllm.nixl_progress_thread(progress_thread):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        _vllm.worker_set_stats(self, SessionKVStats())
