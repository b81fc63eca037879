"""The benchmarks' one percentile definition.  Standard library only: the side venv's
python imports the benchmarks to draw their figures."""

from __future__ import annotations

import math


def pct(samples, q: float) -> float | None:
    """Nearest-rank percentile: the smallest sample with at least ``q`` of the samples
    at or below it, that is the ``ceil(q * n)``-th smallest (1-based) of ``n``; ``q`` is
    a fraction (0.99, not 99).  None for no samples.

    Reports committed before 2026-12-06 by soak.py, kv_pressure.py, routing_bench.py and
    index_bench.py took the ``int(q * n)``-th (0-based) sample, and engine_overhead.py /
    overhead_live.py the ``round(q * (n - 1))``-th; their figures were not recomputed."""
    if not 0 < q <= 1:
        raise ValueError(f"percentile q={q!r} is not a fraction in (0, 1]")
    ordered = sorted(samples)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
