"""benchmarks/redis_memory.py on a real redis-server, small: every figure is measured
(a write that stored nothing, or a delta read before the writes landed, fails)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "redis_memory.py"


def test_redis_memory_figures_are_measured(free_port):
    spec = importlib.util.spec_from_file_location("redis_memory_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--port", str(free_port()), "--no-report"])
    args.blocks, args.sessions = 2_000, 200
    result = bench.run(args)
    # An index entry holds at least its 64-hex engine hash and 16-hex request key.
    assert result["index_first_engine_bytes_per_block"] > 80
    assert result["index_second_engine_bytes_per_block"] > 80
    # Redis keeps each value whole, plus its key and overhead.
    assert result["session_record_bytes_in_redis"] > result["session_record_bytes_encoded"]
    assert result["handle_bytes_in_redis"] > result["handle_bytes_encoded"] > 1000
