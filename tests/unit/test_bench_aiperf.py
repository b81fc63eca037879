"""aiperf's export read into our statistics (sessionkv_bench.aiperf), on a committed
small export: aiperf 0.13.0, 4 chat sessions x 3 turns, streamed, against a stub
server (tests/unit/data/aiperf_chat/; records cut to the metrics read, the summary to
its totals).  Also the command line and the environment aiperf gets.  Milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

from sessionkv_bench import aiperf
from sessionkv_bench.stats import pct

EXPORT = Path(__file__).resolve().parent / "data" / "aiperf_chat"


def load(ttft_ms: float, itl_ms: float) -> aiperf.ChatLoad:
    return aiperf.ChatLoad(conversations=4, turns=3, isl=64, osl=8, concurrency=2,
                           ttft_slo_ms=ttft_ms, itl_slo_ms=itl_ms)


def test_figures_from_the_export():
    s = aiperf.summarize([EXPORT], load(100, 50))
    assert (s["requests"], s["errors"], s["aiperf_version"]) == (12, 0, "0.13.0")
    # Nearest rank over the 12 TTFTs (ms): 5.849 ... 8.524 (6th) ... 29.391 (12th).
    assert round(s["ttft_p50_s"] * 1e3, 3) == 8.524
    assert round(s["ttft_p99_s"] * 1e3, 3) == 29.391
    assert round(s["latency_p50_s"] * 1e3, 3) == 51.642
    # aiperf's own p50 interpolates; ours is a sample of the run (the control).
    summary = json.loads((EXPORT / aiperf.SUMMARY).read_text())
    assert round(summary["time_to_first_token"]["p50"], 3) == 8.627
    # Every request met the run's SLOs (100 ms, 50 ms): ours agrees with aiperf's
    # per-request verdicts, and its goodput is those over the run's duration.
    records = [json.loads(x) for x in (EXPORT / aiperf.RECORDS).read_text().splitlines()]
    assert s["good_requests"] == sum(r["metrics"]["good_request_count"]["value"]
                                     for r in records) == 12
    assert s["goodput_rps"] == 12 / summary["benchmark_duration"]["avg"]
    assert abs(s["aiperf_goodput_rps"] - summary["goodput"]["avg"]) < 1e-9


def test_tighter_slos_count_fewer_good_requests():
    """TTFT <= 10 ms and ITL <= 4 ms: 7 of the 12 (two first turns and two others miss
    TTFT, one ITL), worked out by hand from the records."""
    assert aiperf.summarize([EXPORT], load(10, 4))["good_requests"] == 7
    assert aiperf.summarize([EXPORT], load(1, 50))["good_requests"] == 0


def test_rounds_pool():
    """Two runs' exports pool: twice the requests, the same percentiles."""
    one, two = aiperf.summarize([EXPORT], load(10, 4)), aiperf.summarize([EXPORT] * 2, load(10, 4))
    assert (two["requests"], two["good_requests"]) == (24, 14)
    assert two["ttft_p50_s"] == one["ttft_p50_s"] and two["goodput_rps"] == one["goodput_rps"]


def test_command_and_environment(monkeypatch, tmp_path):
    argv = aiperf.command("http://127.0.0.1:1", "tiny", "/tok", load(500, 80), tmp_path)
    assert argv[1] == "profile" and "--streaming" in argv
    assert argv[argv.index("--session-header") + 1] == "X-Session-ID"
    assert argv[argv.index("--goodput") + 1] == "time_to_first_token:500 inter_token_latency:80"
    assert "--request-rate" not in argv
    paced = aiperf.command("http://127.0.0.1:1", "tiny", "/tok",
                           aiperf.ChatLoad(4, 3, 64, 8, 2, 500, 80, request_rate=0.5), tmp_path)
    assert paced[paced.index("--request-rate") + 1] == "0.5"
    assert paced[paced.index("--concurrency") + 1] == "2"      # the ceiling
    monkeypatch.setenv("AIPERF_SERVICE_RECORD_PROCESSOR_BATCH_SIZE", "1")
    monkeypatch.setenv("SESSIONKV_SOMETHING", "kept")
    env = aiperf.environment()
    assert not [k for k in env if k.startswith("AIPERF_")] and env["SESSIONKV_SOMETHING"] == "kept"


def test_pct_is_the_one_definition():
    assert aiperf.pct is pct
