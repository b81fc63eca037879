"""The agent benchmark's chat-text mode, ``--client chat --quick``, as a smoke test that
can fail: on the real model (float32, eager engines), a co-located pair (plain vLLM
round robin, our proxy) and ours in full (1P+1D), sessions in chat text with tools,
streamed and non-streamed turns, sub-agents and edited answers.

It checks that every turn answered, that ours' answers equal the co-located
reference's (token ids, top-5 logprobs and text), and that the text ceiling's
arithmetic holds together (per-turn sums, re-tokenization's kept tokens within the
ceiling, reuse within the ceiling).  No speed targets: the full run in
docs/benchmarks/agent_workload_chat.md is for those.

Cost on the 2-core machine: passed in 198 s under the cluster lock on 2026-12-05
(the test 171 s: two cluster starts of eager float32 engines, about 45 s each, the
reference and three arms of 8 turns; the ``real_model`` fixture's build 27 s, once per
test session, shared with test_real_model_chat.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIDE_PY = REPO / "benchmarks" / ".venv-router" / "bin" / "python"
STEM = "agent_workload_chat_quick"

pytestmark = [pytest.mark.cluster, pytest.mark.bench]


@pytest.mark.timeout(900)
def test_agent_workload_chat_quick(real_model, tmp_path):
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "agent_workload.py"), "--client", "chat",
         "--quick", "--enforce-eager", "--model-dir", real_model, "--out-dir", str(out_dir),
         "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=850, check=False)
    tail = proc.stdout[-4000:] + "\n" + proc.stderr[-6000:]
    assert proc.returncode == 0, tail
    check_chat_quick_report(out_dir)


def check_chat_quick_report(out_dir: Path) -> None:
    """The checks, on a finished ``--client chat --quick`` run's output directory."""
    data = json.loads((out_dir / f"{STEM}.json").read_text())
    assert not data["failures"], data["failures"]
    assert data["meta"]["client"] == "chat" and data["meta"]["dtype"] == "float32"
    runs = data["runs"]
    for wname, arms in data["meta"]["workload_arms"].items():
        assert "7-ours" in arms and set(runs[wname]) == set(arms), (wname, sorted(runs[wname]))
        ceil = data["ceilings"][wname]
        # The ceiling: per turn within the prompt, summing to the totals.
        per = ceil["per_step"]
        assert len(per) == ceil["steps"]
        assert all(0 <= c["reusable"] < c["prompt"] for c in per.values()), per
        assert sum(c["prompt"] for c in per.values()) == ceil["prompt_tokens"]
        assert sum(c["reusable"] for c in per.values()) == ceil["reusable_tokens"]
        assert all(c["reusable"] % 32 == 0 for c in per.values())
        # Re-tokenization: what a whole-answer turn keeps of the held KV is reusable.
        retok = ceil["retokenization"]
        for key, r in retok["per_step"].items():
            assert 0 <= r["kept"] <= r["ideal"], (key, r)
            assert r["kept"] <= per[key]["reusable"], (key, r, per[key])
        assert retok["lost_tokens"] == retok["ideal_tokens"] - retok["kept_tokens"] >= 0
        assert retok["turns"] + ceil["stripped_steps"] <= ceil["steps"]
        for arm, s in runs[wname].items():
            what = f"{wname}/{arm}"
            assert s["ok"] == s["steps"] == ceil["steps"], (what, s["first_error"])
            assert s["prompt_tokens"] == ceil["prompt_tokens"], what
            assert s["rendered_differently"] == 0, what
            assert 0 < s["computed_tokens"] <= 2 * s["prompt_tokens"], what
            # Reuse within the ceiling (whole blocks; a D->P pull may also bring D's
            # partial last block, at most 31 tokens a turn more).
            slack = 31 * s["ok"] if arm == "7-ours" else 0
            assert s["prompt_tokens"] - s["computed_tokens"] <= s["reusable_tokens"] + slack
            assert s["streamed_ok"] == ceil["streamed_steps"], what
            assert s["ttft_p50_s"] is not None and s["ttft_p50_s"] <= s["ttft_p99_s"], what
            assert s["mismatches"]["compared"] == s["ok"], what
            if arm.startswith(("1-", "2-")):
                assert s["bytes"] == 0, what
        # Ours is the product under test: every answer equals the reference's.
        for arm in ("2-ours-coloc", "7-ours"):
            s = runs[wname][arm]
            m = s["mismatches"]
            assert m["token"] == m["logprob_only"] == s["text_mismatches"] == 0, (
                what, m["examples"], s["text_mismatch_examples"])
        # P/D really ran: some turns went P -> D (the tool results exceed the proxy's
        # decode-only bound), and P's prompt tokens came through our accounting.
        assert runs[wname]["7-ours"]["routes"].get("disaggregated", 0) > 0, runs[wname][
            "7-ours"]["routes"]
        p = next(e for n, e in runs[wname]["7-ours"]["engines"].items() if n.startswith("P"))
        assert sum((p.get("sessionkv") or {}).values()) > 0, p
    text = (out_dir / f"{STEM}.md").read_text()
    for label in ("7 ours in full", "## Comparisons", "Ceiling (", "Re-tokenization"):
        assert label in text, label
    assert str(Path.home()) not in text and str(REPO) not in text
    if SIDE_PY.exists():
        for png in ("ttft", "reuse"):
            assert (out_dir / f"{STEM}_{png}.png").stat().st_size > 1000
