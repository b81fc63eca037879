"""The agent benchmark's ``--quick`` smoke run: every arm it runs ran (all but
``QUICK_SKIPS``: 3-nixl-rr, 4-nixl-bidi and 6-ours-nopull), and the numbers it prints
agree with each other (no targets: the full run in docs/benchmarks is for those).

It starts two two-engine clusters one after the other (co-located, ours), a minute or
so each on the 2-core CI machine, which is most of its run: 308 s under the cluster
lock on 2026-12-07 with the stock-NIXL cluster too (96 s of it), 538 s with
4-nixl-bidi and 6-ours-nopull as well (the side venv, about 60 s once per checkout,
already there).  The stock-NIXL arms' engines start in the cluster lane
(tests/e2e/test_session_reuse.py's control); their router runs in the full benchmark
only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIDE_PY = REPO / "benchmarks" / ".venv-router" / "bin" / "python"

pytestmark = [pytest.mark.cluster, pytest.mark.bench]

# Arms that run a peer's code (stock NIXL, vllm-router) rather than ours or plain vLLM.
PEER_ARMS = ("3-", "4-", "5-")


@pytest.mark.timeout(1500)
def test_agent_workload_quick(tmp_path):
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        # Eager, as every test engine (tests/cluster.py TEST_ENGINE_ARGS): no compile
        # warm-up in each of the arms' engine starts.
        [sys.executable, str(REPO / "benchmarks" / "agent_workload.py"), "--quick",
         "--enforce-eager", "--out-dir", str(out_dir), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=1450, check=False)
    tail = (proc.stdout[-4000:] + "\n" + proc.stderr[-6000:])
    assert proc.returncode == 0, tail
    check_quick_report(out_dir)


def check_quick_report(out_dir: Path) -> None:
    """The checks, on a finished ``--quick`` run's output directory."""
    data = json.loads((out_dir / "agent_workload_quick.json").read_text())
    assert not data["failures"], data["failures"]
    runs = data["runs"]
    wanted = data["meta"]["workload_arms"]
    for wname, arms in wanted.items():
        if wname.startswith("probe-"):
            assert set(data["probes"][wname]) == set(arms), wname
            for arm, steps in data["probes"][wname].items():
                assert all(s["status"] == 200 for s in steps), (wname, arm, steps)
                # A co-located arm moves no KV; a P/D arm moves some on every step.
                if arm.startswith(("1-", "2-")):
                    assert all(s["bytes"] == 0 for s in steps), (arm, steps)
            continue
        assert set(runs[wname]) == set(arms), (wname, sorted(runs[wname]))
        ceil = data["ceilings"][wname]
        for arm, s in runs[wname].items():
            what = f"{wname}/{arm}"
            assert s["steps"] == ceil["steps"], what
            if arm.startswith(PEER_ARMS) and s["not_finished"]:
                # A peer's stall is its measurement, not our failure: CI once saw stock
                # NIXL's D wait two minutes on a read P had released at its lease (the
                # report counts such steps). Every other step must still have answered.
                assert s["ok"] + s["not_finished"] == s["steps"], (what, s["first_error"])
                assert s["ok"] > 0, what
                assert s["prompt_tokens"] <= ceil["prompt_tokens"], what
            else:
                assert s["ok"] == s["steps"], (what, s["first_error"])
                assert s["prompt_tokens"] == ceil["prompt_tokens"], what
            # Each of the two engines computes at most every prompt token it sees.
            assert 0 < s["computed_tokens"] <= 2 * s["prompt_tokens"], what
            assert s["reuse_factor"] == pytest.approx(s["prompt_tokens"] / s["computed_tokens"])
            assert s["computed_per_step"] == pytest.approx(s["computed_tokens"] / s["ok"])
            if s["share_of_max"] is not None and arm != "4-nixl-bidi":
                # At least the tokens no earlier request computed are computed again.
                # Not for arm 4: stock bidirectional attaches D's blocks unverified, so
                # it can "reuse" blocks whose tokens differ (its mismatches show it).
                # The ceiling counts whole blocks (a prefix cache's unit); a D->P pull
                # also brings D's partial last block, at most 31 tokens a step more.
                slack = 31 * s["ok"] if arm == "7-ours" else 0
                reused = s["prompt_tokens"] - s["computed_tokens"]
                assert reused <= s["reusable_tokens"] + slack, what
            assert s["ttft_p50_s"] <= s["ttft_p99_s"], what
            assert s["itl_p50_s"] is None or s["itl_p50_s"] <= s["itl_p99_s"], what
            assert sum(s["requests_per_engine"]) >= s["ok"], what
            m = s["mismatches"]
            assert m["compared"] == s["ok"], what
            assert m["stripped_compared"] <= m["compared"], what
            if arm.startswith(("1-", "2-")):
                assert s["bytes"] == 0, what
    # Ours is the product under test: its answers equal the reference's everywhere.
    for wname in runs:
        for arm in ("6-ours-nopull", "7-ours"):
            if arm in runs[wname]:
                m = runs[wname][arm]["mismatches"]
                assert m["token"] == m["logprob_only"] == 0, (wname, arm, m["examples"])
    text = (out_dir / "agent_workload_quick.md").read_text()
    for label in ("1 co-located + round robin", "7 ours in full", "## Headlines"):
        assert label in text
    if SIDE_PY.exists():
        for png in ("computed_per_step", "ttft", "bytes_per_step"):
            assert (out_dir / f"agent_workload_quick_{png}.png").stat().st_size > 1000
