"""benchmarks/engine_latency.py's figures from known samples: ratios to the plain
engine pooled over rounds and per round, and vLLM's own timings split per engine."""

from __future__ import annotations

import engine_latency as bench


def _sample(rnd, spacing, engine, latency_s):
    return {"round": rnd, "spacing": spacing, "engine": engine, "latency_s": latency_s}


def test_ratios_pool_rounds():
    samples = []
    for rnd, scale in ((0, 1.0), (1, 2.0)):
        samples += [_sample(rnd, "back_to_back", "plain", 1.0 * scale),
                    _sample(rnd, "back_to_back", "D", 3.0 * scale),
                    _sample(rnd, "back_to_back", "D", 1.0 * scale),
                    _sample(rnd, "settled", "plain", 1.0 * scale),
                    _sample(rnd, "settled", "D", 1.1 * scale)]
    fig = bench.summarize(samples, ["D", "plain"])
    b2b = fig["back_to_back"]["D"]
    # D's pooled p50 (nearest rank of 1, 2, 3, 6) is 2; plain's (1, 2) is 1.
    assert b2b["p50_ratio"] == 2.0 and b2b["n"] == 4
    assert b2b["rounds"] == [1.0, 1.0]
    assert round(fig["settled"]["D"]["p50_ratio"], 6) == 1.1
    assert fig["settled"]["plain"]["p50_ratio"] == 1.0


def test_engine_split_means_vllm_timings_over_its_requests():
    samples = [_sample(0, sp, e, x) for sp in bench.SPACINGS for e, x in (("D", 0.3), ("plain", 0.1))]
    spans = [{"round": 0, "spacing": sp, "engine": e, "e2e_request_latency_seconds_count": 2.0,
              "e2e_request_latency_seconds_sum": 2 * x, "request_inference_time_seconds_sum": x}
             for sp in bench.SPACINGS for e, x in (("D", 0.25), ("plain", 0.08))]
    split = bench.engine_split(samples, spans, ["D", "plain"])
    assert split["settled"]["D"] == {"client": 0.3, "e2e": 0.25, "inference": 0.125}
    assert split["back_to_back"]["plain"]["inference"] == 0.04
