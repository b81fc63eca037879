"""The pull guard, reader side: claim before a read, confirm after it.

See ``guard.py`` for the protocol.  The worker owns one :class:`ReadGuard`.  Every
call is non-blocking: messages go out on one ZMQ DEALER per holder side channel,
answers are collected by :meth:`ReadGuard.poll` (the worker calls it each step, and
in a synchronous load's wait), and a call unanswered within ``timeout_s`` counts as
refused.  Nothing here touches vLLM: the worker passes request ids, the holder's
address and the blocks a read writes, and acts on what :meth:`poll` returns.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import zmq

from vllm_sessionkv.guard import (
    DIGEST_PENDING,
    GuardCall,
    GuardOp,
    decode_answer,
    encode_call,
)

__all__ = ["GuardedRead", "GuardPoll", "ReadGuard"]

logger = logging.getLogger("vllm.sessionkv.read_guard")

# Tokens of reads the scheduler asked to guard whose read never came (aborted
# requests): the oldest are dropped past this many.
_MAX_EXPECTED = 1 << 16
# A confirm answered DIGEST_PENDING: the holder digests a hold at the end of its next
# engine step, which on a real model under load can outlast ``timeout_s``.  Each
# pending answer (the holder is alive, the claim stands) moves the confirm's deadline
# ``timeout_s`` on, up to ``digest_wait_s`` after the confirm was first sent (the
# claim's own life on the holder): recomputing a whole prompt costs far more than
# waiting out one holder step.  It is asked again after a tenth of the time waited so
# far, within the bounds below: every 2 ms for a digest due in milliseconds (the usual
# case), adding at most a tenth to the wait; every 100 ms for one seconds away.
_DIGEST_REASK_S = 2e-3
_DIGEST_REASK_MAX_S = 0.1
_DIGEST_REASK_SHARE = 0.1


@dataclass(frozen=True)
class GuardedRead:
    """One read of held blocks: whose, where to ask, and what it writes here."""

    request_id: str          # this engine's request
    holder_engine_id: str
    holder_request_id: str
    token: int
    host: str
    port: int
    local_blocks: frozenset[int]
    # (local block, holder's block) in read order, for the content digest
    # (kv_digest.py); empty: the read is not digested.
    digest_pairs: tuple[tuple[int, int], ...] = ()


@dataclass
class GuardPoll:
    """What changed since the last poll."""

    granted: list[str] = field(default_factory=list)          # post these reads now
    refused: list[tuple[str, str]] = field(default_factory=list)   # (request, reason)
    confirmed: list[str] = field(default_factory=list)        # report received
    refuted: list[tuple[GuardedRead, str]] = field(default_factory=list)   # recompute
    # Content digest checks of confirmed reads: matched, mismatched (refuted with
    # reason "digest_mismatch"), unchecked (the holder had no digests to give).
    digest_checks: list[str] = field(default_factory=list)


@dataclass
class _Pending:
    read: GuardedRead
    op: GuardOp
    deadline_s: float
    digests: tuple[int, ...] | None = None   # CONFIRM: the reader's, to compare
    give_up_s: float = 0.0        # CONFIRM: the latest a pending digest moves it to
    first_sent_s: float = 0.0     # CONFIRM: when it was first asked


class ReadGuard:
    def __init__(self, reader_engine_id: str, member: str, timeout_s: float,
                 context: zmq.Context | None = None,
                 digest_wait_s: float | None = None) -> None:
        self.reader_engine_id = reader_engine_id
        self.member = member
        self.timeout_s = timeout_s
        self.digest_wait_s = timeout_s if digest_wait_s is None else max(
            timeout_s, digest_wait_s)
        self._context = context or zmq.Context()
        self._owns_context = context is None
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}
        self._seq = itertools.count(1)
        self._expected: dict[str, int] = {}        # request id -> hold token
        self._pending: dict[int, _Pending] = {}    # seq -> call awaiting its answer
        self._granted: dict[str, GuardedRead] = {}   # claimed; read posted or to post
        self._confirming: set[str] = set()
        self._reask: list[tuple[float, _Pending]] = []   # (due, confirm) digest pending

    # -------------------------------------------------------------- requests
    def expect(self, tokens: dict[str, int]) -> None:
        """The scheduler's reads to guard this step: request id -> hold token."""
        self._expected.update(tokens)
        while len(self._expected) > _MAX_EXPECTED:
            del self._expected[next(iter(self._expected))]

    def token(self, request_id: str) -> int | None:
        return self._expected.get(request_id)

    def is_granted(self, request_id: str) -> bool:
        return request_id in self._granted

    def granted_read(self, request_id: str) -> GuardedRead | None:
        return self._granted.get(request_id)

    def claim(self, read: GuardedRead, now_s: float) -> None:
        """Ask the holder for the blocks; the read waits for :meth:`poll`'s grant."""
        self._expected.pop(read.request_id, None)
        self._send(read, GuardOp.CLAIM, now_s)

    def confirm(self, request_id: str, now_s: float,
                digests: tuple[int, ...] | None = None) -> None:
        """The read completed: ask whether the claim stood throughout, and, with
        ``digests`` (of the read's ``digest_pairs``' local blocks), for the holder's
        digests of the same blocks, to compare."""
        read = self._granted.get(request_id)
        if read is not None and request_id not in self._confirming:
            self._confirming.add(request_id)
            self._send(read, GuardOp.CONFIRM, now_s, digests=digests)

    def release(self, request_id: str, now_s: float) -> None:
        """The read failed or was given up: drop the claim so the holder frees sooner."""
        self._expected.pop(request_id, None)
        read = self._granted.pop(request_id, None)
        self._confirming.discard(request_id)
        if read is not None:
            self._send(read, GuardOp.RELEASE, now_s, await_answer=False)

    def confirming(self, request_id: str) -> bool:
        return request_id in self._confirming

    # -------------------------------------------------------------- answers
    def poll(self, now_s: float) -> GuardPoll:
        out = GuardPoll()
        due = [p for when, p in self._reask if when <= now_s]
        self._reask = [(when, p) for when, p in self._reask if when > now_s]
        for pending in due:
            if pending.read.request_id not in self._confirming:
                continue   # released meanwhile
            self._send(pending.read, GuardOp.CONFIRM, now_s, digests=pending.digests,
                       deadline_s=pending.deadline_s, give_up_s=pending.give_up_s,
                       first_sent_s=pending.first_sent_s)
        for sock in self._sockets.values():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                answer = decode_answer(frames[-1])
                pending = self._pending.pop(answer.seq, None) if answer else None
                if pending is not None:
                    self._settle(pending, answer.ok, answer.reason, out, now_s,
                                 answer.digests)
        for seq in [s for s, p in self._pending.items() if p.deadline_s <= now_s]:
            self._settle(self._pending.pop(seq), False, "timeout", out, now_s)
        return out

    def _settle(self, pending: _Pending, ok: bool, reason: str, out: GuardPoll,
                now_s: float, answer_digests: tuple[int, ...] | None = None) -> None:
        read = pending.read
        if pending.op is GuardOp.CLAIM:
            if ok:
                self._granted[read.request_id] = read
                out.granted.append(read.request_id)
            else:
                if reason == "timeout":
                    # It may have been granted after all: do not pin it until it lapses.
                    self._send(read, GuardOp.RELEASE, now_s, await_answer=False)
                out.refused.append((read.request_id, reason))
            return
        if reason == DIGEST_PENDING:
            if now_s < pending.give_up_s:
                pending.deadline_s = min(pending.give_up_s, now_s + self.timeout_s)
                waited = now_s - pending.first_sent_s
                self._reask.append((now_s + min(_DIGEST_REASK_MAX_S, max(
                    _DIGEST_REASK_S, _DIGEST_REASK_SHARE * waited)), pending))
                return
            reason = "timeout"
        self._granted.pop(read.request_id, None)
        self._confirming.discard(read.request_id)
        if ok and pending.digests is not None:
            check = ("unchecked" if answer_digests is None else
                     "matched" if tuple(answer_digests) == pending.digests else "mismatched")
            out.digest_checks.append(check)
            if check == "mismatched":
                ok, reason = False, "digest_mismatch"
        if ok:
            out.confirmed.append(read.request_id)
        else:
            if reason == "timeout":
                # The read is done and will not be used: end the claim now rather
                # than pin the holder's blocks until it lapses.
                self._send(read, GuardOp.RELEASE, now_s, await_answer=False)
            out.refuted.append((read, reason))

    def _send(self, read: GuardedRead, op: GuardOp, now_s: float,
              await_answer: bool = True, digests: tuple[int, ...] | None = None,
              deadline_s: float | None = None, give_up_s: float | None = None,
              first_sent_s: float | None = None) -> None:
        seq = next(self._seq)
        blocks = (tuple(remote for _, remote in read.digest_pairs)
                  if digests is not None else ())
        call = GuardCall(op=op, engine_id=read.holder_engine_id,
                         request_id=read.holder_request_id, token=read.token,
                         reader=f"{self.reader_engine_id}/{read.request_id}",
                         member=self.member, seq=seq, blocks=blocks)
        if await_answer:
            self._pending[seq] = _Pending(
                read=read, op=op, digests=digests,
                deadline_s=now_s + self.timeout_s if deadline_s is None else deadline_s,
                give_up_s=now_s + self.digest_wait_s if give_up_s is None else give_up_s,
                first_sent_s=now_s if first_sent_s is None else first_sent_s)
        try:
            self._socket(read.host, read.port).send_multipart(
                (b"", encode_call(call)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # The answer never comes; the deadline turns it into a refusal.
            logger.warning("sessionkv guard: %s to %s:%d not sent: %s", op.value,
                           read.host, read.port, exc)

    def _socket(self, host: str, port: int) -> zmq.Socket:
        sock = self._sockets.get((host, port))
        if sock is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # Queue while connecting, up to a bound; a holder that never answers is
            # a timeout, not a blocked worker.
            sock.setsockopt(zmq.SNDHWM, 10_000)
            host_part = f"[{host}]" if ":" in host else host
            sock.connect(f"tcp://{host_part}:{port}")
            self._sockets[(host, port)] = sock
        return sock

    @property
    def waiting(self) -> bool:
        """Calls still awaiting an answer (or to be asked again)."""
        return bool(self._pending or self._reask)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        if self._owns_context:
            self._context.term()
