"""Session holds and the guard's ledger as the scheduler drives them, on plain data:
a hold's lease, supersession, the KV cap, a reset, room made for a request D cannot
admit, a claim that delays a release."""

from __future__ import annotations

import itertools

from vllm_sessionkv.guard import GuardCall, GuardOp, decode_answer, encode_call
from vllm_sessionkv.publisher import HandlePublisher
from vllm_sessionkv.scheduling.admission import Admission
from vllm_sessionkv.scheduling.guard_ledger import GuardLedger
from vllm_sessionkv.scheduling.session_holds import SessionHolds


class Stats:
    def __init__(self) -> None:
        self.data: dict[str, list] = {}

    def record(self, key: str, value: int | float = 1) -> None:
        self.data.setdefault(key, []).append(value)


def holds(max_blocks: int = 100) -> SessionHolds:
    return SessionHolds(max_blocks, 0.5, HandlePublisher(None))


def guard(enabled: bool = True) -> GuardLedger:
    tokens = itertools.count(7)
    return GuardLedger("D", enabled, claim_ttl_s=5.0, new_token=lambda: next(tokens))


def claim(ledger: GuardLedger, request_id: str, token: int, now: float) -> bool:
    raw = encode_call(GuardCall(op=GuardOp.CLAIM, engine_id="D", request_id=request_id,
                                token=token, reader="p/r", member="tp0", seq=1))
    return decode_answer(ledger.answer(raw, now)).ok


def test_a_lease_ends_at_its_deadline_and_a_newer_turn_supersedes():
    table, ledger, stats = holds(), guard(enabled=False), Stats()
    assert table.hold("s", "t1", now_s=0.0, lease_s=10.0, grace_s=1.0, num_blocks=4) == 10.0
    assert table.take_releases(5.0, ledger) == set()
    table.hold("s", "t2", now_s=5.0, lease_s=10.0, grace_s=1.0, num_blocks=4)
    assert table.take_releases(6.5, ledger) == {"t1"}          # superseded, grace over
    assert table.take_releases(15.5, ledger) == {"t2"}         # lease over
    table.released(["t1", "t2", "unheld"], stats)
    assert stats.data == {"session_holds_released_superseded": [1],
                          "session_holds_released_lease_ended": [1]}


def test_holds_over_the_cap_end_oldest_first_and_a_reset_ends_all():
    table, ledger = holds(max_blocks=6), guard(enabled=False)
    table.hold("a", "ta", 0.0, 100.0, 1.0, num_blocks=4)
    table.hold("b", "tb", 1.0, 100.0, 1.0, num_blocks=4)      # 8 > 6: "a" ends
    assert table.take_releases(2.0, ledger) == {"ta"}
    assert table.end_all() == 1 and table.take_releases(2.0, ledger) == {"tb"}
    stats = Stats()
    table.record_stats(stats)
    # The table forgets a hold when released; with no host tier the ended one's KV is
    # dropped.
    assert stats.data == {"session_holds": [2], "session_hold_ends_kv_pressure_dropped": [1]}


def test_holds_under_the_cap_make_room_for_a_waiting_request_oldest_first():
    table, ledger = holds(max_blocks=100), guard(enabled=False)
    for i, sid in enumerate("abc"):
        table.hold(sid, f"t{sid}", float(i), 100.0, 1.0, num_blocks=4)
    assert table.take_releases(3.0, ledger) == set()            # 12 held, under the cap
    assert table.make_room(5, 3.0) == 2                          # 4 is not enough: two
    assert table.take_releases(3.0, ledger) == {"ta", "tb"}
    # Ending holds count: the same need next step, before their release is reported,
    # ends nothing more; a larger one ends the rest.
    assert table.make_room(5, 3.1) == 0
    assert table.make_room(9, 3.1) == 1 and table.take_releases(3.1, ledger) == {"tc"}
    assert table.make_room(1, 3.2) == 0                          # nothing left to end
    table.released(["ta", "tb", "tc"], Stats())


