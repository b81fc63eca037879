"""The pull guard, holder side: remote KV is read only while its holder keeps it.

A handle (D's end-of-turn parameters, or P's for D) names device blocks.  Their
holder may let them go at any time: a lease ends, a newer turn supersedes the hold,
KV pressure ends the oldest holds, an operator resets the cache, NIXL's own expiry
fires, the engine restarts.  Once vLLM frees the blocks they can hold another
request's KV, and a reader that still trusts the handle attaches the wrong KV
(the hash chain in the handle is honest about what the blocks *held*; it says
nothing about the bytes there now).  So every read of held blocks goes through a
claim, answered by the holder over its NIXL side channel:

1. ``CLAIM`` before the read.  The holder grants it only while the blocks are
   held and no other reader's claim stands; a hold asked to end, a send already
   done, an unknown request or token (another engine, a restart) is refused, and
   the reader recomputes.
2. The read (stock NIXL; its completion notification may end the hold).
3. ``CONFIRM`` after the read completed, before the reader reports the blocks
   received.  ``valid`` only if the claim still stood: while a claim stands the
   holder does not free the blocks (vLLM's free of a finished send is deferred,
   :meth:`SendLedger.gate`), so a valid confirm proves the read saw the bytes the
   handle describes.  A claim lapses after ``claim_ttl_s`` (a reader that died
   must not pin blocks for ever); after that the confirm is ``invalid`` and the
   reader recomputes: a read that lost the race never becomes attached KV, nor a
   prefix-cache hit.

With the content digest (``kv_digest.py``), the confirm also carries the holder's
block ids the read wrote, and a valid answer the holder's digests of them, taken as
the hold began; a confirm that comes before those digests is answered
``DIGEST_PENDING`` with the claim left standing, and the reader asks again.

Correctness rests only on this order (grant, read, confirm, then free), never on
clocks agreeing between engines.  Pure: standard library and msgspec; the caller
passes the clock.  Thread-safe: the side channel answers on its own thread.
"""

from __future__ import annotations

import enum
import secrets
import threading
from dataclasses import dataclass, field

import msgspec

__all__ = [
    "DIGEST_PENDING",
    "GUARD_TAG",
    "GuardAnswer",
    "GuardCall",
    "GuardOp",
    "SendLedger",
    "decode_answer",
    "decode_call",
    "encode_answer",
    "encode_call",
    "new_hold_token",
]

# First element of every guard message on the side channel (NIXL's own handshake
# messages start with its GET_META_MSG).
GUARD_TAG = "sessionkv.guard"


class GuardOp(str, enum.Enum):
    CLAIM = "claim"
    CONFIRM = "confirm"   # after the read: was the claim still standing?
    RELEASE = "release"   # the reader gave up (timeout, failed read): drop its claim


class GuardCall(msgspec.Struct, array_like=True, tag=GUARD_TAG, frozen=True):
    """A reader's message to a holder's side channel."""

    op: GuardOp
    engine_id: str       # the holder the handle names (a restarted engine has another)
    request_id: str      # the holder's request whose blocks are held
    token: int           # the hold's token, from the handle
    reader: str          # who reads: one reader request (all its workers share it)
    member: str          # which worker of that reader (tensor-parallel rank)
    seq: int             # echoed in the answer
    # CONFIRM only: the holder's blocks the read wrote, whose digests the reader
    # checks its own against (kv_digest.py); empty: no digest wanted.
    blocks: tuple[int, ...] = ()


