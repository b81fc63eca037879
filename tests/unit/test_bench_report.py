"""sessionkv_bench.report, what every scenario's report is written with: its head
states what tests/unit/test_benchmark_reports.py asks of a committed report, its table
prints None as "-", and write() refuses a report that names a path of this machine.
Milliseconds."""

from __future__ import annotations

import json

import pytest
from sessionkv_bench import report
from test_benchmark_reports import CHECKS

META = {"date": "2026-12-06 07:00 UTC", "commit": "0123456789ab",
        "machine": "2 cores (AMD EPYC), 24 GiB RAM", "command": "python benchmarks/x.py --quick"}


def test_head_states_date_commit_machine_and_command():
    text = "\n".join(report.head("A scenario", META))
    assert [w for w, p in CHECKS.items() if not p.search(text)] == []
    assert text.startswith("# A scenario\n")


def test_table():
    assert report.table(["arm", "p99 ms"], [["ours", 12], ["theirs", None]]) == [
        "| arm | p99 ms |", "|---|---|", "| ours | 12 |", "| theirs | - |"]


def test_write_and_its_local_path_check(tmp_path):
    written = report.write(tmp_path, "x", {"a": 1}, "# x\n\nfine\n")
    assert [p.name for p in written] == ["x.json", "x.md"]
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1}
    assert (tmp_path / "x.md").read_text() == "# x\n\nfine\n"
    # The control: a temporary directory or the checkout in the report is refused.
    with pytest.raises(ValueError, match="local path"):
        report.write(tmp_path, "y", {"log": "/tmp/chat-goodput-1/x.log"}, "# y\n")
    with pytest.raises(ValueError, match="local path"):
        report.write(tmp_path, "y", {}, f"ran in {report.REPO}\n")
    # flock's lock file in /tmp is no path of the machine's (as the reports test says).
    report.write(tmp_path, "z", {}, "`flock /tmp/sessionkv-cluster.lock python x.py`\n")


def test_public_command_names_path_values_and_keeps_the_rest():
    flags = {"--model": "MODEL_DIR", "--out": "REPORT", "--log-dir": "LOG_DIR"}
    argv = ["--real-model", "--model", "/root/.cache/m", "--rounds", "4", "--out=/tmp/r.md",
            "--log-dir", "/tmp/logs", "--max-tokens", "48", "/work/x/data.json"]
    assert report.public_command("x.py", argv, flags) == (
        "python benchmarks/x.py --real-model --model MODEL_DIR --rounds 4 --out=REPORT "
        "--log-dir LOG_DIR --max-tokens 48 data.json")
    # The control: a command with no path in it comes back as given.
    argv = ["--layout", "1p1d", "2p2d", "--gap-s", "1.5"]
    assert report.public_command("x.py", argv, flags) == "python benchmarks/x.py " + " ".join(argv)
