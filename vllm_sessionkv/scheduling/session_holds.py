"""Session holds on D (``holds.py``): a finished session turn's blocks stay held for
the next turn's pull under a lease (``retention.py``: from the client's hint, the
session's observed gaps, or ``session_lease_s``), a newer turn supersedes an older
one, holds over a share of the KV end least valuable first (``kv_pressure``; oldest
first under ``retention: "age"``), and so do holds in the way of a request D cannot
admit for want of free blocks (``make_room``), each demoted to the host tier first where there is
one (``retention: "value"``), a reset ends them all; the
handle is published out of band (Redis, and the handle channel for proxies without
Redis).  Holds end through the worker, which
releases them in the step they are handed to it.

A hold that ends before its lease (kv_pressure, superseded, reset) has its handle
withdrawn where the proxies find it (``HandleWithdrawal``: Redis and the channel) as
soon as the end is decided, and so has one released for any other reason but its
lease (pulled, NIXL's expiry): a proxy replica that still has the handle (its own
record, the channel's copy) then does not attach it and routes the turn to D alone or
to a host-tier restore, instead of a claim D would refuse.  An ended lease needs
none: the handle's expiry says so.

What the holds keep alone (``record_hold_blocks``, ``sessionkv_session_hold_blocks``):
the blocks ending every hold would free, counted against vLLM's reference counts at
most every ``HOLD_BLOCKS_EVERY_S`` (a count reads each held block), at once when no
hold is left.  The proxy takes them off D's KV usage, so a D full only of holds it
would end on demand still looks free (docs/retention.md)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from vllm_sessionkv.handle_channel import HandleChannel
from vllm_sessionkv.holds import HOLD_BLOCKS_EVERY_S, HoldTable, hold_only_blocks
from vllm_sessionkv.publisher import HandlePublisher
from vllm_sessionkv.retention import (
    GapHistory,
    HoldFacts,
    Lease,
    Retention,
    RetentionParams,
    SessionHistory,
    eviction_order,
)
from vllm_sessionkv.retention import lease as retention_lease
from vllm_sessionkv.scheduling.counters import StatsSink
from vllm_sessionkv.scheduling.guard_ledger import GuardLedger
from vllm_sessionkv.wire.cost import DEFAULT_RECOMPUTE, RecomputeModel
from vllm_sessionkv.wire.protocol import HandleWithdrawal, PayloadError, handle_from_params

__all__ = ["SessionHolds"]

# With no rule given (tests of the table alone): the rule before, one lease, by age.
_AGE = RetentionParams(mode=Retention.AGE)

logger = logging.getLogger("vllm.sessionkv.scheduler")


class SessionHolds:
    def __init__(self, max_held_blocks: int, max_kv_fraction: float,
                 publisher: HandlePublisher, channel: HandleChannel | None = None,
                 withdraw: bool = True, retention: RetentionParams = _AGE,
                 recompute: Callable[[], RecomputeModel] = lambda: DEFAULT_RECOMPUTE,
                 gap_history: int = 8, max_sessions: int = 10000) -> None:
        self._table = HoldTable()
        self._retention = retention
        self._recompute = recompute
        self._gaps = GapHistory(gap_history, max_sessions)
        # What the order needs of each running hold, and how to demote it (by
        # request id); both leave when the hold ends.
        self._facts: dict[str, HoldFacts] = {}
        self._demote: dict[str, Callable[[], bool]] = {}
        self._unrecorded: dict[str, int] = {}   # stats keys counted since record_stats
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
        self._hold_blocks = 0   # sessionkv_session_hold_blocks, sent on change
        self._hold_blocks_at_s = float("-inf")
        # Requests sent early (early decode) waiting here for P's parameters, by
        # request id -> session id: P's pull of the session's hold is on its way.
        self._waiting_turns: dict[str, str] = {}

    def turn_arrived(self, session_id: str, now_s: float) -> None:
        """A turn of ``session_id`` reached this engine: the gap since its last held
        turn ended joins the session's history."""
        self._gaps.turn_arrived(session_id, now_s)

    def turn_waiting(self, session_id: str, request_id: str) -> None:
        """A turn of ``session_id`` waits here for P (early decode): its P will pull
        the session's hold, so the hold ends last under pressure (``retention``)."""
        self._waiting_turns[request_id] = session_id

    def turn_done_waiting(self, request_id: str) -> None:
        """The request got P's parameters, or ended."""
        self._waiting_turns.pop(request_id, None)

    def lease(self, session_id: str, hint_s: float | None) -> tuple[Lease, SessionHistory]:
        """The lease of a hold of ``session_id`` beginning now (``retention.lease``),
        and the history it came from."""
        history = SessionHistory(gaps_s=self._gaps.gaps(session_id), hint_s=hint_s)
        pressure = self._table.held_blocks / max(1, self._max_held_blocks)
        return retention_lease(history, self._retention, pressure), history

    def hold(self, session_id: str, request_id: str, now_s: float, lease_s: float,
             grace_s: float, num_blocks: int, *, facts: HoldFacts | None = None,
             demote: Callable[[], bool] | None = None,
             block_ids: Sequence[int] = ()) -> float:
        """Hold a finished turn's blocks; returns the lease's end (perf_counter).
        Holds over the cap end at the next step, in the retention rule's order
        (``facts`` is what the rule knows of this one); ``demote`` copies this one's
        KV to the host tier when it ends unread (True: it is all there).
        ``block_ids`` (every group's) are what the hold keeps allocated."""
        deadline = now_s + lease_s
        self._table.hold(session_id, request_id, until_s=deadline,
                         superseded_until_s=now_s + grace_s, num_blocks=num_blocks,
                         block_ids=block_ids)
        self._gaps.turn_ended(session_id, now_s)
        if facts is not None:
            self._facts[request_id] = facts
            self._count(f"session_hold_leases_{facts.lease.source.value}")
        if demote is not None and self._retention.mode is Retention.VALUE:
            self._demote[request_id] = demote
        self._end_for_pressure(
            self._table.over_cap(self._max_held_blocks, keep=request_id,
                                 order=self._order(now_s)),
            f"holds over {self._max_kv_fraction * 100:.0f}% of the KV blocks")
        return deadline

    def make_room(self, blocks: int, now_s: float) -> int:
        """End running holds, in the retention rule's order, until they and the holds
        already ending free at least ``blocks`` (all of them if they hold fewer);
        returns how many ended.

        The cap above bounds holds to a share of the KV, so a request that needs more
        than the rest (a long prompt on a small D) would otherwise wait, admitted by
        nothing, until leases run out: minutes under the value rule.  A hold is worth
        a pull later; it must never cost a request now."""
        blocks -= self._table.ending_blocks   # freed within a step or two anyway
        if blocks <= 0:
            return 0
        ended = self._table.over_cap(max(0, self._table.held_blocks - blocks),
                                     order=self._order(now_s))
        self._end_for_pressure(ended, f"a waiting request needs {blocks} more free blocks")
        return len(ended)

    def _end_for_pressure(self, request_ids: list[str], why: str) -> None:
        """End these holds early (``kv_pressure``): released at the next step, their
        handles withdrawn, their KV demoted where it can be."""
        for req_id in request_ids:
            logger.info("sessionkv hold ends early request_id=%s reason=kv_pressure (%s)",
                        req_id, why)
            self._to_release.add(req_id)
            self._withdraw_handle(req_id, "kv_pressure")
            self._ended_unread(req_id, "kv_pressure")

    def _order(self, now_s: float) -> list[str] | None:
        """Running holds, first to end first, by the retention rule; None (the
        table's age order) when a hold has no facts."""
        running = self._table.running()
        if any(rid not in self._facts for rid, _, _ in running):
            return None
        waiting = set(self._waiting_turns.values())
        facts = [dataclasses.replace(self._facts[rid], superseded=superseded,
                                     awaited=session_id in waiting)
                 for rid, session_id, superseded in running]
        ordered = eviction_order(facts, now_s, self._retention, self._recompute())
        if ordered and logger.isEnabledFor(logging.DEBUG):
            logger.debug("sessionkv hold order (first to end first): %s", " ".join(
                f"{v.request_id}:value={v.value:.3g},reuse={v.reuse:.2f}" for v in ordered))
        return [v.request_id for v in ordered]

    def _ended_unread(self, request_id: str, reason: str) -> None:
        """A hold ended unread: demote its KV to the host tier where it can, and count
        where it went (``session_hold_ends_{reason}_{tier}``)."""
        self._facts.pop(request_id, None)
        demote = self._demote.pop(request_id, None)
        tier = "host" if demote is not None and demote() else "dropped"
        self._count(f"session_hold_ends_{reason}_{tier}")
        logger.debug("sessionkv hold ended request_id=%s reason=%s tier=%s", request_id,
                     reason, tier)

    def _count(self, key: str) -> None:
        self._unrecorded[key] = self._unrecorded.get(key, 0) + 1

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
                self._ended_unread(req_id, reason)
            else:
                self._withdraw_handle(req_id, reason)
                self._facts.pop(req_id, None)
                self._demote.pop(req_id, None)
        self._to_release.update(due)
        releases = guard.releasable(self._to_release, now_s)
        self._to_release -= releases
        return releases

    def released(self, request_ids, stats: StatsSink) -> None:
        """The worker reported these sends finished: count the holds among them."""
        for req_id in request_ids:
            reason = self._table.released(req_id)
            self._facts.pop(req_id, None)
            self._demote.pop(req_id, None)
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
        for key, n in self._unrecorded.items():
            stats.record(key, n)
        self._unrecorded.clear()
        failures = self._publisher.take_failures()
        if failures:
            stats.record("session_handles_publish_failed", failures)

    def record_hold_blocks(self, stats: StatsSink, now_s: float,
                           ref_counts: Callable[[Iterable[int]], Mapping[int, int] | None]
                           ) -> None:
        """Count the blocks only holds keep (``holds.hold_only_blocks``) against
        vLLM's reference counts (``ref_counts``: block id -> count, None when vLLM's
        are not known: then none is counted), at most every ``HOLD_BLOCKS_EVERY_S``
        and at once when no hold is left; record ``session_hold_blocks`` on change."""
        holders = self._table.holders
        if holders and now_s - self._hold_blocks_at_s < HOLD_BLOCKS_EVERY_S:
            return
        self._hold_blocks_at_s = now_s
        counts = ref_counts(holders.keys()) if holders else {}
        blocks = hold_only_blocks(holders, counts) if counts is not None else 0
        if blocks != self._hold_blocks:
            self._hold_blocks = blocks
            stats.record("session_hold_blocks", blocks)

    def close(self) -> None:
        self._publisher.close()
        if self._channel is not None:
            self._channel.close()
