"""The pull guard in the scheduler half (``guard.py``, ``docs/kv_lifetimes.md``).

As holder: every finished request whose blocks wait for a peer's read, with the
readers' claims (answered on NIXL's side channel), the sends a claim keeps from
being freed, and the holds a claim keeps from ending.  As reader: the hold tokens of
this step's reads, for the worker to claim before it reads.  Off (``pull_guard``
false): no tokens, nothing gated, nothing deferred.

The content digest (``kv_digest.py``): each hold's blocks go to the worker with the
next step's instructions; the digests it takes come back in its ``WorkerReport``
(vLLM's worker metadata) and stay with the hold, for the confirms' answers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from vllm_sessionkv.guard import (
    DIGEST_PENDING,
    SendLedger,
    decode_call,
    encode_answer,
    new_hold_token,
)
from vllm_sessionkv.scheduling.counters import StatsSink, record_growth

__all__ = ["GuardLedger"]

logger = logging.getLogger("vllm.sessionkv.scheduler")

_TOTALS = ("guard_claims_granted", "guard_claims_refused", "guard_frees_deferred")


class GuardLedger:
    def __init__(self, engine_id: str, enabled: bool, claim_ttl_s: float,
                 new_token: Callable[[], int] = new_hold_token,
                 digests: bool = False) -> None:
        self._ledger = SendLedger(engine_id, claim_ttl_s, digests) if enabled else None
        self._new_token = new_token
        self._reads_next: dict[str, int] = {}
        self._holds_started: dict[str, list[int]] = {}
        self._counted = (0, 0, 0)

    @property
    def enabled(self) -> bool:
        return self._ledger is not None

    # ------------------------------------------------------------------ holder
    def answer(self, raw: bytes, now_s: float) -> bytes | None:
        """The side channel's answer to a guard call (None: not one; NIXL's own)."""
        call = decode_call(raw)
        if call is None or self._ledger is None:
            return None
        answer = self._ledger.answer(call, now_s)
        if not answer.ok:
            # A pending digest is no refusal: the reader asks again (read_guard.py),
            # every few milliseconds at first.
            log = logger.debug if answer.reason == DIGEST_PENDING else logger.info
            log("sessionkv guard %s refused request_id=%s reader=%s reason=%s",
                call.op.value, call.request_id, call.reader, answer.reason)
        return encode_answer(answer)

    def hold_token(self, request_id: str, block_ids: list[int]) -> int:
        """A token for the blocks this finished request leaves held for a peer's
        read (``block_ids``, as its handle names them), registered with the ledger
        (0 with the guard off)."""
        if self._ledger is None:
            return 0
        token = self._new_token()
        self._ledger.add(request_id, token)
        self._holds_started[request_id] = list(block_ids)
        return token

    def has_holds_started(self) -> bool:
        """Whether holds began that the next step has to tell the worker of."""
        return bool(self._holds_started)

    def take_holds_started(self) -> dict[str, list[int]]:
        """Holds that began since the last step, with their blocks: for the worker to
        digest (and, in tests only, to corrupt after; ``kv_digest.py``)."""
        started, self._holds_started = self._holds_started, {}
        return started

    def digested(self, held_digests: dict[str, dict[str, dict[int, int]]]) -> None:
        """The workers' digests of holds (``WorkerReport.held_digests``: request id ->
        worker -> block id -> digest), into the ledger."""
        if self._ledger is not None:
            for request_id, ranks in held_digests.items():
                self._ledger.set_digests(request_id, ranks)

    def gate(self, finished_sending: Collection[str], now_s: float) -> set[str] | None:
        """The sends vLLM may free now, or None when it may free them all: those a
        reader's claim stands on wait, and the worker reports them again later."""
        if self._ledger is None or not finished_sending:
            return None
        free_now = self._ledger.gate(finished_sending, now_s)
        return free_now if len(free_now) != len(finished_sending) else None

    def releasable(self, ending: set[str], now_s: float) -> set[str]:
        """Of the holds ``ending``, those no claim stands on (no new claims on any)."""
        if self._ledger is None:
            return set(ending)
        self._ledger.mark_ending(ending)
        return {r for r in ending if not self._ledger.claimed(r, now_s)}

    def take_sent(self, now_s: float) -> set[str]:
        """Deferred sends whose claims ended: for the worker to report again."""
        return self._ledger.take_releasable(now_s) if self._ledger is not None else set()

    def record_totals(self, stats: StatsSink) -> None:
        if self._ledger is not None:
            self._counted = record_growth(
                stats, _TOTALS, (self._ledger.claims_granted, self._ledger.claims_refused,
                                 self._ledger.frees_deferred), self._counted)

    # ------------------------------------------------------------------ reader
    def read_next_step(self, request_id: str, token: int) -> None:
        """A read of a guarded handle starts next step: the worker claims it first."""
        if token and self._ledger is not None:
            self._reads_next[request_id] = token

    def take_reads(self) -> dict[str, int]:
        reads, self._reads_next = self._reads_next, {}
        return reads

