"""Retention by value: each D hold's lease, and the order holds end in under pressure.

One rule, on plain data (no clock, no vLLM: the caller passes the time and the facts):

* **Lease** (:func:`lease`), set when the hold begins, from the first of:

  1. the client's hint (``X-Session-Hold-S``, forwarded by the proxy): that long;
  2. the session's observed inter-turn gaps on this engine, once there are
     ``min_gaps`` of them: their ``gap_quantile`` times ``gap_margin``;
  3. otherwise ``default_lease_s`` (``session_lease_s``).

  The first two are clamped into ``[floor, max_lease_s]``, where the floor is
  ``min_lease_s``, or the default lease if that is shorter.  Memory pressure shortens
  the last two: once holds pin more than half of their cap, the lease is cut by up to
  ``pressure_lease_cut`` (all of it at a full cap), never below the floor.  A hint is
  the client's word and is not cut.
* **Eviction order** (:func:`eviction_order`), when holds pin more than their cap:
  lowest value first.  A hold's value is its expected reuse times the recompute time
  it saves per byte it pins:

  - expected reuse, at ``t`` seconds into the hold: with a hint, 1 until the hint's
    time and 0 after; with observed gaps, the share of them longer than ``t``
    (``(longer + 1) / (gaps + 2)``, so no history is ever certain); with neither,
    ``0.5 * (1 - t / lease)`` (among such holds, older goes first, as before);
  - recompute saved per byte: ``recompute_time_s(tokens, 0)`` at the engine's
    (calibrated) price over the bytes the hold pins; the attention term makes long
    contexts worth more per byte.

  Superseded holds (a newer turn of the session holds its own blocks) go first; ties
  go oldest first.  A hold whose session's next turn already waits on this engine
  (sent early while P prefills, so P's pull of the hold is on its way) has a certain
  reuse: it ends last, after every hold whose next turn is only expected, since
  ending it now turns a pull that is coming into a refused claim and a recompute.

``Retention.AGE`` is the rule before: every lease ``default_lease_s``, oldest first
(superseded first).  It is the switch for comparisons (``retention: "age"``).
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_sessionkv.wire.cost import RecomputeModel, recompute_time_s

__all__ = ["DEMOTE_REASONS", "GapHistory", "HOLD_TIERS", "HoldFacts", "HoldValue", "Lease", "LeaseSource", "Retention",
           "RetentionParams", "SessionHistory", "eviction_order", "gap_quantile_s",
           "lease", "value"]


# Ends of a hold nobody read, after which its KV is demoted to the host tier (where
# there is one, under ``Retention.VALUE``), and where the KV went.
DEMOTE_REASONS = ("kv_pressure", "lease_ended")
HOLD_TIERS = ("host", "dropped")


class Retention(enum.Enum):
    """How D sets leases and picks which holds end under pressure."""

    VALUE = "value"   # this module's rule
    AGE = "age"       # one lease for all, oldest first (the rule before issue 47)


class LeaseSource(enum.Enum):
    """What set a hold's lease."""

    DEFAULT = "default"   # session_lease_s
    HINT = "hint"         # the client's X-Session-Hold-S
    GAPS = "gaps"         # the session's observed inter-turn gaps


@dataclass(frozen=True)
class RetentionParams:
    mode: Retention = Retention.VALUE
    default_lease_s: float = 120.0
    min_lease_s: float = 30.0
    max_lease_s: float = 600.0
    gap_quantile: float = 0.9
    gap_margin: float = 2.0
    min_gaps: int = 2
    pressure_lease_cut: float = 0.5


@dataclass(frozen=True)
class SessionHistory:
    """What this engine knows of a session when a turn's hold begins."""

    gaps_s: tuple[float, ...] = ()
    hint_s: float | None = None


@dataclass(frozen=True)
class Lease:
    lease_s: float
    source: LeaseSource


@dataclass(frozen=True)
class HoldFacts:
    """One running hold, as the order needs it."""

    request_id: str
    started_s: float
    lease: Lease
    history: SessionHistory
    held_tokens: int
    held_bytes: int
    superseded: bool = False
    awaited: bool = False    # the session's next turn waits on this engine


@dataclass(frozen=True)
class HoldValue:
    """A hold's value and the terms that made it."""

    request_id: str
    value: float
    reuse: float
    saved_s_per_byte: float
    superseded: bool
    started_s: float
    awaited: bool = False


