"""Session holds on D (``holds.py``): a finished session turn's blocks stay held for
the next turn's pull under a lease, a newer turn supersedes an older one, holds over
a share of the KV end oldest first (``kv_pressure``), a reset ends them all; the
handle is published out of band (Redis, and the handle channel for proxies without
Redis).  Holds end through the worker, which
releases them in the step they are handed to it.

A hold that ends before its lease (kv_pressure, superseded, reset) has its handle
withdrawn where the proxies find it (``HandleWithdrawal``: Redis and the channel) as
soon as the end is decided, and so has one released for any other reason but its
lease (pulled, NIXL's expiry): a proxy replica that still has the handle (its own
record, the channel's copy) then does not attach it and routes the turn to D alone or
to a host-tier restore, instead of a claim D would refuse.  An ended lease needs
none: the handle's expiry says so."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from vllm_sessionkv.handle_channel import HandleChannel
from vllm_sessionkv.holds import HoldTable
from vllm_sessionkv.publisher import HandlePublisher
from vllm_sessionkv.scheduling.counters import StatsSink
from vllm_sessionkv.scheduling.guard_ledger import GuardLedger
from vllm_sessionkv.wire.protocol import HandleWithdrawal, PayloadError, handle_from_params

__all__ = ["SessionHolds"]

logger = logging.getLogger("vllm.sessionkv.scheduler")


class SessionHolds:
    def __init__(self, max_held_blocks: int, max_kv_fraction: float,
                 publisher: HandlePublisher, channel: HandleChannel | None = None,
                 withdraw: bool = True) -> None:
        self._table = HoldTable()
        # Published holds whose handle a withdrawal would name (``withdraw``), by
        # request id; a hold leaves it when withdrawn or when its lease ended.
        self._withdraw = withdraw
        self._published: dict[str, HandleWithdrawal] = {}
        self._withdrawn_unrecorded: dict[str, int] = {}
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
            self._withdraw_handle(req_id, "kv_pressure")
        return deadline

    def announce(self, engine_url: str, epoch: int) -> None:
        """This process's start-up epoch, to Redis at once (``HandlePublisher``)."""
        if self._withdraw:
            self._publisher.announce(engine_url, epoch)

    def publish(self, session_id: str, params: dict[str, Any], lease_s: float,
                stats: StatsSink, request_id: str | None = None) -> None:
        """Publish a turn's handle: to Redis, and on the handle channel; remember
        what would withdraw it (``request_id``'s hold)."""
        if self._withdraw and request_id is not None:
            try:
                payload = handle_from_params(params).payload
            except PayloadError:
                payload = None
            if payload is not None and payload.hold_token:
                self._published[request_id] = HandleWithdrawal(
                    session_id=session_id, hold_token=payload.hold_token,
                    tenant=payload.tenant, engine_url=payload.engine_url,
                    engine_epoch=payload.engine_epoch, ttl_s=lease_s)
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
            if reason == "lease_ended":     # the handle's own expiry says so
                self._published.pop(req_id, None)
            else:
                self._withdraw_handle(req_id, reason)
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
                self._withdraw_handle(req_id, reason)
                logger.debug("sessionkv hold released request_id=%s reason=%s", req_id,
                             reason)

    def end_all(self) -> int:
        """A reset: every hold ends at the next step; returns how many."""
        dropped = self._table.end_all("reset")
        self._to_release.update(dropped)
        for req_id in dropped:
            self._withdraw_handle(req_id, "reset")
        return len(dropped)

    def _withdraw_handle(self, request_id: str, reason: str) -> None:
        """Withdraw the handle of ``request_id``'s hold (once), counted by reason in
        ``sessionkv_handles_withdrawn_total`` at the next ``record_stats``.  Best
        effort, like publication."""
        withdrawal = self._published.pop(request_id, None)
        if withdrawal is None:
            return
        withdrawal = msgspec.structs.replace(withdrawal, reason=reason)
        self._publisher.withdraw(withdrawal)
        if self._channel is not None:
            self._channel.withdraw(withdrawal)
        logger.debug("sessionkv handle withdrawn request_id=%s reason=%s", request_id,
                     reason)
        self._withdrawn_unrecorded[reason] = self._withdrawn_unrecorded.get(reason, 0) + 1

    def record_stats(self, stats: StatsSink) -> None:
        if self._table.sessions != self._reported:
            self._reported = self._table.sessions
            stats.record("session_holds", self._reported)
        for reason, n in self._withdrawn_unrecorded.items():
            stats.record(f"handles_withdrawn_{reason}", n)
        self._withdrawn_unrecorded.clear()
        failures = self._publisher.take_failures()
        if failures:
            stats.record("session_handles_publish_failed", failures)

    def close(self) -> None:
        self._publisher.close()
        if self._channel is not None:
            self._channel.close()
