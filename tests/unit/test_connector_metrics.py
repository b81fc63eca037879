"""Each stats key the connector records lands in its Prometheus series."""

from __future__ import annotations

import pytest
from helpers import connector_prom_metrics

prometheus_client = pytest.importorskip("prometheus_client")
stats_mod = pytest.importorskip("vllm_sessionkv.stats")


def _registry_metrics():
    return connector_prom_metrics()


def test_recorded_keys_reach_their_series():
    registry, metrics = _registry_metrics()
    stats = stats_mod.SessionKVStats()
    stats.record("load_sync")
    stats.record("load_sync")
    stats.record("load_async")
    stats.record("sync_load_wait_s", 0.0012)
    stats.record("sync_load_timeouts")
    stats.record("pull_failed")
    stats.record("prompt_tokens_pulled_from_peer", 139)
    stats.record("early_decode_ready")
    stats.record("host_resident_bytes", 4096)
    stats.record("session_holds", 3)
    stats.record("session_holds", 2)   # a gauge: the last value reported wins
    stats.record("session_hold_blocks", 40)
    stats.record("session_hold_blocks", 37)
    stats.record("session_holds_released_lease_ended")
    stats.record("session_holds_released_reset")
    stats.record("session_holds_released_reset")
    metrics.observe(stats.data, 0)

    def value(name, **labels):
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert value("sessionkv_peer_loads_total", mode="sync") == 2
    assert value("sessionkv_peer_loads_total", mode="async") == 1
    assert value("sessionkv_sync_load_wait_seconds_count") == 1
    assert value("sessionkv_sync_load_timeouts_total") == 1
    assert value("sessionkv_pull_failures_total") == 1
    assert value("sessionkv_prompt_tokens_total", source="pulled_from_peer") == 139
    assert value("sessionkv_early_decode_requests_total", outcome="ready") == 1
    assert value("sessionkv_host_resident_bytes") == 4096
    assert value("sessionkv_session_holds") == 2
    assert value("sessionkv_session_hold_blocks") == 37
    assert value("sessionkv_session_holds_released_total", reason="lease_ended") == 1
    assert value("sessionkv_session_holds_released_total", reason="reset") == 2
    assert value("sessionkv_session_holds_released_total", reason="pulled") == 0


def test_every_counted_key_is_a_stats_key():
    _, metrics = _registry_metrics()
    recorded = set(stats_mod.SessionKVStats().data)
    assert set(metrics._counters) <= recorded
    assert set(metrics._histograms) <= recorded
