"""benchmarks/compare_decisions.py on two hand-made reports: equal decisions count 0,
a changed pull (and a step one run lacks) count, timings never do."""

from __future__ import annotations

import json


from compare_decisions import compare_runs, main


def _step(route: str, pulled: int, computed: int, ttft: float, load: float = 0.0) -> dict:
    prefill = {"prompt_tokens": 600, "pulled_from_peer_tokens": pulled,
               "recomputed_tokens": computed, "priced_pull_ms": ttft * 3,
               "priced_engine_load": load, "decision": "d_to_p:pull:ok" if pulled else "none"}
    return {"prompt": 600, "ttft_s": ttft, "route": route, "reason": "session affinity",
            "handle": "attached", "prefill": json.dumps(prefill), "error": None}


def _report(steps: dict[str, dict]) -> dict:
    return {"meta": {"date": "d", "quick": True},
            "runs": {"r1": {"7-ours": {"step_detail": steps}, "1-rr": {"step_detail": {}}}},
            "probes": {"probe-r1": {"7-ours": [{"step": 0, "bytes": 10.0, "computed": 5.0}]}}}


def test_same_decisions_with_other_timings_do_not_differ():
    old = _report({"r1-s0/0": _step("disaggregated", 64, 10, 0.2)})
    new = _report({"r1-s0/0": _step("disaggregated", 64, 10, 0.9, load=2.0)})
    _, compared, differ = compare_runs(old, new)
    assert (compared, differ) == (2, 0)


def test_a_changed_pull_and_a_missing_step_differ(tmp_path):
    old = _report({"r1-s0/0": _step("disaggregated", 64, 10, 0.2),
                   "r1-s0/1": _step("decode_only", 0, 0, 0.1)})
    new = _report({"r1-s0/0": _step("disaggregated", 0, 74, 0.2)})
    lines, compared, differ = compare_runs(old, new)
    assert (compared, differ) == (3, 2)
    assert any("pulled_from_peer_tokens: 64 -> 0" in line for line in lines), lines
    paths = []
    for name, report in (("old", old), ("new", new)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    assert main([str(p) for p in paths]) == 1
    assert main([str(paths[0]), str(paths[0])]) == 0
