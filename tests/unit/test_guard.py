"""The pull guard: the holder's ledger, its wire, and the reader over real ZMQ.

The property test is a discrete-event simulation of one holder on the connector's
default clocks: sessions publish handles, readers claim, read and confirm them
(including handles whose blocks were already freed and reused but which stay
published), holds end early (kv_pressure, superseded, lease, reset), NIXL
notifications and expiries arrive, claims lapse under stalled reads, and other
requests overwrite freed blocks.  It checks the one promise: a confirm is granted
only to a read that saw the held bytes from start to end, and no claim is granted
on a request already freed.  Two broken ledgers must break it: one that never
defers a free, and one that frees without forgetting the request.
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import random
import time
from dataclasses import dataclass, field

import pytest

from vllm_sessionkv.guard import (
    GuardAnswer,
    GuardCall,
    GuardOp,
    SendLedger,
    decode_answer,
    decode_call,
    encode_answer,
    encode_call,
)
from vllm_sessionkv.config import SessionKVConfig
from vllm_sessionkv.read_guard import GuardedRead, ReadGuard


def _call(op, request_id="x", token=7, reader="p/r1", member="tp0", engine="D", seq=1):
    return GuardCall(op=op, engine_id=engine, request_id=request_id, token=token,
                     reader=reader, member=member, seq=seq)


def test_wire_round_trip_and_foreign_messages():
    call = _call(GuardOp.CLAIM)
    assert decode_call(encode_call(call)) == call
    assert decode_answer(encode_answer(GuardAnswer(seq=3, ok=False, reason="gone"))) == \
        GuardAnswer(seq=3, ok=False, reason="gone")
    import msgspec
    # NIXL's own handshake message on the same channel is not ours.
    assert decode_call(msgspec.msgpack.encode((b"get_meta_msg", 0, 0))) is None
    assert decode_call(b"\xff garbage") is None


def test_claim_read_confirm_defers_the_free_until_the_confirm():
    ledger = SendLedger("D", claim_ttl_s=10.0)
    ledger.add("x", 7)
    assert ledger.answer(_call(GuardOp.CLAIM), 0.0).ok
    # The read's NIXL notification ends the send: the free waits for the confirm.
    assert ledger.gate({"x"}, 1.0) == set()
    assert ledger.take_releasable(1.0) == set()
    assert ledger.answer(_call(GuardOp.CONFIRM, seq=2), 2.0) == GuardAnswer(seq=2, ok=True)
    assert ledger.take_releasable(2.0) == {"x"}
    assert ledger.take_releasable(2.0) == set()         # handed back once
    assert ledger.gate({"x"}, 2.1) == {"x"} and len(ledger) == 0


def test_refusals():
    ledger = SendLedger("D", claim_ttl_s=10.0)
    ledger.add("x", 7)
    assert ledger.answer(_call(GuardOp.CLAIM, engine="other"), 0).reason == "wrong_engine"
    assert ledger.answer(_call(GuardOp.CLAIM, token=8), 0).reason == "gone"
    assert ledger.answer(_call(GuardOp.CLAIM, request_id="y"), 0).reason == "gone"
    assert ledger.answer(_call(GuardOp.CLAIM), 0).ok
    # Another reader while the claim stands; the same reader's other worker is fine.
    assert ledger.answer(_call(GuardOp.CLAIM, reader="p/r2"), 1).reason == "claimed"
    assert ledger.answer(_call(GuardOp.CLAIM, member="tp1"), 1).ok
    ledger.mark_ending({"x"})
    assert ledger.answer(_call(GuardOp.CLAIM, reader="p/r3"), 1).reason == "ending"
    # A confirm from a reader that never claimed.
    assert ledger.answer(_call(GuardOp.CONFIRM, reader="p/r2"), 2).reason == "not_claimed"
    assert ledger.claims_granted == 2 and ledger.claims_refused == 5


def test_a_lapsed_claim_is_refused_at_confirm_and_frees():
    ledger = SendLedger("D", claim_ttl_s=5.0)
    ledger.add("x", 7)
    assert ledger.answer(_call(GuardOp.CLAIM), 0.0).ok
    assert ledger.claimed("x", 4.9) and not ledger.claimed("x", 5.0)
    assert ledger.gate({"x"}, 1.0) == set()
    assert ledger.take_releasable(5.0) == {"x"}
    assert ledger.gate({"x"}, 5.0) == {"x"}
    assert ledger.answer(_call(GuardOp.CONFIRM, seq=9), 6.0) == \
        GuardAnswer(seq=9, ok=False, reason="gone")


def test_a_new_reader_may_claim_after_a_lapse_and_the_old_confirm_is_refused():
    ledger = SendLedger("D", claim_ttl_s=5.0)
    ledger.add("x", 7)
    assert ledger.answer(_call(GuardOp.CLAIM), 0.0).ok
    assert ledger.answer(_call(GuardOp.CLAIM, reader="p/r2"), 6.0).ok
    assert ledger.answer(_call(GuardOp.CONFIRM), 7.0).reason == "not_claimed"
    assert ledger.answer(_call(GuardOp.CONFIRM, reader="p/r2"), 7.0).ok


def test_unknown_sends_pass_the_gate():
    ledger = SendLedger("D", claim_ttl_s=5.0)
    ledger.add("x", 7)
    assert ledger.gate({"x", "stock-send"}, 0.0) == {"x", "stock-send"}
    assert len(ledger) == 0


# ----------------------------------------------------------------- property test
# One holder engine, its sessions' holds and their published handles, readers that
# claim, read and confirm, and other requests that reuse freed blocks, as a
# discrete-event simulation on the connector's default clocks (config.py): a claim
# stands for pull_claim_ttl_s, a hold for session_lease_s, a superseded hold ends
# superseded_hold_grace_s after the newer turn, NIXL's expiry backstop fires 5 s
# after the lease.  A read takes milliseconds; a few stall past the claim's TTL (a
# reader engine stuck in a long step), so claims lapse.  A handle stays published
# (the answer, the proxy's record, Redis) until its lease would end and a while
# after (readers' clocks are not the holder's), whatever the holder did with its
# blocks: readers keep claiming handles whose blocks were freed and reused (issue
# 37's case).  The promise checked: no confirm is granted to a read that saw bytes
# other than the held ones, and no claim is granted on a request already freed.
_DEFAULTS = SessionKVConfig()
CLAIM_TTL_S = _DEFAULTS.pull_claim_ttl_s                # 60 s
LEASE_S = _DEFAULTS.session_lease_s                     # 120 s
GRACE_S = _DEFAULTS.superseded_hold_grace_s             # 10 s
GUARD_TIMEOUT_S = _DEFAULTS.pull_guard_timeout_s        # 5 s
EXPIRY_S = LEASE_S + 5.0    # NIXL's expiry of a held send (scheduler.py's 5 s backstop)
PUBLISHED_S = LEASE_S + CLAIM_TTL_S    # how long readers may still claim a handle
NUM_BLOCKS = 128
HOLD_CAP = int(NUM_BLOCKS * _DEFAULTS.session_hold_max_kv_fraction)
SESSIONS = 12
SIM_S = 900.0


@dataclass
class _Tally:
    claims: int = 0
    granted: int = 0
    refused: collections.Counter = field(default_factory=collections.Counter)
    claims_on_freed: int = 0          # claims naming a handle whose blocks were freed
    granted_on_freed: int = 0         # violation: a grant on a freed request
    reads: int = 0
    torn_reads: int = 0               # reads that saw other bytes
    confirms_valid: int = 0
    confirms_refused: collections.Counter = field(default_factory=collections.Counter)
    bad_confirms: int = 0             # violation: a valid confirm of a torn read
    lapses_possible: int = 0          # confirms sent after the claim's TTL

    @property
    def violations(self) -> int:
        return self.bad_confirms + self.granted_on_freed

    def __add__(self, other: "_Tally") -> "_Tally":
        out = _Tally()
        for name in self.__dataclass_fields__:
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def __str__(self) -> str:
        return (f"violations {self.violations} (valid confirms of torn reads "
                f"{self.bad_confirms}, grants on freed requests {self.granted_on_freed}); "
                f"claims {self.claims} ({self.claims_on_freed} on freed-but-published "
                f"handles), granted {self.granted}, refused {dict(self.refused)}; reads "
                f"{self.reads} ({self.torn_reads} torn); confirms valid "
                f"{self.confirms_valid}, refused {dict(self.confirms_refused)}; confirms "
                f"after the TTL {self.lapses_possible}")


@dataclass
class _Handle:
    request_id: str
    token: int
    session: int
    published_s: float
    versions: dict[int, int]          # block -> version the handle describes


class _Sim:
    """The holder (blocks, ledger, a scheduler whose steps act on the ledger), its
    published handles, readers and other traffic, driven by a clock-ordered queue."""

    def __init__(self, ledger: SendLedger, seed: int) -> None:
        self.ledger = ledger
        self.rng = random.Random(seed)
        self.tally = _Tally()
        self.queue: list = []
        self.seq = itertools.count()
        self.version = dict.fromkeys(range(NUM_BLOCKS), 0)   # bumped on every write
        self.free_blocks = list(range(NUM_BLOCKS))
        self.allocated: dict[str, list[int]] = {}            # held, not yet freed
        self.holds: list[str] = []                           # held, oldest first
        self.ending: set[str] = set()                        # asked to end
        self.published: list[_Handle] = []
        self.latest: dict[int, _Handle] = {}                 # session -> newest handle
        self.next_id = itertools.count()
        self.step_at: float | None = None

    # ------------------------------------------------------------- machinery
    def at(self, when: float, action, *args) -> None:
        heapq.heappush(self.queue, (when, next(self.seq), action, args))

    def run(self) -> _Tally:
        for session in range(SESSIONS):
            self.at(self.rng.uniform(0, 10), self.turn, session)
        self.at(self.rng.expovariate(1 / 300), self.reset)
        self.at(self.rng.expovariate(1 / 2), self.stray_reader)
        self.at(0.05, self.other_traffic)
        while self.queue:
            now, _, action, args = heapq.heappop(self.queue)
            if now > SIM_S:
                break
            action(now, *args)
        return self.tally

    def lat(self) -> float:
        """One message's way between engines."""
        return self.rng.uniform(1e-4, 1e-3)

    def holder_step(self) -> float:
        """Until the holder's worker sees a notification (its next step)."""
        return self.lat() + self.rng.uniform(1e-3, 0.03)

    def kick(self, now: float, delay: float | None = None) -> None:
        """The holder's scheduler steps soon (an engine step is milliseconds)."""
        when = now + (delay if delay is not None else self.rng.uniform(1e-3, 0.05))
        if self.step_at is None or when < self.step_at:
            self.step_at = when
            self.at(when, self.step)

    # ---------------------------------------------------------------- holder
    def write(self, blocks) -> None:
        for b in blocks:
            self.version[b] += 1

    def turn(self, now: float, session: int) -> None:
        """A session turn's next request: P reads the newest handle (if any), and the
        turn then ends on D, which holds its blocks and publishes a new handle."""
        handle = self.latest.get(session)
        if handle is not None:
            if self.rng.random() < 0.1:
                # P recomputes instead (priced or verified out): its notify-only
                # "not needed" ends the hold, with no claim.
                self.at(now + self.holder_step(), self.report_sent, handle.request_id)
            else:
                self.claim(now, handle)
        self.at(now + self.rng.uniform(0.5, 3.0), self.publish, session)

    def publish(self, now: float, session: int) -> None:
        size = self.rng.randint(3, 8)
        if len(self.free_blocks) >= size:
            request_id = f"h{next(self.next_id)}"
            blocks = [self.free_blocks.pop(self.rng.randrange(len(self.free_blocks)))
                      for _ in range(size)]
            self.write(blocks)
            self.allocated[request_id] = blocks
            self.holds.append(request_id)
            token = self.rng.getrandbits(62) + 1
            self.ledger.add(request_id, token)
            handle = _Handle(request_id, token, session, now,
                             {b: self.version[b] for b in blocks})
            self.published.append(handle)
            previous = self.latest.get(session)
            self.latest[session] = handle
            if previous is not None:
                self.at(now + GRACE_S, self.end_hold, previous.request_id)  # superseded
            self.at(now + LEASE_S, self.end_hold, request_id)               # lease
            self.at(now + EXPIRY_S, self.report_sent, request_id)           # NIXL expiry
            self.pressure(now)
        # The client thinks, mostly briefly; now and then past the lease.
        think = (self.rng.uniform(LEASE_S, 3 * LEASE_S) if self.rng.random() < 0.1
                 else self.rng.expovariate(1 / 15))
        self.at(now + think, self.turn, session)

    def pressure(self, now: float) -> None:
        """kv_pressure: the oldest holds not yet ending end while holds pin too much."""
        live = [r for r in self.holds if r not in self.ending]
        pinned = sum(len(self.allocated[r]) for r in self.holds)
        while live and pinned > HOLD_CAP:
            victim = live.pop(0)
            self.end_hold(now, victim)
            pinned -= len(self.allocated[victim])

    def end_hold(self, now: float, request_id: str) -> None:
        if request_id in self.allocated and request_id not in self.ending:
            self.ending.add(request_id)
            self.ledger.mark_ending({request_id})
            self.kick(now)

    def reset(self, now: float) -> None:
        for request_id in list(self.allocated):
            self.end_hold(now, request_id)
        self.at(now + self.rng.expovariate(1 / 300), self.reset)

    def report_sent(self, now: float, request_id: str) -> None:
        """The holder's worker reports the send done (a read's notification, NIXL's
        expiry, a notify-only reader, our release of an ended hold)."""
        if request_id not in self.allocated:
            return
        for freed in self.ledger.gate({request_id}, now):
            self.free(freed)
        self.kick(now, CLAIM_TTL_S)

    def step(self, now: float) -> None:
        if self.step_at is not None and now < self.step_at:
            return
        self.step_at = None
        for request_id in [r for r in self.ending if not self.ledger.claimed(r, now)]:
            self.ending.discard(request_id)
            self.report_sent(now, request_id)
        for request_id in self.ledger.take_releasable(now):
            for freed in self.ledger.gate({request_id}, now):
                self.free(freed)
        if self.ending:
            self.kick(now, self.rng.uniform(0.5, 5.0))

    def free(self, request_id: str) -> None:
        blocks = self.allocated.pop(request_id, None)
        if blocks is None:
            return
        self.holds.remove(request_id)
        self.ending.discard(request_id)
        self.free_blocks.extend(blocks)

    def other_traffic(self, now: float) -> None:
        """Requests of no session allocate some free blocks and write them."""
        self.write(self.rng.sample(self.free_blocks, min(self.rng.randint(1, 8),
                                                         len(self.free_blocks))))
        self.at(now + self.rng.expovariate(1 / 0.05), self.other_traffic)

    # ---------------------------------------------------------------- readers
    def stray_reader(self, now: float) -> None:
        """A read of any handle still published: a retried hand-off, a proxy replica
        with an older record, a client that edited its history back."""
        live = [h for h in self.published if now - h.published_s < PUBLISHED_S]
        self.published = live
        if live:
            self.claim(now, self.rng.choice(live))
        self.at(now + self.rng.expovariate(1 / 2), self.stray_reader)

    def claim(self, now: float, handle: _Handle) -> None:
        """One reader request; with tensor parallelism each of its workers claims,
        reads and confirms on its own."""
        reader = f"p/{next(self.next_id)}"
        for member in ("tp0", "tp1") if self.rng.random() < 0.3 else ("tp0",):
            self.tally.claims += 1
            if handle.request_id not in self.allocated:
                self.tally.claims_on_freed += 1
            self.at(now + self.lat(), self.answer_claim, handle, (reader, member), now)

    def _call(self, op: GuardOp, handle: _Handle, who: tuple[str, str]) -> GuardCall:
        return GuardCall(op=op, engine_id="D", request_id=handle.request_id,
                         token=handle.token, reader=who[0], member=who[1], seq=1)

    def answer_claim(self, now: float, handle: _Handle, who: tuple[str, str], sent_s: float) -> None:
        answer = self.ledger.answer(self._call(GuardOp.CLAIM, handle, who), now)
        if not answer.ok:
            self.tally.refused[answer.reason] += 1
            return
        self.tally.granted += 1
        if handle.request_id not in self.allocated:
            self.tally.granted_on_freed += 1
        self.kick(now, CLAIM_TTL_S + 1e-3)       # the holder notices a lapse
        # The answer's way back; now and then the holder's side channel stalls.
        back = self.lat() if self.rng.random() > 0.01 else self.rng.uniform(1, 8)
        if now + back - sent_s >= GUARD_TIMEOUT_S:
            # The reader gave up (claim_timeout) and releases what it may have got.
            self.at(sent_s + GUARD_TIMEOUT_S + self.lat(), self.release, handle, who)
            return
        self.at(now + back, self.read, handle, who)

    def read(self, now: float, handle: _Handle, who: tuple[str, str]) -> None:
        """The grant arrived: the read is posted now and lands after its duration."""
        self.tally.reads += 1
        r = self.rng.random()
        duration = (self.rng.uniform(1e-4, 0.02) if r < 0.95          # a read: ~ms
                    else self.rng.uniform(0.05, 5.0) if r < 0.99      # a slow one
                    else self.rng.uniform(30.0, 150.0))               # stalled
        self.at(now + duration, self.read_done, handle, who, now)

    def read_done(self, now: float, handle: _Handle, who: tuple[str, str], granted_s: float) -> None:
        # The read saw the held bytes only if no block was written since the handle
        # was published (versions only grow, so an equal one never changed).
        clean = all(self.version[b] == v for b, v in handle.versions.items())
        self.tally.torn_reads += not clean
        if self.rng.random() < 0.03:          # NIXL failed the read: release
            self.at(now + self.rng.uniform(1e-3, 0.03), self.release, handle, who)
            return
        if self.rng.random() < 0.95:
            # The read's notification, seen by the holder's worker at its next step:
            # before the confirm or after it.
            self.at(now + self.holder_step(), self.report_sent, handle.request_id)
        # The reader confirms at its worker's next step; now and then a long one.
        delay = (self.rng.uniform(1e-3, 0.03) if self.rng.random() < 0.99
                 else self.rng.uniform(1.0, 100.0))
        self.tally.lapses_possible += now + delay - granted_s >= CLAIM_TTL_S
        self.at(now + delay + self.lat(), self.confirm, handle, who, clean)

    def confirm(self, now: float, handle: _Handle, who: tuple[str, str], clean: bool) -> None:
        answer = self.ledger.answer(self._call(GuardOp.CONFIRM, handle, who), now)
        if answer.ok:
            self.tally.confirms_valid += 1
            self.tally.bad_confirms += not clean
        else:
            self.tally.confirms_refused[answer.reason] += 1
        self.kick(now)

    def release(self, now: float, handle: _Handle, who: tuple[str, str]) -> None:
        self.ledger.answer(self._call(GuardOp.RELEASE, handle, who), now)
        self.kick(now)


