"""What the scheduler's components record into: the stats container's one method,
and growth of running totals kept elsewhere (the host tier, the guard's ledger)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

__all__ = ["StatsSink", "record_growth"]


class StatsSink(Protocol):
    def record(self, key: str, value: int | float = 1) -> None: ...


def record_growth(stats: StatsSink, keys: Iterable[str], counted: tuple[int, ...],
                  before: tuple[int, ...]) -> tuple[int, ...]:
    """Record how far each running total grew since ``before``; returns ``counted``
    (the next call's ``before``)."""
    for key, now, then in zip(keys, counted, before):
        if now > then:
            stats.record(key, now - then)
    return counted
