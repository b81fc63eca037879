"""Session holds on D (``holds.py``): a finished session turn's blocks stay held for
the next turn's pull under a lease, a newer turn supersedes an older one, holds over
a share of the KV end oldest first (``kv_pressure``), a reset ends them all; the
handle is published out of band (Redis, and the handle channel for proxies without
Redis).  Holds end through the worker, which
releases them in the step they are handed to it."""

from __future__ import annotations

import logging
from typing import Any

from vllm_sessionkv.handle_channel import HandleChannel
from vllm_sessionkv.holds import HoldTable
from vllm_sessionkv.publisher import HandlePublisher
from vllm_sessionkv.scheduling.counters import StatsSink
from vllm_sessionkv.scheduling.guard_ledger import GuardLedger

__all__ = ["SessionHolds"]

logger = logging.getLogger("vllm.sessionkv.scheduler")


class SessionHolds:
    def __init__(self, max_held_blocks: int, max_kv_fraction: float,
                 publisher: HandlePublisher, channel: HandleChannel | None = None) -> None:
        self._table = HoldTable()
        self._to_release: set[str] = set()    # for the next step's metadata
        self._max_held_blocks = max_held_blocks
        self._max_kv_fraction = max_kv_fraction
        self._publisher = publisher
        self._channel = channel
        self._reported = 0   # sessionkv_session_holds, sent on change

    def hold(self, session_id: str, request_id: str, now_s: float, lease_s: float,
             grace_s: float, num_blocks: int) -> float:
        """Hold a finished turn's blocks; returns the lease's end (perf_counter).
        Holds over the cap end, oldest first, at the next step."""
        deadline = now_s + lease_s
        self._table.hold(session_id, request_id, until_s=deadline,
                         superseded_until_s=now_s + grace_s, num_blocks=num_blocks)
        for req_id in self._table.over_cap(self._max_held_blocks, keep=request_id):
            logger.info("sessionkv hold ends early request_id=%s reason=kv_pressure "
                        "(holds over %.0f%% of the KV blocks)", req_id,
                        self._max_kv_fraction * 100)
            self._to_release.add(req_id)
        return deadline

    def publish(self, session_id: str, params: dict[str, Any], lease_s: float,
                stats: StatsSink) -> None:
        """Publish a turn's handle: to Redis, and on the handle channel."""
        if self._publisher.publish(session_id, params, lease_s):
            stats.record("session_handles_published")
        if self._channel is not None:
            stats.record("session_handles_sent" if self._channel.publish(params)
                         else "session_handles_publish_failed")

    def take_releases(self, now_s: float, guard: GuardLedger) -> set[str]:
        """Holds the worker is to release in this step: those whose lease (or, once
        superseded, grace) ended, and those a reset or the cap dropped; a hold a
        reader's claim stands on ends after it.

        A lease ends at the deadline published in the handle; P refuses a handle
        within ``expiry_margin_s`` of it and vLLM's reader declines a read within 5 s
        of it, so no pull of these blocks starts this late."""
        due = self._table.due(now_s)
        for req_id, reason in due.items():
            logger.debug("sessionkv hold ends request_id=%s reason=%s", req_id, reason)
        self._to_release.update(due)
        releases = guard.releasable(self._to_release, now_s)
        self._to_release -= releases
        return releases

    def released(self, request_ids, stats: StatsSink) -> None:
        """The worker reported these sends finished: count the holds among them."""
        for req_id in request_ids:
            reason = self._table.released(req_id)
            if reason is not None:
                self._to_release.discard(req_id)
                stats.record(f"session_holds_released_{reason}")
                logger.debug("sessionkv hold released request_id=%s reason=%s", req_id,
                             reason)

    def end_all(self) -> int:
        """A reset: every hold ends at the next step; returns how many."""
        dropped = self._table.end_all("reset")
        self._to_release.update(dropped)
        return len(dropped)

    def record_stats(self, stats: StatsSink) -> None:
        if self._table.sessions != self._reported:
            self._reported = self._table.sessions
            stats.record("session_holds", self._reported)
        failures = self._publisher.take_failures()
        if failures:
            stats.record("session_handles_publish_failed", failures)

    def close(self) -> None:
        self._publisher.close()
        if self._channel is not None:
            self._channel.close()
