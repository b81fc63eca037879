"""benchmarks/engine_latency.py's figures from known samples: ratios to the plain
engine pooled over rounds, per round, and back-to-back requests split by the engine
served just before (a neighbour's spin apart from the engine's own cost)."""

from __future__ import annotations

import engine_latency as bench


def _sample(rnd, spacing, engine, after, latency_s):
    return {"round": rnd, "spacing": spacing, "engine": engine, "after": after,
            "latency_s": latency_s}


def test_ratios_pool_rounds_and_split_by_the_engine_before():
    samples = []
    for rnd, scale in ((0, 1.0), (1, 2.0)):
        samples += [_sample(rnd, "back_to_back", "plain", "D", 1.0 * scale),
                    _sample(rnd, "back_to_back", "D", "plain", 3.0 * scale),
                    _sample(rnd, "back_to_back", "D", "P", 1.0 * scale),
                    _sample(rnd, "settled", "plain", None, 1.0 * scale),
                    _sample(rnd, "settled", "D", None, 1.1 * scale)]
    fig = bench.summarize(samples, ["D", "plain"])
    b2b = fig["back_to_back"]["D"]
    # D's pooled p50 (nearest rank of 1, 2, 3, 6) is 2; plain's (1, 2) is 1.
    assert b2b["p50_ratio"] == 2.0 and b2b["n"] == 4
    assert b2b["rounds"] == [1.0, 1.0]
    # After the plain engine D took 3 and 6 (p50 3), after P 1 and 2 (p50 1).
    assert b2b["after_plain_ratio"] == 3.0 and b2b["after_connector_ratio"] == 1.0
    settled = fig["settled"]["D"]
    assert round(settled["p50_ratio"], 6) == 1.1 and "after_plain_ratio" not in settled
    assert fig["settled"]["plain"]["p50_ratio"] == 1.0