def test_admission_ends_holds_for_a_request_left_unallocated_with_nothing_running():
    table, ledger = holds(max_blocks=100), guard(enabled=False)
    for i, sid in enumerate("abc"):
        table.hold(sid, f"t{sid}", float(i), 100.0, 1.0, num_blocks=4)
    admission = Admission(table, block_size=16)
    admission.asked("small", 1)
    admission.allocated("small")
    assert admission.make_room(0.0, lambda: 0, 3.0) == 0       # it was admitted
    admission.asked("big", 16 * 9)                              # 9 blocks and one more
    assert admission.make_room(1.0, lambda: 0, 3.0) == 0       # the step runs something
    assert admission.make_room(0.0, lambda: 0, 3.0) == 0       # asks are one step's
    admission.asked("big", 16 * 9)
    assert admission.make_room(0.0, lambda: 5, 3.0) == 2       # lacks 5: two holds of 4
    assert table.take_releases(3.0, ledger) == {"ta", "tb"}
    table.released(["ta", "tb"], Stats())
    admission.asked("big", 16 * 9)                              # fits by the count: one
    assert admission.make_room(0.0, lambda: 20, 3.1) == 1
    assert table.take_releases(3.1, ledger) == {"tc"}


def test_a_claim_delays_a_release_and_the_free_of_its_send():
    table, ledger, stats = holds(), guard(), Stats()
    token = ledger.hold_token("t1", [3, 4])
    assert token == 7
    table.hold("s", "t1", 0.0, lease_s=10.0, grace_s=1.0, num_blocks=4)
    assert claim(ledger, "t1", token, now=9.0)
    assert table.take_releases(10.5, ledger) == set()           # the claim stands
    # The worker reports the send done; the claim keeps it from being freed.
    assert ledger.gate({"t1", "other"}, 10.5) == {"other"}
    assert table.take_releases(14.5, ledger) == {"t1"}          # the claim lapsed
    assert ledger.take_sent(14.5) == {"t1"}
    ledger.record_totals(stats)
    assert stats.data == {"guard_claims_granted": [1], "guard_frees_deferred": [1]}
    assert not claim(ledger, "t1", token, now=15.0)             # ending: no new claims


def test_the_guard_off_gates_nothing_and_gives_no_tokens():
    ledger = guard(enabled=False)
    assert ledger.hold_token("t1", [3, 4]) == 0 and ledger.gate({"t1"}, 0.0) is None
    ledger.read_next_step("r", 7)
    assert ledger.take_reads() == {} and ledger.answer(b"\x00", 0.0) is None
    on = guard()
    on.read_next_step("r", 7)
    on.read_next_step("s", 0)       # an unguarded handle: nothing to claim
    assert on.take_reads() == {"r": 7} and on.take_reads() == {}


def test_a_handle_goes_to_the_handle_channel_too_and_a_failed_send_is_counted():
    class Channel:
        def __init__(self, ok: bool) -> None:
            self.ok, self.sent, self.closed = ok, [], False

        def publish(self, params) -> bool:
            self.sent.append(params)
            return self.ok

        def close(self) -> None:
            self.closed = True

    for ok, key in ((True, "session_handles_sent"), (False, "session_handles_publish_failed")):
        channel, stats = Channel(ok), Stats()
        table = SessionHolds(100, 0.5, HandlePublisher(None), channel)
        table.publish("s", {"remote_num_tokens": 16}, 10.0, stats)
        assert channel.sent == [{"remote_num_tokens": 16}] and stats.data == {key: [1]}
        table.close()
        assert channel.closed


