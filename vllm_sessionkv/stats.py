"""Connector statistics and their Prometheus export (``sessionkv_*``).

vLLM ships connector stats from the scheduler and the workers to the API server,
where ``build_prom_metrics`` turns them into Prometheus series.  The scheduler-side
stats (token sources, decisions, verification) and NIXL's worker-side telemetry
travel in one container with one key set, because ``aggregate`` merges key by key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_sessionkv._vllm import metrics
from vllm_sessionkv._vllm.metrics import (
    NixlKVConnectorStats,
    NixlPromMetrics,
    create_metric_per_engine,
)
from vllm_sessionkv.early_decode import REFUSED_REASONS as EARLY_DECODE_REFUSED
from vllm_sessionkv.first_token import FIRST_TOKEN_OUTCOMES
from vllm_sessionkv.holds import HOLD_BLOCKS_EVERY_S, RELEASE_REASONS, WITHDRAW_REASONS
from vllm_sessionkv.retention import DEMOTE_REASONS, HOLD_TIERS, LeaseSource

__all__ = ["DIGEST_CHECK_OUTCOMES", "EARLY_DECODE_OUTCOMES", "GUARD_CLAIM_OUTCOMES", "GUARD_FALLBACKS", "LOAD_MODES", "PROMPT_TOKEN_SOURCES", "SessionKVPromMetrics",
           "SessionKVStats"]

# How a request's prompt tokens were obtained.  Keys of TokenAccounting, per source.
PROMPT_TOKEN_SOURCES = ("local_hit", "pulled_from_peer", "pulled_from_host", "recomputed",
                        "refused_by_verification")

# How a request sent to D while P prefilled got its KV (early_decode.Outcome, and
# "refused" when this engine has no early-decode socket).
EARLY_DECODE_OUTCOMES = ("ready", "prefill_failed", "timed_out", "refused")

# How a peer read runs: in the step that computes the request, or in steps of its own.
LOAD_MODES = ("sync", "async")

# Why a read of a peer's held blocks fell back to recompute under the pull guard
# (guard.py): its claim or its confirm was refused by the holder, or not answered.
GUARD_FALLBACKS = ("claim_refused", "claim_timeout", "confirm_refused", "confirm_timeout")
# What this engine, as holder, answered to readers' claims.
GUARD_CLAIM_OUTCOMES = ("granted", "refused")
# How a guarded read's content digest compared with the holder's (kv_digest.py):
# matched, mismatched (the read failed and was recomputed), unchecked (the holder
# gave no digests: its digest is off, or its ranks' layout differs from ours).
DIGEST_CHECK_OUTCOMES = ("matched", "mismatched", "unchecked")

_SESSION_KEYS = (
    *(f"prompt_tokens_{s}" for s in PROMPT_TOKEN_SOURCES),
    "decision_pull",
    "decision_recompute",
    "handle_refused",
    "pull_failed",
    "session_handles_published",
    "session_handles_sent",
    "session_handles_publish_failed",
    "host_offloaded_blocks",
    "host_restored_blocks",
    "host_evicted_blocks",
    "host_resident_bytes",
    "disk_spilled_blocks",
    "disk_promoted_blocks",
    "disk_refused_blocks",
    "disk_evicted_blocks",
    "disk_resident_bytes",
    "disk_read_s",
    "session_holds",
    "session_hold_blocks",
    "recompute_s_per_token",
    "link_bytes_per_s",
    *(f"session_holds_released_{r}" for r in RELEASE_REASONS),
    *(f"handles_withdrawn_{r}" for r in WITHDRAW_REASONS),
    *(f"session_hold_leases_{s.value}" for s in LeaseSource),
    *(f"session_hold_ends_{r}_{t}" for r in DEMOTE_REASONS for t in HOLD_TIERS),
    "host_store_s",
    "host_restore_s",
    "idle_step_recv_wait_s",
    *(f"load_{m}" for m in LOAD_MODES),
    "sync_load_wait_s",
    "sync_load_timeouts",
    *(f"early_decode_{o}" for o in EARLY_DECODE_OUTCOMES),
    "early_decode_wait_s",
    "early_decode_pushed_by_prefill",
    *(f"early_decode_refused_{r}" for r in EARLY_DECODE_REFUSED),
    *(f"first_token_{o}" for o in FIRST_TOKEN_OUTCOMES),
    *(f"pull_guard_{r}" for r in GUARD_FALLBACKS),
    *(f"guard_claims_{o}" for o in GUARD_CLAIM_OUTCOMES),
    "guard_frees_deferred",
    *(f"kv_digest_{o}" for o in DIGEST_CHECK_OUTCOMES),
    "kv_digest_blocks",
    "kv_digest_s",
)


@dataclass
class SessionKVStats(NixlKVConnectorStats):
    def reset(self):
        super().reset()
        for key in _SESSION_KEYS:
            self.data[key] = []

    def record(self, key: str, value: int | float = 1) -> None:
        self.data[key].append(value)

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(k) for k in _SESSION_KEYS)

    def aggregate(self, other):
        # Stock aggregate skips "empty" containers by its own definition, which would
        # drop a step that only carried our keys.
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced = super().reduce() if self.num_successful_transfers else {}
        for key in _SESSION_KEYS:
            total = sum(self.data.get(key, ()))
            if total:
                reduced[key] = total
        return reduced


class SessionKVPromMetrics(NixlPromMetrics):
    """NIXL's own series plus ``sessionkv_*`` counters, labelled per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._labels = list(labelnames)
        self._per_engine = per_engine_labelvalues
        self._session_metrics()
        self._host_and_hold_metrics()
        self._step_metrics()
        self._handoff_and_guard_metrics()
        self._counters, self._histograms = self._by_stats_key()

    def _counter(self, name: str, doc: str, extra_labels: tuple[str, ...] = ()):
        return metrics.prom_counter(self, name=name, documentation=doc,
                                    labelnames=[*self._labels, *extra_labels])

    def _gauge(self, name: str, doc: str):
        return create_metric_per_engine(metrics.prom_gauge(
            self, name=name, documentation=doc, labelnames=self._labels,
            multiprocess_mode="mostrecent"), self._per_engine)

    def _histogram(self, name: str, doc: str, buckets: list[float]):
        return create_metric_per_engine(metrics.prom_histogram(
            self, name=name, documentation=doc, buckets=buckets,
            labelnames=self._labels), self._per_engine)

    def _by_label(self, name: str, doc: str, label: str, values: tuple[str, ...]):
        """One counter with an extra label: its per-engine children by value."""
        metric = self._counter(name, doc, (label,))
        return {v: _per_engine_with_label(metric, self._per_engine, v) for v in values}

    def _session_metrics(self) -> None:
        """Prompt-token sources, pull decisions, refused handles, failed pulls, handles
        published."""
        self._prompt_tokens = self._by_label(
            "sessionkv_prompt_tokens",
            "Prompt tokens by how they were obtained: local_hit, pulled_from_peer, "
            "pulled_from_host, recomputed, refused_by_verification.", "source",
            PROMPT_TOKEN_SOURCES)
        self._decisions = self._by_label("sessionkv_pull_decisions",
                                   "Pull-or-recompute decisions on remote session KV.",
                                   "decision", ("pull", "recompute"))
        self._handle_refused = create_metric_per_engine(
            self._counter("sessionkv_handles_refused",
                    "Session handles not used at all: other tenant, hash settings "
                    "differ, malformed, unknown protocol version."), self._per_engine)
        self._pull_failed = create_metric_per_engine(
            self._counter("sessionkv_pull_failures",
                    "Pulls that failed or expired and fell back to recompute."),
            self._per_engine)
        self._published = create_metric_per_engine(
            self._counter("sessionkv_handles_published",
                    "Session handles published at the end of a turn."),
            self._per_engine)
        self._sent = create_metric_per_engine(
            self._counter("sessionkv_handle_channel_sent",
                    "Session handles sent on the handle channel (handle_channel_port) "
                    "at the end of a turn; a proxy too slow to take them loses them "
                    "and counts the gap."),
            self._per_engine)
        self._publish_failed = create_metric_per_engine(
            self._counter("sessionkv_handle_publish_failures",
                    "Session handles that could not be written out of band (Redis or "
                    "the handle channel)."),
            self._per_engine)

    def _host_and_hold_metrics(self) -> None:
        """The host-DRAM tier and session holds."""
        self._host_counters = {
            key: create_metric_per_engine(self._counter(name, doc), self._per_engine)
            for key, name, doc in (
                ("host_offloaded_blocks", "sessionkv_host_offloaded_blocks",
                 "Blocks copied to the host-DRAM tier."),
                ("host_restored_blocks", "sessionkv_host_restored_blocks",
                 "Blocks restored from the host-DRAM tier."),
                ("host_evicted_blocks", "sessionkv_host_evicted_blocks",
                 "Blocks evicted from the host-DRAM tier by its policy."))}
        self._host_resident = self._gauge("sessionkv_host_resident_bytes",
                                    "Bytes resident in the host-DRAM tier.")
        self._disk_counters = {
            key: create_metric_per_engine(self._counter(name, doc), self._per_engine)
            for key, name, doc in (
                ("disk_spilled_blocks", "sessionkv_disk_spilled_blocks",
                 "Blocks the host tier evicted, written to the disk tier."),
                ("disk_promoted_blocks", "sessionkv_disk_promoted_blocks",
                 "Blocks read back from the disk tier into the host tier, checked."),
                ("disk_refused_blocks", "sessionkv_disk_refused_blocks",
                 "Disk-tier files refused on read (missing, checksum, another "
                 "layout) and deleted; their tokens were recomputed."),
                ("disk_evicted_blocks", "sessionkv_disk_evicted_blocks",
                 "Disk-tier files deleted to stay within disk_tier_bytes."))}
        self._disk_resident = self._gauge("sessionkv_disk_resident_bytes",
                                          "Bytes of block files in the disk tier.")
        self._disk_read_s = self._histogram(
            "sessionkv_disk_read_seconds",
            "Time to read and check one step's disk-tier blocks into host slots.",
            [1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0])
        self._session_holds = self._gauge(
            "sessionkv_session_holds",
            "Sessions whose last turn's KV this engine holds for the next turn's pull "
            "(until it is read, superseded or its lease ends).")
        self._session_hold_blocks = self._gauge(
            "sessionkv_session_hold_blocks",
            "KV blocks only session holds keep: held blocks (every KV cache group's) "
            "whose reference count in vLLM's block pool is no more than the holds "
            "naming them, so no running request shares them; ending the holds, as D "
            "does for a request it cannot admit, frees exactly these.  "
            "vllm:kv_cache_usage_perc counts them as used; the proxy takes them off "
            "it (over vllm:cache_config_info's num_gpu_blocks).  Counted at most "
            f"every {HOLD_BLOCKS_EVERY_S} s.")
        self._recompute_price = self._gauge(
            "sessionkv_recompute_seconds_per_token",
            "The recompute price per new token the pull-or-recompute decision uses: "
            "calibrated from this engine's prefill steps, or cost.recompute_s_per_token "
            "where set (reported when it changes).")
        self._link_price = self._gauge(
            "sessionkv_link_bytes_per_second",
            "The peer link's bandwidth the pull-or-recompute decision uses, refined "
            "from NIXL's transfer telemetry (reported when it changes).")
        self._holds_released = self._by_label(
            "sessionkv_session_holds_released",
            "Session holds ended, by reason, each a normal outcome: pulled (the next "
            "turn's P read the blocks or declined them), lease_ended (no next turn "
            "within its lease), superseded (a newer turn holds its own blocks), "
            "reset (reset_prefix_cache with reset_external), kv_pressure (holds pinned "
            "more than session_hold_max_kv_fraction of the KV; the least valuable "
            "ended, by retention.py).",
            "reason", RELEASE_REASONS)
        self._handles_withdrawn = self._by_label(
            "sessionkv_handles_withdrawn",
            "Session handles withdrawn where the proxies find them (Redis, the handle "
            "channel) because their hold ended before its lease, by the hold's end: "
            "kv_pressure, superseded, reset, pulled (read, or NIXL's expiry).",
            "reason", WITHDRAW_REASONS)
        self._hold_leases = self._by_label(
            "sessionkv_session_hold_leases",
            "Session holds begun, by what set their lease (retention.py): hint (the "
            "client's X-Session-Hold-S), gaps (the session's observed inter-turn gaps) or "
            "default (session_lease_s; every lease under retention age).", "source",
            tuple(s.value for s in LeaseSource))
        ends = self._counter(
            "sessionkv_session_hold_ends",
            "Session holds that ended unread, by reason (kv_pressure, lease_ended) and "
            "where their KV went: host (demoted to the host tier, all its full blocks "
            "there) or dropped.", ("reason", "tier"))
        self._hold_ends = {
            (reason, tier): {idx: ends.labels(*vals, reason, tier)
                             for idx, vals in self._per_engine.items()}
            for reason in DEMOTE_REASONS for tier in HOLD_TIERS}
        self._host_restore_s = self._histogram(
            "sessionkv_host_restore_seconds",
            "Time to restore one request's blocks from "
            "the host-DRAM tier.",
            [1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0])

    def _step_metrics(self) -> None:
        """Idle steps, peer reads (sync or async) and early decode."""
        self._idle_recv_wait_s = self._histogram(
            "sessionkv_idle_step_recv_wait_seconds",
            "Time a step with no model to run and "
            "KV reads in flight waited for them (0 "
            "when done at the first poll; "
            "idle_step_recv_wait_s caps it).",
            [1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1])

        self._loads = self._by_label(
            "sessionkv_peer_loads",
            "Peer KV reads by mode: sync (read inside the step that computes the request, "
            "which then skips a step) or async (vLLM's way: the request waits for the "
            "read in steps of its own).", "mode", LOAD_MODES)
        self._sync_load_wait_s = self._histogram(
            "sessionkv_sync_load_wait_seconds",
            "Time a step's forward waited for its "
            "synchronous peer reads.",
            [1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0])
        self._sync_load_timeouts = create_metric_per_engine(
            self._counter("sessionkv_sync_load_timeouts",
                    "Synchronous peer reads not done within sync_load_timeout_s; the "
                    "request's blocks were recomputed."), self._per_engine)

        self._early_decode = self._by_label(
            "sessionkv_early_decode_requests",
            "Requests sent to D while P prefilled, by how they got their KV: ready (P's "
            "parameters came), prefill_failed, timed_out, refused (no early-decode socket "
            "here); all but ready compute the prompt on D.", "outcome",
            EARLY_DECODE_OUTCOMES)
        self._early_decode_wait_s = self._histogram(
            "sessionkv_early_decode_wait_seconds",
            "Time a request sent to D while P "
            "prefilled waited in D's scheduler for "
            "P's parameters.",
            [1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0])

        self._early_decode_refused = self._by_label(
            "sessionkv_early_decode_messages_refused",
            "Messages on the early-decode port dropped unread, by why: unauthenticated "
            "(no valid HMAC under side_port_secret: a forged or misconfigured sender) "
            "or malformed.", "reason", EARLY_DECODE_REFUSED)
        self._early_decode_pushes = create_metric_per_engine(
            self._counter("sessionkv_early_decode_pushes",
                    "Parameters this engine, as P, pushed straight to the D holding "
                    "the request (early decode); the rest the proxy pushes."),
            self._per_engine)

    def _handoff_and_guard_metrics(self) -> None:
        """First-token handoff and the pull guard."""
        self._first_token = self._by_label(
            "sessionkv_first_token_handoffs",
            "D requests that came with the token P sampled, by what D did with it: "
            "continued (D appended it and started at the next token, saving a step) or "
            "why not (logprobs, seeded_sampling, stop_token, ...).", "outcome",
            FIRST_TOKEN_OUTCOMES)
        self._guard_fallbacks = self._by_label(
            "sessionkv_pull_guard_fallbacks",
            "Reads of a peer's held blocks that fell back to recompute under the pull "
            "guard, by why: claim_refused (the holder no longer held the blocks, or "
            "another reader had claimed them), claim_timeout, confirm_refused (the claim "
            "lapsed before the read was confirmed), confirm_timeout.", "reason",
            GUARD_FALLBACKS)
        self._guard_claims = self._by_label(
            "sessionkv_guard_claims",
            "Readers' claims on blocks this engine holds, by answer.", "outcome",
            GUARD_CLAIM_OUTCOMES)
        self._guard_deferred = create_metric_per_engine(
            self._counter("sessionkv_guard_deferred_frees",
                    "Held blocks whose free waited for a reader's claim to end."),
            self._per_engine)
        self._digest_checks = self._by_label(
            "sessionkv_kv_digest_checks",
            "Guarded reads whose content digest was compared with the holder's: "
            "matched; mismatched (the read failed and the blocks were recomputed); "
            "unchecked (the holder gave no digests: its kv_digest is off, or the ranks' "
            "block layouts differ).", "outcome", DIGEST_CHECK_OUTCOMES)
        self._digest_blocks = create_metric_per_engine(
            self._counter("sessionkv_kv_digest_blocks",
                    "KV blocks digested: each hold's as it began, each guarded read's "
                    "after it landed."), self._per_engine)
        self._digest_seconds = create_metric_per_engine(
            self._counter("sessionkv_kv_digest_seconds",
                    "Worker time spent digesting KV blocks (over "
                    "sessionkv_kv_digest_blocks_total: the cost per block)."),
            self._per_engine)

    def _by_stats_key(self) -> tuple[dict[str, dict[int, Any]], dict[str, dict[int, Any]]]:
        """(counters, histograms) per engine, by the stats key that feeds them."""
        counters = {
            **{f"prompt_tokens_{s}": m for s, m in self._prompt_tokens.items()},
            **{f"decision_{d}": m for d, m in self._decisions.items()},
            "handle_refused": self._handle_refused,
            "pull_failed": self._pull_failed,
            "session_handles_published": self._published,
            "session_handles_sent": self._sent,
            "session_handles_publish_failed": self._publish_failed,
            **self._host_counters,
            **self._disk_counters,
            **{f"session_holds_released_{r}": m for r, m in self._holds_released.items()},
            **{f"handles_withdrawn_{r}": m for r, m in self._handles_withdrawn.items()},
            **{f"session_hold_leases_{s}": m for s, m in self._hold_leases.items()},
            **{f"session_hold_ends_{r}_{t}": m for (r, t), m in self._hold_ends.items()},
            **{f"load_{mode}": m for mode, m in self._loads.items()},
            "sync_load_timeouts": self._sync_load_timeouts,
            **{f"early_decode_{o}": m for o, m in self._early_decode.items()},
            "early_decode_pushed_by_prefill": self._early_decode_pushes,
            **{f"early_decode_refused_{r}": m for r, m in self._early_decode_refused.items()},
            **{f"first_token_{o}": m for o, m in self._first_token.items()},
            **{f"pull_guard_{r}": m for r, m in self._guard_fallbacks.items()},
            **{f"guard_claims_{o}": m for o, m in self._guard_claims.items()},
            "guard_frees_deferred": self._guard_deferred,
            **{f"kv_digest_{o}": m for o, m in self._digest_checks.items()},
            "kv_digest_blocks": self._digest_blocks,
            "kv_digest_s": self._digest_seconds,
        }
        histograms = {
            "host_restore_s": self._host_restore_s,
            "disk_read_s": self._disk_read_s,
            "idle_step_recv_wait_s": self._idle_recv_wait_s,
            "sync_load_wait_s": self._sync_load_wait_s,
            "early_decode_wait_s": self._early_decode_wait_s,
        }
        return counters, histograms

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        super().observe(transfer_stats_data, engine_idx)
        for key, metric in self._counters.items():
            total = sum(transfer_stats_data.get(key, ()))
            if total:
                metric[engine_idx].inc(total)
        for key, metric in self._histograms.items():
            for seconds in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(seconds)
        # Gauges: the last value the scheduler reported (it reports on change).
        for key, gauge in (("host_resident_bytes", self._host_resident),
                           ("disk_resident_bytes", self._disk_resident),
                           ("session_holds", self._session_holds),
                           ("session_hold_blocks", self._session_hold_blocks),
                           ("recompute_s_per_token", self._recompute_price),
                           ("link_bytes_per_s", self._link_price)):
            values = transfer_stats_data.get(key) or ()
            if values:
                gauge[engine_idx].set(values[-1])


def _per_engine_with_label(metric, per_engine_labelvalues, value: str) -> dict[int, Any]:
    return {idx: metric.labels(*vals, value) for idx, vals in per_engine_labelvalues.items()}
