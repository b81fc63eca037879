"""The retention rule (retention.py) on plain data: leases from a hint, from observed
gaps, from the default; pressure; bounds; the eviction order by value against the age
order on the same holds; and D's session holds ending by it, demoting first."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_sessionkv.config import ConfigError, parse_config
from vllm_sessionkv.publisher import HandlePublisher
from vllm_sessionkv.retention import (
    GapHistory,
    HoldFacts,
    Lease,
    LeaseSource,
    Retention,
    RetentionParams,
    SessionHistory,
    eviction_order,
    gap_quantile_s,
    lease,
    value,
)
from vllm_sessionkv.scheduling.guard_ledger import GuardLedger
from vllm_sessionkv.scheduling.session_holds import SessionHolds
from vllm_sessionkv.wire.cost import RecomputeModel

PARAMS = RetentionParams(default_lease_s=120.0, min_lease_s=30.0, max_lease_s=600.0,
                         gap_quantile=0.9, gap_margin=2.0, min_gaps=2,
                         pressure_lease_cut=0.5)
AGE = RetentionParams(mode=Retention.AGE, default_lease_s=120.0)
LINEAR = RecomputeModel(s_per_token=1e-3, s_per_token_per_context_token=0.0,
                        load_slowdown_per_unit=0.0)
ATTENTION = RecomputeModel(s_per_token=1e-3, s_per_token_per_context_token=1e-6,
                           load_slowdown_per_unit=0.0)


def _facts(rid: str, started_s: float, *, hint_s: float | None = None,
           gaps: tuple[float, ...] = (), tokens: int = 320, superseded: bool = False,
           params: RetentionParams = PARAMS) -> HoldFacts:
    history = SessionHistory(gaps_s=gaps, hint_s=hint_s)
    return HoldFacts(request_id=rid, started_s=started_s, lease=lease(history, params, 0.0),
                     history=history, held_tokens=tokens, held_bytes=tokens * 1024,
                     superseded=superseded)


# ------------------------------------------------------------------------- leases

def test_no_hint_and_too_few_gaps_lease_the_default():
    assert lease(SessionHistory(), PARAMS, 0.0) == Lease(120.0, LeaseSource.DEFAULT)
    assert lease(SessionHistory(gaps_s=(5.0,)), PARAMS, 0.0) == \
        Lease(120.0, LeaseSource.DEFAULT)


def test_a_hint_sets_the_lease_within_the_bounds():
    assert lease(SessionHistory(hint_s=300.0), PARAMS, 0.0) == Lease(300.0, LeaseSource.HINT)
    assert lease(SessionHistory(hint_s=1e6), PARAMS, 0.0).lease_s == 600.0    # max
    assert lease(SessionHistory(hint_s=0.0), PARAMS, 0.0).lease_s == 30.0     # min
    # A hint wins over gaps, and pressure does not cut it.
    assert lease(SessionHistory(gaps_s=(1.0, 1.0), hint_s=300.0), PARAMS, 1.0) == \
        Lease(300.0, LeaseSource.HINT)


def test_observed_gaps_set_the_lease_from_their_quantile_and_margin():
    # Nearest rank 0.9 of ten gaps is the 9th smallest: 90 s; times 2.
    gaps = tuple(float(g) for g in range(10, 110, 10))
    assert gap_quantile_s(gaps, 0.9) == 90.0
    assert lease(SessionHistory(gaps_s=gaps), PARAMS, 0.0) == Lease(180.0, LeaseSource.GAPS)
    # Short gaps shorten the lease to the minimum, long ones lengthen it to the max.
    assert lease(SessionHistory(gaps_s=(2.0, 3.0)), PARAMS, 0.0) == \
        Lease(30.0, LeaseSource.GAPS)
    assert lease(SessionHistory(gaps_s=(400.0, 500.0)), PARAMS, 0.0).lease_s == 600.0


def test_pressure_cuts_leases_above_half_the_cap_but_not_below_the_minimum():
    history = SessionHistory()
    assert lease(history, PARAMS, 0.5).lease_s == 120.0           # up to half: none
    assert lease(history, PARAMS, 0.75).lease_s == pytest.approx(90.0)
    assert lease(history, PARAMS, 1.0).lease_s == pytest.approx(60.0)
    assert lease(history, PARAMS, 3.0).lease_s == pytest.approx(60.0)   # cut at most
    hard = RetentionParams(pressure_lease_cut=1.0, min_lease_s=30.0)
    assert lease(history, hard, 1.0).lease_s == 30.0
    # A default shorter than the minimum is never lengthened by it, and lowers the
    # floor of the other leases too.
    short = RetentionParams(default_lease_s=15.0, min_lease_s=30.0)
    assert lease(history, short, 1.0).lease_s == 15.0
    assert lease(SessionHistory(gaps_s=(1.0, 1.0)), short, 0.0).lease_s == 15.0
    assert lease(SessionHistory(hint_s=0.0), short, 0.0).lease_s == 15.0
    assert lease(SessionHistory(gaps_s=(50.0, 50.0)), short, 0.0).lease_s == 100.0
    assert lease(history, RetentionParams(pressure_lease_cut=0.0), 1.0).lease_s == 120.0


def test_the_age_rule_gives_every_hold_the_default_lease():
    for history in (SessionHistory(hint_s=500.0), SessionHistory(gaps_s=(1.0, 1.0, 1.0))):
        assert lease(history, AGE, 1.0) == Lease(120.0, LeaseSource.DEFAULT)


# -------------------------------------------------------------------------- value

def test_expected_reuse_from_a_hint_gaps_or_nothing():
    hinted = value(_facts("h", 0.0, hint_s=300.0), 100.0, LINEAR)
    assert hinted.reuse == 1.0
    assert value(_facts("h", 0.0, hint_s=300.0), 300.0, LINEAR).reuse == 0.0
    # Gaps 10, 20, 200: 100 s in, one of three is longer: (1 + 1) / (3 + 2).
    assert value(_facts("g", 0.0, gaps=(10.0, 20.0, 200.0)), 100.0, LINEAR).reuse == \
        pytest.approx(0.4)
    # Neither: half, falling to none over the lease.
    assert value(_facts("d", 0.0), 0.0, LINEAR).reuse == 0.5
    assert value(_facts("d", 0.0), 60.0, LINEAR).reuse == pytest.approx(0.25)
    assert value(_facts("s", 0.0, hint_s=300.0, superseded=True), 1.0, LINEAR).value == 0.0


def test_recompute_saved_per_byte_grows_with_context_under_attention():
    short, long_ = _facts("a", 0.0, tokens=100), _facts("b", 0.0, tokens=4000)
    assert value(short, 0.0, LINEAR).saved_s_per_byte == \
        pytest.approx(value(long_, 0.0, LINEAR).saved_s_per_byte)
    assert value(long_, 0.0, ATTENTION).saved_s_per_byte > \
        value(short, 0.0, ATTENTION).saved_s_per_byte


# -------------------------------------------------------------------------- order

def test_value_order_ends_the_least_valuable_first_where_age_would_end_the_oldest():
    # "old" is the oldest hold, hinted for 10 min; "mid" came later with no hint.
    holds = [_facts("old", 0.0, hint_s=600.0), _facts("mid", 10.0),
             _facts("busy", 20.0, gaps=(5.0, 6.0, 7.0))]
    by_value = [v.request_id for v in eviction_order(holds, 40.0, PARAMS, LINEAR)]
    by_age = [v.request_id for v in eviction_order(holds, 40.0, AGE, LINEAR)]
    # 40 s in, "busy" (gaps of 5-7 s, 20 s idle) is likely gone: reuse 1/5 < 0.5*(1-30/120).
    assert by_value == ["busy", "mid", "old"]
    assert by_age == ["old", "mid", "busy"]            # the negative control


def test_superseded_holds_end_first_and_ties_go_oldest_first():
    holds = [_facts("a", 0.0), _facts("b", 0.0), _facts("c", 5.0, hint_s=600.0,
                                                         superseded=True)]
    assert [v.request_id for v in eviction_order(holds, 1.0, PARAMS, LINEAR)] == \
        ["c", "a", "b"]
    assert [v.request_id for v in eviction_order(holds, 1.0, AGE, LINEAR)] == \
        ["c", "a", "b"]


def test_an_expired_hint_ends_before_an_unhinted_hold():
    holds = [_facts("hint0", 10.0, hint_s=0.0), _facts("plain", 0.0)]
    assert [v.request_id for v in eviction_order(holds, 11.0, PARAMS, LINEAR)] == \
        ["hint0", "plain"]


def test_a_hold_whose_next_turn_waits_here_ends_last_by_value_not_by_age():
    # "hinted" is worth the most by value; "waited"'s session has a turn here waiting
    # for P, whose pull of it is on its way.
    holds = [dataclasses.replace(_facts("waited", 0.0), awaited=True),
             _facts("hinted", 5.0, hint_s=600.0), _facts("plain", 10.0)]
    by_value = eviction_order(holds, 20.0, PARAMS, LINEAR)
    assert [v.request_id for v in by_value] == ["plain", "hinted", "waited"]
    assert by_value[-1].reuse == 1.0
    # The age rule (the comparison arm) ignores it: oldest first.
    assert [v.request_id for v in eviction_order(holds, 20.0, AGE, LINEAR)] == \
        ["waited", "hinted", "plain"]


# -------------------------------------------------------------------------- gaps

def test_gap_history_is_bounded_per_session_and_in_sessions():
    gaps = GapHistory(per_session=3, max_sessions=2)
    assert gaps.turn_arrived("a", 1.0) is None          # no held turn before
    for t in range(5):
        gaps.turn_ended("a", 10.0 * t)
        assert gaps.turn_arrived("a", 10.0 * t + t + 1) == t + 1
        assert gaps.turn_arrived("a", 99.0) is None      # one gap a turn
    assert gaps.gaps("a") == (3.0, 4.0, 5.0)
    gaps.turn_ended("b", 0.0)
    gaps.turn_ended("c", 0.0)                            # "a" least recently seen
    assert len(gaps) == 2 and gaps.gaps("a") == ()
    assert gaps.turn_arrived("a", 5.0) is None


# ------------------------------------------------------------- D's session holds

class _Stats:
    def __init__(self) -> None:
        self.data: dict[str, int] = {}

    def record(self, key: str, value: int | float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + value


def _table(params: RetentionParams, max_blocks: int = 8) -> SessionHolds:
    return SessionHolds(max_blocks, 0.5, HandlePublisher(None), retention=params,
                        recompute=lambda: LINEAR)


def _hold(table: SessionHolds, session: str, rid: str, now: float, hint_s=None,
          demoted: list | None = None, room: bool = True) -> None:
    got, history = table.lease(session, hint_s)
    facts = HoldFacts(request_id=rid, started_s=now, lease=got, history=history,
                      held_tokens=128, held_bytes=128 * 1024)

    def demote() -> bool:
        demoted.append(rid)
        return room
    table.hold(session, rid, now, got.lease_s, 1.0, num_blocks=4, facts=facts,
               demote=demote if demoted is not None else None)


@pytest.mark.parametrize("params, ended", [(PARAMS, "tb"), (AGE, "ta")])
def test_session_holds_end_by_value_and_demote_first(params, ended):
    """The older session was hinted: by value the younger unhinted hold ends (and is
    demoted to host first); by age (the control) the older one ends, undemoted."""
    table, ledger, stats, demoted = _table(params), GuardLedger("D", False, 5.0), \
        _Stats(), []
    _hold(table, "a", "ta", 0.0, hint_s=600.0, demoted=demoted)
    _hold(table, "b", "tb", 1.0, demoted=demoted)
    _hold(table, "c", "tc", 2.0, demoted=demoted)         # 12 > 8 blocks: one ends
    assert table.take_releases(3.0, ledger) == {ended}
    table.record_stats(stats)
    if params.mode is Retention.VALUE:
        assert demoted == [ended]
        assert stats.data["session_hold_ends_kv_pressure_host"] == 1
        assert stats.data["session_hold_leases_hint"] == 1
    else:
        assert demoted == []                             # the rule before: no demotion
        assert stats.data["session_hold_ends_kv_pressure_dropped"] == 1
        assert "session_hold_leases_hint" not in stats.data
    assert stats.data["session_hold_leases_default"] == (2 if params is PARAMS else 3)


def test_a_turn_waiting_for_p_keeps_its_sessions_hold_until_it_is_done_waiting():
    """Over the cap, the hold of a session whose next turn waits here (early decode)
    ends last; once that turn got P's parameters, the order is the value's again."""
    table, ledger = _table(PARAMS), GuardLedger("D", False, 5.0)
    _hold(table, "a", "ta", 0.0)
    _hold(table, "b", "tb", 1.0, hint_s=600.0)
    table.turn_waiting("a", "next-a")
    _hold(table, "c", "tc", 2.0)                         # 12 > 8 blocks: one ends
    assert table.take_releases(3.0, ledger) == {"tb"}    # not "ta", the least valuable
    table.turn_done_waiting("next-a")
    _hold(table, "d", "td", 4.0)                         # over again
    assert table.take_releases(5.0, ledger) == {"ta"}


def test_a_demotion_without_room_counts_as_dropped_and_a_lease_end_demotes_too():
    table, ledger, stats, demoted = _table(PARAMS, max_blocks=100), \
        GuardLedger("D", False, 5.0), _Stats(), []
    _hold(table, "a", "ta", 0.0, demoted=demoted, room=False)
    _hold(table, "b", "tb", 0.0, demoted=demoted)
    assert table.take_releases(121.0, ledger) == {"ta", "tb"}
    table.record_stats(stats)
    assert sorted(demoted) == ["ta", "tb"]
    assert stats.data["session_hold_ends_lease_ended_dropped"] == 1
    assert stats.data["session_hold_ends_lease_ended_host"] == 1


def test_observed_gaps_set_a_sessions_next_lease():
    table = _table(PARAMS, max_blocks=100)
    now = 0.0
    for turn in range(3):
        _hold(table, "s", f"t{turn}", now)
        now += 100.0                                     # 100 s between turns
        table.turn_arrived("s", now)
    got, history = table.lease("s", None)
    assert history.gaps_s == (100.0, 100.0, 100.0)
    assert got == Lease(200.0, LeaseSource.GAPS)


def test_config_switches_and_bounds():
    cfg = parse_config({"sessionkv": {"retention": "age"}})
    assert cfg.retention is Retention.AGE and cfg.retention_params().mode is Retention.AGE
    assert parse_config({}).retention_params() == RetentionParams(
        mode=Retention.VALUE, default_lease_s=120.0, min_lease_s=30.0, max_lease_s=600.0,
        gap_quantile=0.9, gap_margin=2.0, min_gaps=2, pressure_lease_cut=0.5)
    for bad, key in (({"retention": "oldest"}, "retention"),
                     ({"retention_min_lease_s": 5.0}, "retention_min_lease_s"),
                     ({"retention_max_lease_s": 10.0}, "retention_max_lease_s"),
                     ({"retention_gap_quantile": 0.0}, "retention_gap_quantile"),
                     ({"retention_min_gaps": 9}, "retention_min_gaps"),
                     ({"retention_max_sessions": 0}, "retention_max_sessions"),
                     ({"retention_pressure_lease_cut": 1.5},
                      "retention_pressure_lease_cut")):
        with pytest.raises(ConfigError, match=key):
            parse_config({"sessionkv": bad})
    # Under "age" the minimum lease need not exceed the expiry margin: it is unused.
    parse_config({"sessionkv": {"retention": "age", "retention_min_lease_s": 5.0}})
