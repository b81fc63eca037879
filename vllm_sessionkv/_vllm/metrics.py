"""vLLM's connector stats container and the Prometheus metric classes it chose."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = [
    "NixlKVConnectorStats",
    "NixlPromMetrics",
    "create_metric_per_engine",
    "prom_counter",
    "prom_gauge",
    "prom_histogram",
    "worker_set_stats",
]


def worker_set_stats(worker: NixlPullConnectorWorker, stats: NixlKVConnectorStats) -> None:
    """Replace the worker's stats container so worker and scheduler share one key set
    (``NixlKVConnectorStats.aggregate`` extends key by key)."""
    worker.xfer_stats = stats


def prom_counter(metrics: NixlPromMetrics, **kwargs: Any) -> Any:
    """A counter of the class vLLM chose for this process's metrics (multiprocess-safe
    or not), as the stock connector metrics make theirs."""
    return metrics._counter_cls(**kwargs)


def prom_gauge(metrics: NixlPromMetrics, **kwargs: Any) -> Any:
    return metrics._gauge_cls(**kwargs)


def prom_histogram(metrics: NixlPromMetrics, **kwargs: Any) -> Any:
    return metrics._histogram_cls(**kwargs)
