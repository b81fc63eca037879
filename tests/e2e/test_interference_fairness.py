"""The interference benchmark refuses arms whose engines differ where the fairness
rules forbid it.

Real engines on the tiny model: a co-located arm started with prefix caching off
and a P/D arm with it on.  The script starts both, reads each engine's resolved
config back (``/server_info``), and must stop before any load with exit code 2,
naming ``cache_config.enable_prefix_caching`` and nothing else: every other key in
which real co-located and P/D engines differ (the chunked-prefill budget, the
connector, ports, cores) is one the rules expect.  The unit tests
(``tests/unit/test_interference.py``) hold the negative controls of the comparison
itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_arms_with_prefix_caching_on_one_side_only_are_refused(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "interference.py"), "--check-only",
         "--tiny-model", "--max-num-batched-tokens", "256", "--pd-modes", "defaults",
         "--coloc-extra-args=--no-enable-prefix-caching",
         "--out-dir", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=850, check=False)
    tail = proc.stdout[-3000:] + "\n" + proc.stderr[-5000:]
    assert proc.returncode == 2, tail
    assert "REFUSED: engine configs differ in keys the arms must share" in proc.stderr, tail
    block = proc.stderr.split("REFUSED:", 1)[1]
    named = set(re.findall(r"^  (\S+): ", block, re.MULTILINE))
    assert named == {"cache_config.enable_prefix_caching"}, tail
    # Both arms were started and read back before the refusal.
    assert {"coloc-256/coloc0", "pd/P0"} <= set(re.findall(r"(\S+/\w+\d)=", block)), tail
    assert not (tmp_path / "out").exists(), "a refused run writes no report"
