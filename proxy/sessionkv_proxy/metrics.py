"""The proxy's Prometheus metrics (``sessionkv_proxy_*``), in their own registry."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ProxyMetrics"]


class ProxyMetrics:
    def __init__(self) -> None:
        # Labelled children resolved once: ``labels()`` costs more than the increment.
        self._children: dict[tuple, Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sessionkv_proxy_requests", "Requests by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.decisions = Counter("sessionkv_proxy_routing_decisions",
                                 "Routing decisions by mode and reason.", ["mode", "reason"],
                                 registry=r)
        self.overlap_blocks = Histogram(
            "sessionkv_proxy_overlap_blocks", "Leading prompt blocks the chosen engine held.",
            ["tier"], buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024), registry=r)
        self.prompt_blocks = Histogram(
            "sessionkv_proxy_prompt_blocks", "Full prompt blocks per routed request.",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024), registry=r)
        self.index_blocks = Gauge("sessionkv_proxy_index_blocks",
                                  "Entries in the KV index.", registry=r)
        self.event_lag_s = Gauge("sessionkv_proxy_event_lag_seconds",
                                 "Age of the newest KV event batch applied, per engine.",
                                 ["engine"], registry=r)
        self.events = Gauge("sessionkv_proxy_events_applied",
                            "KV events applied to the index, per engine.", ["engine"],
                            registry=r)
        self.replays = Gauge("sessionkv_proxy_event_replays",
                             "Replays requested after a sequence gap, per engine.",
                             ["engine"], registry=r)
        self.resets = Gauge("sessionkv_proxy_event_resets",
                            "Publisher restarts seen (index rebuilt), per engine.",
                            ["engine"], registry=r)
        self.undecodable = Gauge("sessionkv_proxy_events_undecodable",
                                 "KV event batches that failed to decode, per engine.",
                                 ["engine"], registry=r)
        self.errors = Counter("sessionkv_proxy_errors", "Errors by kind.", ["kind"],
                              registry=r)
        self.retries = Counter("sessionkv_proxy_upstream_retries",
                               "Requests re-sent to another worker after a connection "
                               "failure.", ["role"], registry=r)
        self.handles = Counter("sessionkv_proxy_session_handles",
                               "Session handles by outcome: attached, expired, other_tenant, "
                               "none.", ["outcome"], registry=r)
        self.decision_s = Histogram(
            "sessionkv_proxy_routing_decision_seconds", "Time to make a routing decision.",
            buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2), registry=r)
        self.in_flight = Gauge("sessionkv_proxy_in_flight_requests",
                               "Requests in flight per engine.", ["engine"], registry=r)

    def child(self, metric, *labels: str):
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def count_request(self, endpoint: str, status: int) -> None:
        self.child(self.requests, endpoint, str(status)).inc()
