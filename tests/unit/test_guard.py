"""The pull guard: the holder's ledger, its wire, and the reader over real ZMQ.

The property test plays random interleavings of publish, claim, read, confirm,
early ends (kv_pressure, lease, reset), NIXL notifications, claim lapses, frees and
reuse of the freed blocks, and checks the one promise: a confirm is granted only
to a read that saw the held bytes from start to end.  Its negative control (a
ledger that never defers a free) must break the promise.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import zmq

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
class _Holder:
    """One engine's blocks, the ledger, and a worker that reports sends done."""

    def __init__(self, ledger: SendLedger, rng: random.Random) -> None:
        self.ledger = ledger
        self.rng = rng
        self.contents: dict[int, str] = {}       # block -> request whose KV it holds
        self.allocated: dict[str, list[int]] = {}
        self.free_blocks = list(range(64))
        self.reported: set[str] = set()          # worker reported send done, not freed
        self.ending: set[str] = set()            # asked to end, worker not told yet
        self.next_id = 0

    def publish(self, now: float) -> tuple[str, int] | None:
        if len(self.free_blocks) < 4:
            return None
        request_id = f"h{self.next_id}"
        self.next_id += 1
        blocks = [self.free_blocks.pop(self.rng.randrange(len(self.free_blocks)))
                  for _ in range(4)]
        for b in blocks:
            self.contents[b] = request_id
        self.allocated[request_id] = blocks
        token = self.next_id * 1000 + 1
        self.ledger.add(request_id, token)
        return request_id, token

    def report_sent(self, request_id: str, now: float) -> None:
        """The worker reports the send done (a notification, an expiry, our release)."""
        if request_id in self.allocated and request_id not in self.reported:
            self.reported.add(request_id)
            for r in self.ledger.gate({request_id}, now):
                self._free(r)

    def end_early(self, request_id: str, now: float) -> None:
        self.ending.add(request_id)
        self.ledger.mark_ending({request_id})

    def step(self, now: float) -> None:
        """The scheduler's step: ask the worker to release ended holds not claimed,
        and free deferred sends whose claims ended."""
        for r in list(self.ending):
            if not self.ledger.claimed(r, now):
                self.ending.discard(r)
                self.report_sent(r, now)
        for r in self.ledger.take_releasable(now):
            for freed in self.ledger.gate({r}, now):
                self._free(freed)

    def _free(self, request_id: str) -> None:
        blocks = self.allocated.pop(request_id)
        self.reported.discard(request_id)
        self.free_blocks.extend(blocks)

    def reuse(self) -> None:
        """A new request overwrites some free blocks."""
        for b in self.rng.sample(self.free_blocks, min(3, len(self.free_blocks))):
            self.contents[b] = f"other{self.rng.random()}"


def _violations(ledger: SendLedger, seed: int, events: int = 3000) -> int:
    rng = random.Random(seed)
    holder = _Holder(ledger, rng)
    handles: list[tuple[str, int]] = []
    reads: dict[int, dict] = {}    # reader -> state
    now = 0.0
    bad = 0
    for _ in range(events):
        now += rng.choice((0.01, 0.1, 1.0, 4.0))
        op = rng.random()
        if op < 0.12:
            handle = holder.publish(now)
            if handle:
                handles.append(handle)
        elif op < 0.30 and handles:
            reader = rng.randrange(1 << 30)
            request_id, token = rng.choice(handles)
            answer = ledger.answer(GuardCall(op=GuardOp.CLAIM, engine_id="D",
                                             request_id=request_id, token=token,
                                             reader=f"p/{reader}", member="tp0", seq=1), now)
            if answer.ok:
                blocks = list(holder.allocated[request_id])
                reads[reader] = {"handle": (request_id, token), "blocks": blocks,
                                 "seen": [holder.contents[b] for b in blocks],
                                 "done": False}
        elif op < 0.45 and reads:
            reader = rng.choice(list(reads))
            read = reads[reader]
            if not read["done"]:
                # The read ends: it saw the bytes only if they never changed.
                read["done"] = True
                read["clean"] = [holder.contents[b] for b in read["blocks"]] == read["seen"] \
                    and all(s == read["handle"][0] for s in read["seen"])
                if rng.random() < 0.7:   # the read's notification ends the send
                    holder.report_sent(read["handle"][0], now)
            else:
                request_id, token = read["handle"]
                answer = ledger.answer(GuardCall(op=GuardOp.CONFIRM, engine_id="D",
                                                 request_id=request_id, token=token,
                                                 reader=f"p/{reader}", member="tp0",
                                                 seq=2), now)
                if answer.ok and not read["clean"]:
                    bad += 1
                del reads[reader]
        elif op < 0.55 and handles:
            holder.end_early(rng.choice(handles)[0], now)      # kv_pressure, lease, reset
        elif op < 0.62 and handles:
            holder.report_sent(rng.choice(handles)[0], now)    # expiry, stray notify-only
        elif op < 0.85:
            holder.step(now)
        else:
            holder.reuse()
        # Reads in flight see reuse as it happens.
        for read in reads.values():
            if not read["done"]:
                if [holder.contents[b] for b in read["blocks"]] != read["seen"]:
                    read["seen"] = ["torn"]
        handles = [h for h in handles if h[0] in holder.allocated]
    return bad


@pytest.mark.parametrize("seed", range(12))
def test_no_interleaving_confirms_a_read_of_reused_blocks(seed):
    assert _violations(SendLedger("D", claim_ttl_s=5.0), seed) == 0


def test_negative_control_frees_not_deferred_confirm_bad_reads():
    """The naive design: free a send as soon as the worker reports it done, and take
    a confirm on a freed request as "its own notification freed it".  Stray
    notifications, expiries and early ends then free blocks under a read in flight,
    and the property test must catch it."""

    class NaiveLedger(SendLedger):
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

    assert sum(_violations(NaiveLedger("D", claim_ttl_s=5.0), s) for s in range(12)) > 0


# ------------------------------------------------------------ the reader over ZMQ
@pytest.fixture
def holder_channel():
    """A ROUTER answering guard calls from a ledger, as the side channel does."""
    ledger = SendLedger("D", claim_ttl_s=30.0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                identity, _, msg = sock.recv_multipart()
                call = decode_call(msg)
                sock.send_multipart((identity, b"", encode_answer(
                    ledger.answer(call, time.perf_counter()))))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield ledger, port
    stop.set()
    thread.join()
    sock.close(linger=0)
    ctx.term()


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


def test_reader_claims_then_confirms_over_zmq(holder_channel):
    ledger, port = holder_channel
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


def test_reader_times_out_on_a_silent_holder():
    sock = zmq.Context.instance().socket(zmq.ROUTER)   # binds, never answers
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    guard = ReadGuard("P", member="tp0", timeout_s=0.2)
    try:
        guard.claim(GuardedRead(request_id="r1", holder_engine_id="D",
                                holder_request_id="x", token=7, host="127.0.0.1",
                                port=port, local_blocks=frozenset()), time.perf_counter())
        assert _poll_until(guard, lambda p: p.refused).refused == [("r1", "timeout")]
    finally:
        guard.close()
        sock.close(linger=0)