SEEDS = range(12)


def _simulate(ledger: SendLedger, seed: int) -> _Tally:
    return _Sim(ledger, seed).run()


@functools.cache
def _real_run(seed: int) -> _Tally:
    return _simulate(SendLedger("D", claim_ttl_s=CLAIM_TTL_S), seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_no_interleaving_confirms_a_read_of_reused_blocks(seed):
    tally = _real_run(seed)
    assert tally.violations == 0, str(tally)
    # The good path is exercised (most granted claims reach a valid confirm), and so
    # is the race: many claims name handles whose blocks were freed and reused.
    assert tally.confirms_valid >= max(150, 0.8 * tally.granted), str(tally)
    assert tally.claims_on_freed >= 300 and tally.refused["gone"] > 0, str(tally)


def test_the_property_runs_reach_every_outcome():
    """Over the seeds: reads torn under a lapsed claim (all refused at confirm),
    claims on ending holds and on holds another reader claimed."""
    total = sum((_real_run(seed) for seed in SEEDS), _Tally())
    print(f"real ledger over {len(SEEDS)} seeds: {total}")
    assert total.violations == 0, str(total)
    assert total.torn_reads > 0 and total.lapses_possible > 0, str(total)
    assert sum(total.confirms_refused.values()) >= total.torn_reads, str(total)
    assert total.refused["ending"] > 0 and total.refused["claimed"] > 0, str(total)


class _NaiveLedger(SendLedger):
    """Frees not deferred: a send is freed as soon as the worker reports it done, an
    ending hold is let go though claimed, and a confirm on a freed request is taken
    as "its own notification freed it"."""

    def gate(self, finished_sending, now_s):
        with self._lock:
            for r in finished_sending:
                self._held.pop(r, None)
        return set(finished_sending)

    def claimed(self, request_id, now_s):
        return False

    def _answer(self, call, now_s):
        reason = super()._answer(call, now_s)
        return "" if call.op is GuardOp.CONFIRM and reason == "gone" else reason


class _LeakyLedger(SendLedger):
    """Frees what the real ledger frees, but keeps the entry: later claims on the
    freed request are granted."""

    def gate(self, finished_sending, now_s):
        with self._lock:
            entries = {r: self._held[r] for r in finished_sending if r in self._held}
        freed = super().gate(finished_sending, now_s)
        with self._lock:
            self._held.update({r: entries[r] for r in freed if r in entries})
        return freed


@pytest.mark.parametrize("ledger", [_NaiveLedger, _LeakyLedger])
def test_negative_controls_break_the_promise(ledger):
    """Broken ledgers the property must catch, on every seed of the real one."""
    tallies = [_simulate(ledger("D", claim_ttl_s=CLAIM_TTL_S), seed) for seed in SEEDS]
    total = sum(tallies, _Tally())
    print(f"{ledger.__name__} over {len(SEEDS)} seeds: {total}")
    assert total.violations > 0 and all(t.violations for t in tallies), \
        f"{ledger.__name__} passed the property: {total}"


# ------------------------------------------------------------ the reader over ZMQ
def _poll_until(guard: ReadGuard, pred, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    polls = []
    while time.monotonic() < deadline:
        polled = guard.poll(time.perf_counter())
        polls.append(polled)
        if pred(polled):
            return polled
        time.sleep(0.005)
    raise AssertionError(f"no matching poll: {polls[-3:]}")


def test_reader_claims_then_confirms_over_zmq(guard_holder):
    ledger, port = guard_holder.ledger, guard_holder.port
    ledger.add("x", 7)
    guard = ReadGuard("P", member="tp0", timeout_s=5.0)
    try:
        guard.expect({"r1": 7})
        read = GuardedRead(request_id="r1", holder_engine_id="D", holder_request_id="x",
                           token=7, host="127.0.0.1", port=port, local_blocks=frozenset({3}))
        guard.claim(read, time.perf_counter())
        assert _poll_until(guard, lambda p: p.granted).granted == ["r1"]
        assert ledger.claimed("x", time.perf_counter())
        guard.confirm("r1", time.perf_counter())
        assert _poll_until(guard, lambda p: p.confirmed).confirmed == ["r1"]
        assert not ledger.claimed("x", time.perf_counter())
        # A second reader of the same handle after the send ended is refused.
        assert ledger.gate({"x"}, time.perf_counter()) == {"x"}
        read2 = GuardedRead(request_id="r2", holder_engine_id="D", holder_request_id="x",
                            token=7, host="127.0.0.1", port=port, local_blocks=frozenset())
        guard.claim(read2, time.perf_counter())
        assert _poll_until(guard, lambda p: p.refused).refused == [("r2", "gone")]
    finally:
        guard.close()


def test_reader_times_out_on_a_silent_holder(silent_holder):
    guard = ReadGuard("P", member="tp0", timeout_s=0.2)
    try:
        guard.claim(GuardedRead(request_id="r1", holder_engine_id="D",
                                holder_request_id="x", token=7, host="127.0.0.1",
                                port=silent_holder, local_blocks=frozenset()),
                    time.perf_counter())
        assert _poll_until(guard, lambda p: p.refused).refused == [("r1", "timeout")]
    finally:
        guard.close()


@pytest.mark.parametrize("digest_wait_s, outcome", [(5.0, "confirmed"), (None, "timeout")])
def test_a_pending_digest_waits_past_the_timeout_up_to_the_claims_life(
        guard_holder, digest_wait_s, outcome):
    """The holder digests a hold at the end of its next step, which can outlast the
    reader's timeout (a real model's long prefill step): each DIGEST_PENDING answer
    moves the confirm's deadline on, up to ``digest_wait_s``.  Without it (the
    control, the rule before) the confirm times out and the read is recomputed."""
    ledger, port = guard_holder.ledger, guard_holder.port
    ledger.digests = True
    ledger.add("x", 7)
    guard = ReadGuard("P", member="tp0", timeout_s=0.3, digest_wait_s=digest_wait_s)
    try:
        guard.expect({"r1": 7})
        guard.claim(GuardedRead(request_id="r1", holder_engine_id="D", holder_request_id="x",
                                token=7, host="127.0.0.1", port=port,
                                local_blocks=frozenset({3}), digest_pairs=((3, 5),)),
                    time.perf_counter())
        assert _poll_until(guard, lambda p: p.granted).granted == ["r1"]
        guard.confirm("r1", time.perf_counter(), digests=(50,))
        later = time.perf_counter() + 0.8          # well past the 0.3 s timeout
        while time.perf_counter() < later:
            polled = guard.poll(time.perf_counter())
            assert not polled.confirmed
            if polled.refuted:
                assert outcome == "timeout" and polled.refuted[0][1] == "timeout"
                return
            time.sleep(0.005)
        assert outcome == "confirmed", "the control's confirm did not time out"
        with guard_holder._answering:               # the holder's step ended
            ledger.set_digests("x", {"tp0": {5: 50}})
        done = _poll_until(guard, lambda p: p.confirmed or p.refuted)
        assert done.confirmed == ["r1"] and done.digest_checks == ["matched"]
    finally:
        guard.close()
