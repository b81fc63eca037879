"""Prefixes just routed count as held until the engines' own events take over."""

from __future__ import annotations

import pytest

from sessionkv_proxy.recent import RecentRoutes


def test_leading_keys_per_engine_and_a_divergence_stops_the_match():
    recent = RecentRoutes(ttl_s=30.0)
    recent.record([1, 2, 3, 4], ["d1"], now_s=100.0)
    recent.record([1, 2, 9], ["d2", "p1"], now_s=101.0)
    assert recent.overlaps([1, 2, 3, 4, 5], now_s=102.0) == {"d1": 4, "d2": 2, "p1": 2}
    assert recent.overlaps([1, 2, 9, 4], now_s=102.0) == {"d1": 2, "d2": 3, "p1": 3}
    assert recent.overlaps([7, 1, 2], now_s=102.0) == {}
    assert recent.overlaps([], now_s=102.0) == {}


def test_entries_expire_after_the_ttl():
    recent = RecentRoutes(ttl_s=10.0)
    recent.record([1, 2], ["d1"], now_s=100.0)
    recent.record([1], ["d2"], now_s=105.0)
    assert recent.overlaps([1, 2], now_s=109.0) == {"d1": 2, "d2": 1}
    assert recent.overlaps([1, 2], now_s=111.0) == {"d2": 1}
    assert recent.overlaps([1, 2], now_s=116.0) == {}
    # Routing the prefix again refreshes it.
    recent.record([1, 2], ["d1"], now_s=116.0)
    assert recent.overlaps([1, 2], now_s=120.0) == {"d1": 2}


def test_bounded_size_forgets_the_least_recently_routed():
    recent = RecentRoutes(ttl_s=30.0, max_keys=3)
    recent.record([1, 2], ["d1"], now_s=1.0)
    recent.record([3, 4], ["d2"], now_s=2.0)
    assert len(recent) == 3
    assert recent.overlaps([1], now_s=3.0) == {}  # evicted first
    assert recent.overlaps([3, 4], now_s=3.0) == {"d2": 2}


def test_zero_ttl_turns_it_off_and_bad_values_are_refused():
    off = RecentRoutes(ttl_s=0.0)
    off.record([1], ["d1"], now_s=1.0)
    assert off.overlaps([1], now_s=1.0) == {} and len(off) == 0
    with pytest.raises(ValueError):
        RecentRoutes(ttl_s=-1.0)
    with pytest.raises(ValueError):
        RecentRoutes(max_keys=0)


def test_placements_per_engine_within_the_window():
    recent = RecentRoutes(ttl_s=10.0)
    recent.record_placement("d1", now_s=100.0)
    recent.record_placement("d1", now_s=105.0)
    recent.record_placement("d2", now_s=108.0)
    # Routed prefixes alone are not placements.
    recent.record([1, 2], ["d2", "p1"], now_s=108.0)
    assert recent.placement_counts(now_s=109.0) == {"d1": 2, "d2": 1}
    assert recent.placement_counts(now_s=112.0) == {"d1": 1, "d2": 1}
    assert recent.placement_counts(now_s=120.0) == {"d1": 0, "d2": 0}
    off = RecentRoutes(ttl_s=0.0)
    off.record_placement("d1", now_s=1.0)
    assert off.placement_counts(now_s=1.0) == {}