class GuardAnswer(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    ok: bool
    reason: str = ""     # why not: gone, ending, claimed, lapsed, wrong_engine, ...
    # A valid CONFIRM's answer: the digests of the call's blocks as the holder took
    # them when the hold began, in the call's order; None when the holder has none
    # for that reader's rank (its digest is off, or the ranks' layouts differ).
    digests: tuple[int, ...] | None = None


# A CONFIRM answered with this reason was neither valid nor refused: the holder's
# digests of the hold have not reached its ledger yet (its worker takes them the step
# after the request finished).  The claim still stands; the reader asks again.
DIGEST_PENDING = "digest_pending"


_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(GuardCall)
_answer_decoder = msgspec.msgpack.Decoder(GuardAnswer)


def encode_call(call: GuardCall) -> bytes:
    return _encoder.encode(call)


def decode_call(raw: bytes) -> GuardCall | None:
    """The guard call in a side-channel message, or None for any other message
    (NIXL's handshake) or a malformed one."""
    try:
        return _call_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def encode_answer(answer: GuardAnswer) -> bytes:
    return _encoder.encode(answer)


def decode_answer(raw: bytes) -> GuardAnswer | None:
    try:
        return _answer_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def new_hold_token() -> int:
    """A fresh token for one hold: a claim must name it, so a handle of another
    engine or of an earlier life of this one is never granted."""
    return secrets.randbits(62) + 1


@dataclass
class _Held:
    token: int
    reader: str | None = None              # the reader whose claim stands
    members: dict[str, float] = field(default_factory=dict)   # worker -> claim end
    ending: bool = False                   # asked to end: no new claims
    sent: bool = False                     # its send is done, the free deferred
    freeing: bool = False                  # handed back for vLLM to free
    # Per worker rank, block id -> digest, taken when the hold began (kv_digest.py).
    digests: dict[str, dict[int, int]] | None = None

    def claim_live(self, now_s: float) -> bool:
        return any(until > now_s for until in self.members.values())


class SendLedger:
    """Every finished request whose blocks this engine holds for a peer's read, and
    the claims on them.  Added when vLLM delays the free (``add``), removed when the
    free goes through (``gate``)."""

    def __init__(self, engine_id: str, claim_ttl_s: float, digests: bool = False) -> None:
        self.engine_id = engine_id
        self.claim_ttl_s = claim_ttl_s
        # This engine's workers digest every hold (kv_digest.py): a confirm that
        # asks for digests not yet here waits for them (DIGEST_PENDING).
        self.digests = digests
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self.claims_granted = 0
        self.claims_refused = 0
        self.frees_deferred = 0

    def __len__(self) -> int:
        return len(self._held)

    def add(self, request_id: str, token: int) -> None:
        with self._lock:
            self._held[request_id] = _Held(token=token)

    def set_digests(self, request_id: str, digests: dict[str, dict[int, int]]) -> None:
        """The workers' digests of a hold's blocks (per rank), taken as it began."""
        with self._lock:
            held = self._held.get(request_id)
            if held is not None:
                held.digests = digests

    def answer(self, call: GuardCall, now_s: float) -> GuardAnswer:
        """The side channel's answer to one call."""
        with self._lock:
            reason = self._answer(call, now_s)
            digests = (self._digests(call) if call.op is GuardOp.CONFIRM and not reason
                       and call.blocks else None)
        if call.op is GuardOp.CLAIM:
            if reason:
                self.claims_refused += 1
            else:
                self.claims_granted += 1
        return GuardAnswer(seq=call.seq, ok=not reason, reason=reason, digests=digests)

    def _digests(self, call: GuardCall) -> tuple[int, ...] | None:
        held = self._held.get(call.request_id)
        mine = (held.digests or {}).get(call.member) if held is not None else None
        if mine is None or any(b not in mine for b in call.blocks):
            return None
        return tuple(mine[b] for b in call.blocks)

    def _answer(self, call: GuardCall, now_s: float) -> str:
        if call.engine_id != self.engine_id:
            return "wrong_engine"
        held = self._held.get(call.request_id)
        if held is None or held.token != call.token:
            return "gone"
        if call.op is GuardOp.CLAIM:
            if held.ending or held.sent or held.freeing:
                return "ending"
            if held.reader not in (None, call.reader) and held.claim_live(now_s):
                return "claimed"
            if held.reader != call.reader:
                held.members = {}
            held.reader = call.reader
            held.members[call.member] = now_s + self.claim_ttl_s
            return ""
        if (call.op is GuardOp.CONFIRM and call.blocks and self.digests
                and held.digests is None and held.reader == call.reader
                and held.members.get(call.member, 0.0) > now_s):
            return DIGEST_PENDING   # the claim stands until the digests are here
        # CONFIRM or RELEASE: the member's claim ends either way.
        until = held.members.pop(call.member, None) if held.reader == call.reader else None
        if not held.members:
            held.reader = None
        if until is None:
            return "not_claimed"
        if until <= now_s:
            return "lapsed"
        return ""

    def claimed(self, request_id: str, now_s: float) -> bool:
        """Whether a reader's claim on the request stands (its hold must not end yet)."""
        with self._lock:
            held = self._held.get(request_id)
            return held is not None and held.claim_live(now_s)

    def mark_ending(self, request_ids) -> None:
        """The holder decided to let these go: refuse new claims on them."""
        with self._lock:
            for request_id in request_ids:
                held = self._held.get(request_id)
                if held is not None:
                    held.ending = True

    def gate(self, finished_sending, now_s: float) -> set[str]:
        """Of the sends vLLM is about to free, those it may free now; the others (a
        claim stands on them) are deferred until :meth:`take_releasable` hands them
        back.  Requests this ledger does not know pass through."""
        out = set()
        with self._lock:
            for request_id in finished_sending:
                held = self._held.get(request_id)
                if held is not None and held.claim_live(now_s):
                    if not held.sent:
                        held.sent = True
                        self.frees_deferred += 1
                    continue
                self._held.pop(request_id, None)
                out.add(request_id)
        return out

    def take_releasable(self, now_s: float) -> set[str]:
        """Deferred frees whose claims have ended (confirmed, released or lapsed):
        each is returned once, to be reported sent again and then freed."""
        out = set()
        with self._lock:
            for request_id, held in self._held.items():
                if held.sent and not held.freeing and not held.claim_live(now_s):
                    held.freeing = True
                    out.add(request_id)
        return out
