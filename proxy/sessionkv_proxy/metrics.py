"""The proxy's Prometheus metrics (``sessionkv_proxy_*``), in their own registry.

The series updated on every request (requests, routing decisions, session handles, and
the decision-time and prompt-size histograms) are plain Python counts read by a custom
collector at scrape time, not prometheus_client metric objects: ``Counter.inc`` and
``Histogram.observe`` each take a lock, and ``observe`` walks the buckets in Python,
several microseconds per request in all. No lock is needed: the proxy runs on one
event-loop thread and ``/metrics`` is served from that same loop, so a scrape never
runs in the middle of an update. The exported names, labels, help texts and buckets are
those the prometheus_client objects gave, less the ``_created`` samples of these five.
The rarer series (errors, retries, gauges) stay prometheus_client objects.
"""

from __future__ import annotations

import enum
from bisect import bisect_left
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

__all__ = ["ProxyMetrics"]

_INF = float("inf")
_DECISION_S_BOUNDS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, _INF)
_PROMPT_BLOCKS_BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, _INF)

_REQUESTS = ("sessionkv_proxy_requests", "Requests by endpoint and status.",
             ("endpoint", "status"))
_DECISIONS = ("sessionkv_proxy_routing_decisions", "Routing decisions by mode and reason.",
              ("mode", "reason"))
_HANDLES = ("sessionkv_proxy_session_handles",
            "Session handles by outcome: attached, expired, other_tenant, none.", ("outcome",))
_DECISION_S = ("sessionkv_proxy_routing_decision_seconds", "Time to make a routing decision.")
_PROMPT_BLOCKS = ("sessionkv_proxy_prompt_blocks", "Full prompt blocks per routed request.")


class ProxyMetrics:
    def __init__(self, redis: bool = False) -> None:
        # Per-request counts (see the module docstring), keyed by label values.
        self._requests: dict[tuple[str, int], int] = {}
        self._decisions: dict[tuple[str, str], int] = {}
        self._handles: dict[str, int] = {}
        self._decision_s = _Histogram(_DECISION_S, _DECISION_S_BOUNDS)
        self._prompt_blocks = _Histogram(_PROMPT_BLOCKS, _PROMPT_BLOCKS_BOUNDS)
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_RequestCollector(self))
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
        self.dropped = Gauge("sessionkv_proxy_events_dropped",
                             "KV events decoded but not indexed, per engine and reason "
                             "(block_size_mismatch, other_group, tokens_not_aligned, "
                             "unknown_parent, tokenless_unknown).", ["engine", "reason"],
                             registry=r)
        self.errors = Counter("sessionkv_proxy_errors", "Errors by kind.", ["kind"],
                              registry=r)
        self.host_tier_restores = Counter(
            "sessionkv_proxy_host_tier_restores",
            "Session prefixes a decode worker was asked to restore from its host tier "
            "for the prefill worker to pull, by outcome (handle: P got the handle; "
            "expired: D's lease is shorter than the handle expiry margin; failed: D did "
            "not answer with one; P then prefills without it).",
            ["outcome"], registry=r)
        self.resent_answers = Counter(
            "sessionkv_proxy_resent_answers",
            "Chat requests by how their prompt went with resend_answer_ids on (spliced: "
            "the previous answer re-sent as the ids D generated, which the template "
            "tokenizes otherwise; same: re-sent, the same ids either way; template: no "
            "remembered answer in place, the template's ids; chat_text: sent to the chat "
            "endpoint as text, the request being one it alone serves).",
            ["outcome"], registry=r)
        self.retries = Counter("sessionkv_proxy_upstream_retries",
                               "Requests re-sent to another worker after a connection "
                               "failure.", ["role"], registry=r)
        self.in_flight = Gauge("sessionkv_proxy_in_flight_requests",
                               "Requests in flight per engine.", ["engine"], registry=r)
        self.engine_available = Gauge(
            "sessionkv_proxy_engine_available",
            "1 while an engine takes new requests; 0 while it refuses connections or "
            "is stalled (no answer for engine_stall_s).", ["engine"], registry=r)
        self._engine_set_and_auth(r)
        self.degraded = Counter(
            "sessionkv_proxy_degraded_requests",
            "Requests routed with less than the usual view, by reason "
            "(redis_unavailable: index and sessions read from this replica's copy).",
            ["reason"], registry=r)
        if redis:
            self.redis_up = Gauge(
                "sessionkv_proxy_redis_up",
                "1 while Redis serves the index and sessions; 0 while it is down or "
                "the proxy re-publishes what it missed.", registry=r)
            self.redis_fallbacks = Counter(
                "sessionkv_proxy_redis_fallbacks",
                "Reads served from the proxy's own copy because Redis did not answer, "
                "by operation.", ["op"], registry=r)
            self.redis_republishes = Counter(
                "sessionkv_proxy_redis_republishes",
                "Times the proxy re-published its index and sessions to Redis after an "
                "outage or a Redis restart.", registry=r)

    def _engine_set_and_auth(self, r: CollectorRegistry) -> None:
        self.engines = Gauge(
            "sessionkv_proxy_engines",
            "Engines in the set, by role and state (serving: routing sends them new "
            "requests; draining: removed, with requests still in flight).",
            ["role", "state"], registry=r)
        self.engine_set_changes = Counter(
            "sessionkv_proxy_engine_set_changes",
            "Changes of the engine set while running (PUT /admin/engines, engines_file), "
            "by outcome: applied, or invalid (refused; the set unchanged).", ["outcome"],
            registry=r)
        self.unauthorized = Counter(
            "sessionkv_proxy_unauthorized_requests",
            "Requests refused with 401 for a missing or wrong API key (api_key), by "
            "endpoint path.", ["endpoint"], registry=r)

    def count_request(self, endpoint: str, status: int) -> None:
        """One answered request (``sessionkv_proxy_requests``)."""
        key = (endpoint, status)
        counts = self._requests
        counts[key] = counts.get(key, 0) + 1

    def count_route(self, mode: enum.Enum, reason: enum.Enum, handle_outcome: str,
                    decision_s: float, prompt_blocks: int) -> None:
        """One routing decision: its mode and reason (enum members, whose values are
        the labels: read at scrape time, not per request), the session handle's
        outcome, the time it took and the prompt's full blocks."""
        key = (mode, reason)
        counts = self._decisions
        counts[key] = counts.get(key, 0) + 1
        handles = self._handles
        handles[handle_outcome] = handles.get(handle_outcome, 0) + 1
        self._decision_s.observe(decision_s)
        self._prompt_blocks.observe(prompt_blocks)


