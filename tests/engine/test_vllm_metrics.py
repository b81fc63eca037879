"""vLLM's connector metric classes (``_vllm/metrics.py``).

The private vLLM 0.32 surface checked by name, and the patch or accessor checked on
vLLM's own objects.  With vLLM installed these tests fail, never skip: an ImportError
here is the likeliest sign of a vLLM upgrade.
"""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import metrics as vllm_metrics  # noqa: E402


def test_the_worker_keeps_its_stats_in_xfer_stats():
    """``worker_set_stats`` replaces the container stock code records into."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    assert "self.xfer_stats" in inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    worker = SimpleNamespace(xfer_stats=None)
    stats = vllm_metrics.NixlKVConnectorStats()
    vllm_metrics.worker_set_stats(worker, stats)
    assert worker.xfer_stats is stats


def test_prom_metric_classes_are_the_ones_vllm_chose():
    from vllm.distributed.kv_transfer.kv_connector.v1 import metrics

    init = inspect.getsource(metrics.KVConnectorPromMetrics.__init__)
    for attr in ("_gauge_cls", "_counter_cls", "_histogram_cls"):
        assert f"self.{attr}" in init, attr
