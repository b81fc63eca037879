"""The engine-overhead benchmark states its command in the report without local paths:
each path-valued flag's value is named, not given.  Pure string work, milliseconds."""

from __future__ import annotations



import engine_overhead


def test_path_values_are_named_not_given():
    argv = ["--live", "--model", "/root/.cache/m", "--rounds", "4", "--out=/tmp/r.md",
            "--log-dir", "/tmp/logs", "--max-tokens", "48"]
    assert engine_overhead.public_command(argv) == (
        "python benchmarks/engine_overhead.py --live --model MODEL_DIR --rounds 4 "
        "--out=REPORT --log-dir LOG_DIR --max-tokens 48")


def test_other_values_are_kept():
    """The negative control: a command with no path flag comes back as given."""
    argv = ["--live", "--layout", "1p1d", "2p2d", "--real-model", "--gap-s", "1.5"]
    assert engine_overhead.public_command(argv) == (
        "python benchmarks/engine_overhead.py " + " ".join(argv))