def _counter(spec: tuple, counts: dict | None) -> CounterMetricFamily:
    name, documentation, labels = spec
    family = CounterMetricFamily(name, documentation, labels=labels)
    if counts:
        # Label values as prometheus_client writes them (str; an enum member's
        # value); keys that read alike add up.
        merged: dict[tuple[str, ...], int] = {}
        for key, n in list(counts.items()):
            values = tuple(v.value if isinstance(v, enum.Enum) else str(v)
                           for v in (key if isinstance(key, tuple) else (key,)))
            merged[values] = merged.get(values, 0) + n
        for values, n in merged.items():
            family.add_metric(values, float(n))
    return family


class _Histogram:
    """A count per bucket (not cumulative; the last bound is +Inf) and a sum."""

    def __init__(self, spec: tuple, bounds: tuple) -> None:
        self.spec, self.bounds = spec, bounds
        self.buckets = [0] * len(bounds)
        self.total: float = 0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= the value, Prometheus' ``le``.
        self.buckets[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, empty: bool = False) -> HistogramMetricFamily:
        name, documentation = self.spec
        cumulative = []
        running = 0
        for bound, n in zip(self.bounds, [0] * len(self.bounds) if empty else self.buckets):
            running += n
            cumulative.append((floatToGoString(bound), float(running)))
        return HistogramMetricFamily(name, documentation, buckets=cumulative,
                                     sum_value=0.0 if empty else float(self.total))


class _RequestCollector:
    """Exports ProxyMetrics' per-request counts at scrape time."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._m = metrics

    def describe(self) -> Iterator[Metric]:
        # Names only, so the registry refuses a clash with another metric.
        yield _counter(_REQUESTS, None)
        yield _counter(_DECISIONS, None)
        yield self._m._prompt_blocks.family(empty=True)
        yield _counter(_HANDLES, None)
        yield self._m._decision_s.family(empty=True)

    def collect(self) -> Iterator[Metric]:
        m = self._m
        yield _counter(_REQUESTS, m._requests)
        yield _counter(_DECISIONS, m._decisions)
        yield m._prompt_blocks.family()
        yield _counter(_HANDLES, m._handles)
        yield m._decision_s.family()
