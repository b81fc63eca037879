"""Every benchmark report under docs/benchmarks/ states its date, commit, machine and
command near its top, and no report or its JSON embeds a path of the machine it ran
on (a checkout, a venv, a temporary directory, a home).  Reports are written by the
benchmarks; this keeps the ones committed honest.  Well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPORTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
HEAD_LINES = 20
# (A lock file in /tmp, as the project's "flock /tmp/...lock" convention names it, is
# not a path of the machine's.)
LOCAL_PATH = re.compile(r"(?<![\w<])/(?:tmp|work|root|home)/(?![\w.-]+\.lock\b)[\w.-]")
CHECKS = {
    "date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "commit": re.compile(r"\b[Cc]ommit\b[^\n]*\b[0-9a-f]{7,40}\b"),
    "machine": re.compile(r"\b[Mm]achine\b[^\n]*\bcores?\b"),
    "command": re.compile(r"`[^`]*benchmarks/\w+\.py[^`]*`"),
}


def reports() -> list[Path]:
    return sorted(REPORTS.glob("*.md"))


@pytest.mark.parametrize("report", reports(), ids=lambda p: p.name)
def test_a_report_states_date_commit_machine_and_command(report):
    head = "\n".join(report.read_text().splitlines()[:HEAD_LINES])
    missing = [what for what, pattern in CHECKS.items() if not pattern.search(head)]
    assert not missing, f"{report.name}: its first {HEAD_LINES} lines state no {missing}"


@pytest.mark.parametrize("path", sorted(REPORTS.glob("*.md")) + sorted(REPORTS.glob("*.json")),
                         ids=lambda p: p.name)
def test_no_local_paths(path):
    found = sorted(set(LOCAL_PATH.findall(path.read_text())))
    assert not found, f"{path.name} embeds local paths starting {found}"


def test_the_checks_catch_a_bare_report():
    """The negative control."""
    bare = "# A benchmark\n\nRan on /tmp/x/model.\n"
    assert [w for w, p in CHECKS.items() if not p.search(bare)] == list(CHECKS)
    assert LOCAL_PATH.findall(bare) and not LOCAL_PATH.findall(
        "<tmp>/model /usr/bin/python3 flock /tmp/sessionkv-cluster.lock")
