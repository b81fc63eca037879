"""chat_goodput's rate sweep on plain data: each target at each rate, its best goodput
over the rates, and ours over the best peer's (benchmarks/chat_goodput.py).  No aiperf,
no engines."""

from __future__ import annotations

import chat_goodput as bench
from sessionkv_bench import aiperf

LOAD = aiperf.ChatLoad(4, 3, 64, 8, 2, 1000.0, 200.0)


def _pooled(goodput: float) -> dict:
    return {"requests": 12, "errors": 0, "good_requests": 12, "goodput_rps": goodput,
            "aiperf_goodput_rps": goodput, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2,
            "itl_p50_s": 0.01, "itl_p99_s": 0.02, "latency_p50_s": 0.3,
            "latency_p99_s": 0.5}


def test_each_target_runs_at_each_rate_or_alone():
    urls, loads = bench.loads_at(LOAD, {"7-ours": "u1", "5-vr-rr": "u2"}, [0.5, 1.0])
    assert urls == {"7-ours@0.5": "u1", "7-ours@1": "u1", "5-vr-rr@0.5": "u2",
                    "5-vr-rr@1": "u2"}
    assert loads["7-ours@1"].request_rate == 1.0 and loads["5-vr-rr@0.5"].request_rate == 0.5
    urls, loads = bench.loads_at(LOAD, {"7-ours": "u1"}, [])
    assert urls == {"7-ours": "u1"} and loads["7-ours"].request_rate is None
    assert bench.split_run("7-ours@0.25") == ("7-ours", 0.25)
    assert bench.split_run("7-ours") == ("7-ours", None)


def test_the_headline_is_each_targets_best_rate_and_ours_over_the_best_peer():
    results = {"meta": {"targets": {}}, "load": LOAD.__dict__ | {"rates": [0.5, 1.0]},
               "targets": {"7-ours@0.5": {"pooled": _pooled(0.5)},
                           "7-ours@1": {"pooled": _pooled(0.9)},
                           "5-vr-rr@0.5": {"pooled": _pooled(0.45)},
                           "5-vr-rr@1": {"pooled": _pooled(0.3)},   # past its knee
                           "1-rr@0.5": {"failed": "aiperf exited 1"},
                           "1-rr@1": {"pooled": _pooled(0.6)}}}
    assert bench.best_goodput(results) == {"7-ours": (0.9, 1.0), "5-vr-rr": (0.45, 0.5),
                                           "1-rr": (0.6, 1.0)}
    text = "\n".join(bench.sweep_lines(results))
    assert "`7-ours` / best peer `1-rr`: 1.50x" in text


def test_a_sweep_where_no_run_met_the_slos_names_no_rate():
    results = {"meta": {"targets": {}}, "load": LOAD.__dict__ | {"rates": [0.5]},
               "targets": {"7-ours@0.5": {"pooled": _pooled(0.0)},
                           "1-rr@0.5": {"pooled": _pooled(0.0)}}}
    assert bench.best_goodput(results) == {"7-ours": (0.0, None), "1-rr": (0.0, None)}
    assert "`7-ours`: 0.000 req/s; no peer met the SLOs at any rate" in \
        "\n".join(bench.sweep_lines(results))
