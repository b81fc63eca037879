"""sessionkv_bench.runner.interleaved: every arm once a round, the order reversed every
other round, each arm's results in round order.  Milliseconds."""

from __future__ import annotations

from sessionkv_bench.runner import interleaved, round_order


def test_interleaved_rounds_alternate_the_order():
    calls = []
    out = interleaved(["a", "b", "c"], 3, lambda name, r: calls.append((r, name)) or f"{name}{r}")
    assert calls == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                     (2, "a"), (2, "b"), (2, "c")]
    assert out == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"], "c": ["c0", "c1", "c2"]}
    assert round_order(["x"], 1) == ["x"] and interleaved([], 2, lambda n, r: 0) == {}
