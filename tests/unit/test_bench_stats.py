"""The benchmarks' one percentile definition, pinned: nearest rank, the ceil(q * n)-th
smallest sample.  Every benchmark imports it from sessionkv_bench.stats; the two other
definitions the benchmarks used before (the int(q * n)-th 0-based sample; the
round(q * (n - 1))-th) give different values on these inputs, which is the control."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

from sessionkv_bench.stats import pct

TEN = [10, 1, 9, 2, 8, 3, 7, 4, 6, 5]          # 1..10, shuffled
HUNDRED = list(range(100, 0, -1))                # 1..100, reversed


@pytest.mark.parametrize("samples,q,want", [
    (TEN, 0.5, 5), (TEN, 0.9, 9), (TEN, 0.95, 10), (TEN, 0.99, 10), (TEN, 1.0, 10),
    (TEN, 0.01, 1), (TEN, 0.1, 1), (TEN, 0.11, 2),
    (HUNDRED, 0.5, 50), (HUNDRED, 0.99, 99), (HUNDRED, 0.995, 100),
    ([3.5], 0.5, 3.5), ([3.5], 0.99, 3.5), ([2, 1], 0.5, 1), ([2, 1], 0.51, 2),
])
def test_nearest_rank(samples, q, want):
    assert pct(samples, q) == want


def test_no_samples_and_a_bad_q():
    assert pct([], 0.5) is None
    for q in (0, 50, 99, -0.5, 1.01):
        with pytest.raises(ValueError, match="fraction"):
            pct(TEN, q)


def test_the_old_definitions_differ_on_these_inputs():
    """The control: had a benchmark kept int(q*n) or round(q*(n-1)), these inputs tell."""
    def int_qn(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def round_qn1(xs, q):
        xs = sorted(xs)
        return xs[round(q * (len(xs) - 1))]

    assert int_qn(TEN, 0.5) == 6 != pct(TEN, 0.5)
    assert round_qn1(HUNDRED, 0.99) == 99 and round_qn1(TEN, 0.9) == 9
    assert round_qn1(HUNDRED, 0.5) == 51 != pct(HUNDRED, 0.5)


def test_no_benchmark_defines_its_own():
    """One definition: no code under benchmarks/ but stats.py ranks samples by a q
    (``q * len(...)``, ``q / 100``) or defines a helper named like the old ones."""
    rank = re.compile(r"\bq\s*(?:\*\s*len\(|/\s*100\b)|def (?:_?pct|pct_ms|percentile_us|_p)\(")
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        if path.name == "stats.py" or any(p.startswith(".venv") for p in path.parts):
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if rank.search(line):
                found.append(f"{path.relative_to(BENCH)}:{no}: {line.strip()}")
    assert not found, found
    assert rank.search("return xs[min(len(xs) - 1, int(q * len(xs)))]")   # the control
    assert rank.search("xs[round(q / 100 * (len(xs) - 1))]")