class Recorder:
    """Publisher and channel stand-in: what was published and withdrawn."""

    def __init__(self) -> None:
        self.withdrawn: list = []

    def publish(self, *args) -> bool:
        return True

    def withdraw(self, withdrawal) -> bool:
        self.withdrawn.append(withdrawal)
        return True

    def take_failures(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _published(table: SessionHolds, request_id: str, session_id: str, token: int) -> None:
    table.publish(session_id, {"remote_num_tokens": 16, "sessionkv": {
        "session_id": session_id, "hold_token": token, "engine_url": "http://d",
        "engine_epoch": 5}}, 60.0, Stats(), request_id)


def test_a_hold_that_ends_before_its_lease_withdraws_its_handle_once():
    """kv_pressure withdraws when the cap drops the hold, superseded when its grace
    ends, a reset at once, a read when it is released; an ended lease does not (the
    handle's expiry says it).  Each hold once, counted by reason.  Control: with
    ``withdraw`` off nothing is withdrawn."""
    for enabled in (True, False):
        redis, channel, stats = Recorder(), Recorder(), Stats()
        table = SessionHolds(6, 0.5, redis, channel, withdraw=enabled)
        ledger = guard(enabled=False)
        table.hold("a", "ta", 0.0, 100.0, 1.0, num_blocks=4)
        _published(table, "ta", "a", 1)
        table.hold("b", "tb", 1.0, 100.0, 1.0, num_blocks=4)      # "a" over the cap
        _published(table, "tb", "b", 2)
        assert [w.hold_token for w in redis.withdrawn] == ([1] if enabled else [])
        table.hold("b", "tb2", 2.0, 100.0, 1.0, num_blocks=1)     # supersedes "tb"
        _published(table, "tb2", "b", 3)
        table.hold("c", "tc", 3.0, 5.0, 1.0, num_blocks=0)
        _published(table, "tc", "c", 4)
        table.hold("d", "td", 3.0, 100.0, 1.0, num_blocks=0)
        _published(table, "td", "d", 5)
        assert table.take_releases(3.5, ledger) == {"ta", "tb"}
        assert table.take_releases(9.0, ledger) == {"tc"}         # lease: no withdrawal
        table.released(["ta", "tb", "tc", "tb2"], stats)          # tb2: read by P
        assert table.end_all() == 1                               # "td"
        table.released(["td"], stats)
        table.record_stats(stats)
        withdrawn = {(w.hold_token, w.reason) for w in redis.withdrawn}
        assert {(w.hold_token, w.reason) for w in channel.withdrawn} == withdrawn
        if not enabled:
            assert withdrawn == set() and not any(k.startswith("handles_withdrawn")
                                                  for k in stats.data)
            continue
        assert len(redis.withdrawn) == 4
        assert withdrawn == {(1, "kv_pressure"), (2, "superseded"), (3, "pulled"),
                             (5, "reset")}
        w = redis.withdrawn[0]
        assert (w.session_id, w.engine_url, w.engine_epoch, w.ttl_s) == ("a", "http://d",
                                                                          5, 60.0)
        assert {k: sum(v) for k, v in stats.data.items()
                if k.startswith("handles_withdrawn")} == {
            "handles_withdrawn_kv_pressure": 1, "handles_withdrawn_superseded": 1,
            "handles_withdrawn_pulled": 1, "handles_withdrawn_reset": 1}


def test_the_hold_blocks_gauge_counts_what_only_holds_keep_on_change_and_throttled():
    """``record_hold_blocks``: the blocks ending every hold would free, against the
    reference counts it is given; recorded when the count changes, counted again at
    most every HOLD_BLOCKS_EVERY_S, and at once (0) when the last hold is gone.
    Unknown counts (None) claim nothing: the proxy then sees vLLM's usage as it is."""
    from vllm_sessionkv.holds import HOLD_BLOCKS_EVERY_S as EVERY

    table, stats = holds(), Stats()
    refs = {b: 1 for b in range(10)}
    asked = []

    def counts(ids):
        asked.append(sorted(ids))
        return refs

    table.hold("a", "ta", 0.0, 100.0, 1.0, num_blocks=4, block_ids=[0, 1, 2, 3])
    table.hold("b", "tb", 0.0, 100.0, 1.0, num_blocks=2, block_ids=[4, 5])
    table.record_hold_blocks(stats, 1.0, counts)
    assert stats.data == {"session_hold_blocks": [6]}
    refs.update({0: 2, 1: 2})        # a running request hit a's first two blocks
    table.record_hold_blocks(stats, 1.0 + EVERY / 2, counts)   # too soon: not counted
    assert len(asked) == 1 and stats.data == {"session_hold_blocks": [6]}
    table.record_hold_blocks(stats, 1.0 + EVERY, counts)
    assert stats.data == {"session_hold_blocks": [6, 4]}
    table.record_hold_blocks(stats, 1.0 + 2 * EVERY, counts)    # unchanged: not sent
    assert stats.data == {"session_hold_blocks": [6, 4]}
    table.record_hold_blocks(stats, 1.0 + 3 * EVERY, lambda ids: None)
    assert stats.data == {"session_hold_blocks": [6, 4, 0]}
    table.record_hold_blocks(stats, 1.0 + 4 * EVERY, counts)
    table.released(["ta", "tb"], Stats())
    table.record_hold_blocks(stats, 1.0 + 4 * EVERY + 0.01, counts)   # none left: at once
    assert stats.data == {"session_hold_blocks": [6, 4, 0, 4, 0]}
    assert len(asked) == 4           # an empty table asks vLLM nothing