def gap_quantile_s(gaps_s: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``gaps_s`` (the ceil(q*n)-th smallest)."""
    ordered = sorted(gaps_s)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def _clamp(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def lease(history: SessionHistory, params: RetentionParams, pressure: float) -> Lease:
    """The lease of a hold beginning now.  ``pressure``: blocks the holds pin over
    their cap (0 = none held, 1 = at the cap)."""
    if params.mode is Retention.AGE:
        return Lease(params.default_lease_s, LeaseSource.DEFAULT)
    floor = min(params.min_lease_s, params.default_lease_s)
    if history.hint_s is not None:
        return Lease(_clamp(history.hint_s, floor, params.max_lease_s), LeaseSource.HINT)
    if len(history.gaps_s) >= max(1, params.min_gaps):
        base = _clamp(gap_quantile_s(history.gaps_s, params.gap_quantile)
                      * params.gap_margin, floor, params.max_lease_s)
        source = LeaseSource.GAPS
    else:
        base, source = params.default_lease_s, LeaseSource.DEFAULT
    over_half = _clamp((pressure - 0.5) / 0.5, 0.0, 1.0)
    cut = base * (1.0 - params.pressure_lease_cut * over_half)
    return Lease(max(cut, min(base, floor)), source)


def _reuse(hold: HoldFacts, now_s: float) -> float:
    """Expected reuse of the hold, ``now_s - started_s`` into it (0..1)."""
    if hold.awaited:
        return 1.0
    t = max(0.0, now_s - hold.started_s)
    if hold.lease.source is LeaseSource.HINT:
        return 1.0 if t < (hold.history.hint_s or 0.0) else 0.0
    if hold.lease.source is LeaseSource.GAPS:
        gaps = hold.history.gaps_s
        return (sum(1 for g in gaps if g > t) + 1) / (len(gaps) + 2)
    lease_s = hold.lease.lease_s
    return 0.5 * max(0.0, 1.0 - t / lease_s) if lease_s > 0 else 0.0


def value(hold: HoldFacts, now_s: float, recompute: RecomputeModel) -> HoldValue:
    """What keeping ``hold`` is worth now: expected reuse times recompute seconds saved
    per byte pinned (0 for a superseded hold)."""
    saved = (recompute_time_s(hold.held_tokens, 0, recompute, 0.0) / hold.held_bytes
             if hold.held_bytes > 0 else 0.0)
    reuse = 0.0 if hold.superseded else _reuse(hold, now_s)
    return HoldValue(request_id=hold.request_id, value=reuse * saved, reuse=reuse,
                     saved_s_per_byte=saved, superseded=hold.superseded,
                     started_s=hold.started_s, awaited=hold.awaited)


def eviction_order(holds: Iterable[HoldFacts], now_s: float, params: RetentionParams,
                   recompute: RecomputeModel) -> list[HoldValue]:
    """The running holds in the order they end under pressure, first to end first:
    superseded first, then by value (``Retention.VALUE``: holds whose next turn
    already waits last) or by age (``AGE``, the rule before: it ignores that), ties
    oldest first."""
    values = [value(h, now_s, recompute) for h in holds]
    if params.mode is Retention.AGE:
        return sorted(values, key=lambda v: (not v.superseded, v.started_s))
    return sorted(values, key=lambda v: (not v.superseded, v.awaited, v.value,
                                         v.started_s))


class GapHistory:
    """Each session's last ``per_session`` inter-turn gaps on this engine, for at most
    ``max_sessions`` sessions (the least recently seen is forgotten first).

    A gap runs from the end of a turn this engine held to the arrival here of the
    session's next turn; a next turn served elsewhere leaves the gap open until one
    arrives (a longer gap: it errs towards a longer lease)."""

    def __init__(self, per_session: int, max_sessions: int) -> None:
        self._per_session = max(1, per_session)
        self._max_sessions = max(1, max_sessions)
        self._gaps: OrderedDict[str, tuple[float, ...]] = OrderedDict()
        self._ended_s: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._gaps)

    def turn_ended(self, session_id: str, now_s: float) -> None:
        self._ended_s[session_id] = now_s
        self._gaps[session_id] = self._gaps.get(session_id, ())
        self._trim(session_id)

    def turn_arrived(self, session_id: str, now_s: float) -> float | None:
        """A turn of ``session_id`` arrived: the gap it closes (recorded), if any."""
        ended = self._ended_s.pop(session_id, None)
        if ended is None:
            return None
        gap = max(0.0, now_s - ended)
        self._gaps[session_id] = (self._gaps.get(session_id, ()) + (gap,))[
            -self._per_session:]
        self._trim(session_id)
        return gap

    def gaps(self, session_id: str) -> tuple[float, ...]:
        return self._gaps.get(session_id, ())

    def _trim(self, session_id: str) -> None:
        self._gaps.move_to_end(session_id)
        while len(self._gaps) > self._max_sessions:
            old, _ = self._gaps.popitem(last=False)
            self._ended_s.pop(old, None)
