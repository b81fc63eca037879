"""Session holds: when each ends, why, and what the gauge counts."""

from __future__ import annotations

from vllm_sessionkv.holds import RELEASE_REASONS, HoldTable, hold_only_blocks


def test_a_hold_read_by_the_next_turn_ends_as_pulled():
    holds = HoldTable()
    holds.hold("s1", "r1", until_s=100.0, superseded_until_s=10.0)
    assert holds.sessions == 1 and holds.due(50.0) == {}
    assert holds.released("r1") == "pulled"
    assert holds.sessions == 0 and len(holds) == 0
    assert holds.released("r1") is None          # reported once
    assert holds.released("not-a-hold") is None  # e.g. a P->D send


def test_a_lease_ends_once_at_its_deadline():
    holds = HoldTable()
    holds.hold("s1", "r1", until_s=100.0, superseded_until_s=10.0)
    holds.hold("s2", "r2", until_s=200.0, superseded_until_s=110.0)
    assert holds.due(99.9) == {}
    assert holds.due(100.0) == {"r1": "lease_ended"}
    assert holds.due(150.0) == {}                 # asked once, until the worker reports
    assert holds.sessions == 2                    # blocks still allocated until then
    assert holds.released("r1") == "lease_ended"
    assert holds.sessions == 1


def test_a_newer_turn_supersedes_the_older_hold_after_its_grace():
    holds = HoldTable()
    holds.hold("s1", "r1", until_s=100.0, superseded_until_s=10.0)
    assert holds.hold("s1", "r2", until_s=150.0, superseded_until_s=60.0) == "r1"
    assert holds.sessions == 1 and len(holds) == 2
    assert holds.due(59.0) == {}
    assert holds.due(60.0) == {"r1": "superseded"}
    assert holds.released("r1") == "superseded"
    assert holds.sessions == 1                    # r2 still holds the session
    # A grace never lengthens a hold.
    holds.hold("s2", "r3", until_s=5.0, superseded_until_s=0.0)
    holds.hold("s2", "r4", until_s=50.0, superseded_until_s=20.0)
    assert holds.due(5.0) == {"r3": "superseded"}


def test_the_same_request_held_again_is_not_superseded():
    holds = HoldTable()
    holds.hold("s1", "r1", until_s=100.0, superseded_until_s=10.0)
    assert holds.hold("s1", "r1", until_s=120.0, superseded_until_s=30.0) is None
    assert holds.due(110.0) == {}


def test_a_reset_ends_every_running_hold_and_keeps_earlier_reasons():
    holds = HoldTable()
    holds.hold("s1", "r1", until_s=100.0, superseded_until_s=10.0)
    holds.hold("s2", "r2", until_s=100.0, superseded_until_s=10.0)
    holds.hold("s3", "r3", until_s=50.0, superseded_until_s=10.0)
    assert holds.due(60.0) == {"r3": "lease_ended"}
    assert sorted(holds.end_all("reset")) == ["r1", "r2"]
    assert holds.end_all("reset") == []
    assert holds.due(1000.0) == {}
    assert [holds.released(r) for r in ("r1", "r2", "r3")] == [
        "reset", "reset", "lease_ended"]
    assert holds.sessions == 0


def test_every_reason_is_a_known_label():
    holds = HoldTable()
    holds.hold("a", "1", until_s=1.0, superseded_until_s=0.0)
    holds.hold("a", "2", until_s=1.0, superseded_until_s=0.0)
    holds.hold("b", "3", until_s=9.0, superseded_until_s=0.0)
    holds.hold("c", "4", until_s=9.0, superseded_until_s=0.0)
    holds.due(1.0)
    holds.end_all("reset")
    reasons = {holds.released(r) for r in ("1", "2", "3")} | {"pulled"}
    assert reasons <= set(RELEASE_REASONS)
    assert reasons == {"superseded", "lease_ended", "reset", "pulled"}


def test_holds_over_the_kv_cap_end_oldest_first_superseded_before_current():
    t = HoldTable()
    t.hold("a", "a1", until_s=100, superseded_until_s=10, num_blocks=10)
    t.hold("b", "b1", until_s=100, superseded_until_s=10, num_blocks=10)
    t.hold("a", "a2", until_s=100, superseded_until_s=10, num_blocks=12)   # a1 superseded
    t.hold("c", "c1", until_s=100, superseded_until_s=10, num_blocks=10)
    assert t.held_blocks == 42
    assert t.over_cap(100) == []                       # under the cap: nothing ends
    # 42 -> at most 25: the superseded a1 first, then the oldest current (b1).
    assert t.over_cap(25, keep="c1") == ["a1", "b1"]
    assert t.held_blocks == 22
    assert t.released("b1") == "kv_pressure" and t.released("a1") == "kv_pressure"
    # The hold just made is kept even alone over the cap.
    assert t.over_cap(0, keep="c1") == ["a2"]
    assert t.released("c1") == "pulled"


def test_the_blocks_only_holds_keep_are_those_no_running_request_shares():
    """``hold_only_blocks`` on plain data: a block counts when its reference count is
    no more than the holds naming it.  Two holds of one session share their prefix
    (counted once, freed when both end); a running request's prefix hit on a held
    block keeps it out; the null block (count 0) and a block with no count are out."""
    t = HoldTable()
    t.hold("s", "r1", until_s=100, superseded_until_s=10, num_blocks=3, block_ids=[1, 2, 3])
    t.hold("s", "r2", until_s=100, superseded_until_s=10, num_blocks=4,
           block_ids=[1, 2, 3, 4])                     # the next turn: same prefix
    t.hold("u", "r3", until_s=100, superseded_until_s=10, num_blocks=3,
           block_ids=[0, 0, 7])                        # sliding window: null block 0
    assert t.holders == {1: 2, 2: 2, 3: 2, 4: 1, 0: 2, 7: 1}
    alone = {0: 0, 1: 2, 2: 2, 3: 2, 4: 1, 7: 1}
    assert hold_only_blocks(t.holders, alone) == 5     # 1, 2, 3, 4 and 7
    # A running request hit blocks 1 and 2 (one reference more each): not freed.
    shared = {**alone, 1: 3, 2: 3}
    assert hold_only_blocks(t.holders, shared) == 3
    assert hold_only_blocks(t.holders, {}) == 0        # no counts: none claimed
    # Released holds leave the table; the same request held again replaces its own.
    assert t.released("r1") == "pulled"                # P read the older turn
    assert t.holders == {1: 1, 2: 1, 3: 1, 4: 1, 0: 2, 7: 1}
    t.hold("u", "r3", until_s=100, superseded_until_s=10, num_blocks=1, block_ids=[8])
    assert t.holders == {1: 1, 2: 1, 3: 1, 4: 1, 8: 1}
    t.released("r2")
    t.released("r3")
    assert t.holders == {} and len(t) == 0
