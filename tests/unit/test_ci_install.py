"""ci/install.sh and ci/test.sh decide what a machine lacks and install only that.

Each test runs the real scripts on a fake fresh machine: a PATH holding the system's
commands except the ones a fresh Debian lacks or that would change this machine
(apt-get, python3, npm, node, redis-server, ip, ss, id, helm), and stand-ins for
them that record each call.  The fake apt-get "installs" a package by putting its
command on the fake PATH; the fake python3 cannot make a venv until python3-venv is
installed, as Debian's; the venv's python records every pip step.  Nothing is
downloaded and nothing on this machine changes.  About 2 s in all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Commands a fresh machine lacks or that must not run for real here.
HIDDEN = {"apt-get", "apt", "npm", "node", "redis-server", "redis-cli", "ip", "ss", "id",
          "helm", "sudo"}

FAKE_APT = """#!/usr/bin/env bash
echo "apt-get $*" >> "$CALLS"
[ "$1" = install ] || exit 0
for pkg in "$@"; do
  case $pkg in
    redis-server) printf '#!/bin/sh\\n' > "$FAKEBIN/redis-server"; chmod +x "$FAKEBIN/redis-server" ;;
    npm) printf '#!/bin/sh\\n' > "$FAKEBIN/npm"; chmod +x "$FAKEBIN/npm" ;;
    iproute2) for c in ip ss; do printf '#!/bin/sh\\n' > "$FAKEBIN/$c"; chmod +x "$FAKEBIN/$c"; done ;;
    python3-venv) touch "$STATE/ensurepip" ;;
  esac
done
"""

FAKE_ID = """#!/usr/bin/env bash
echo "${FAKE_UID:-0}"
"""

# The system python3: no ensurepip until python3-venv is installed (as on Debian).
FAKE_SYSTEM_PYTHON = """#!/usr/bin/env bash
echo "python3 $*" >> "$CALLS"
if [ "$1" = -c ]; then [ -e "$STATE/ensurepip" ]; exit; fi
if [ "$1" = -m ] && [ "$2" = venv ]; then
  [ -e "$STATE/ensurepip" ] || { echo "ensurepip is not available" >&2; exit 1; }
  mkdir -p "$3/bin"
  cp "$STATE/venv-python" "$3/bin/python"
  echo "export PATH=\\"$(cd "$3" && pwd)/bin:\\$PATH\\"" > "$3/bin/activate"
  exit 0
fi
exit 3
"""

# The venv's python: records each call; fails the step FAIL_ON names.
FAKE_VENV_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$CALLS"
if [ -n "$FAIL_ON" ] && [[ "$*" == *"$FAIL_ON"* ]]; then
  echo "ERROR: fake failure of: $*" >&2; exit 1
fi
case "$*" in
  *"install_chart_tools.py --check"*) [ -e "$STATE/chart-tools" ]; exit ;;
  *install_chart_tools.py*) command -v npm >/dev/null || exit 4; touch "$STATE/chart-tools" ;;
esac
"""


class FreshMachine:
    def __init__(self, root: Path):
        self.root = root
        self.repo = root / "repo"
        self.bin = root / "bin"
        self.state = root / "state"
        self.calls_file = root / "calls"
        for d in (self.repo / "ci", self.bin, self.state):
            d.mkdir(parents=True)
        for name in ("install.sh", "test.sh"):
            shutil.copy(REPO / "ci" / name, self.repo / "ci" / name)
        shutil.copy(REPO / "pyproject.toml", self.repo / "pyproject.toml")
        (self.repo / "tests" / "unit").mkdir(parents=True)
        (self.repo / "tests" / "deploy").mkdir(parents=True)
        for d in ("/usr/local/bin", "/usr/bin", "/bin"):
            for entry in Path(d).iterdir() if Path(d).is_dir() else ():
                name = entry.name
                if name in HIDDEN or name.startswith(("python", "pip")) \
                        or (self.bin / name).exists():
                    continue
                if os.access(entry, os.X_OK) and entry.is_file():
                    (self.bin / name).symlink_to(entry)
        self._script(self.bin / "apt-get", FAKE_APT)
        self._script(self.bin / "id", FAKE_ID)
        self._script(self.bin / "python3", FAKE_SYSTEM_PYTHON)
        self._script(self.state / "venv-python", FAKE_VENV_PYTHON)

    @staticmethod
    def _script(path: Path, text: str) -> None:
        path.write_text(text)
        path.chmod(0o755)

    def has(self, command: str) -> None:
        self._script(self.bin / command, "#!/bin/sh\n")

    def run(self, script: str, *args: str, uid: int = 0, fail_on: str = ""
            ) -> subprocess.CompletedProcess:
        env = {"PATH": str(self.bin), "HOME": str(self.root), "CALLS": str(self.calls_file),
               "STATE": str(self.state), "FAKEBIN": str(self.bin), "FAKE_UID": str(uid),
               "FAIL_ON": fail_on}
        if self.calls_file.exists():
            self.calls_file.unlink()
        return subprocess.run(["bash", f"ci/{script}", *args], cwd=self.repo, env=env,
                              capture_output=True, text=True, timeout=60)

    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []

    def apt_installs(self) -> list[str]:
        return [p for c in self.calls() if c.startswith("apt-get install")
                for p in c.split()[2:] if not p.startswith("-")]

    def pip_installs(self) -> list[str]:
        return [c for c in self.calls() if c.startswith("python -m pip install -e")]


@pytest.fixture
def machine(tmp_path) -> FreshMachine:
    return FreshMachine(tmp_path)


def test_fresh_root_machine_gets_what_the_tests_need_and_no_npm(machine):
    done = machine.run("install.sh")
    assert done.returncode == 0, done.stderr
    assert sorted(machine.apt_installs()) == ["iproute2", "python3-venv", "redis-server"]
    assert machine.pip_installs() == ["python -m pip install -e .[cpu,proxy,test,real-model]"]
    assert not any("install_chart_tools" in c for c in machine.calls())
    # one line says why each package is installed
    for why in ("redis-server missing", "python3-venv provides it", "iproute2"):
        assert why in done.stdout


def test_the_demo_installs_only_what_it_runs(machine):
    done = machine.run("install.sh", "--demo")
    assert done.returncode == 0, done.stderr
    assert sorted(machine.apt_installs()) == ["python3-venv", "redis-server"]
    assert machine.pip_installs() == ["python -m pip install -e .[cpu,proxy,real-model]"]


def test_a_rerun_skips_everything_and_needs_no_network(machine):
    assert machine.run("install.sh").returncode == 0
    done = machine.run("install.sh")
    assert done.returncode == 0, done.stderr
    assert machine.apt_installs() == []
    assert not any("pip" in c for c in machine.calls()), machine.calls()
    assert "already installed" in done.stdout
    # the tests' install covers the demo's
    assert machine.run("install.sh", "--demo").returncode == 0
    assert not any("pip" in c for c in machine.calls())


def test_a_changed_pyproject_reinstalls(machine):
    assert machine.run("install.sh", "--demo").returncode == 0
    assert machine.run("install.sh").returncode == 0          # the test extras added
    assert machine.pip_installs() == ["python -m pip install -e .[cpu,proxy,test,real-model]"]
    with open(machine.repo / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    assert machine.run("install.sh").returncode == 0
    assert len(machine.pip_installs()) == 1


def test_chart_tools_bring_npm_only_when_asked(machine):
    done = machine.run("install.sh", "--chart-tools")
    assert done.returncode == 0, done.stderr
    assert "npm" in machine.apt_installs()
    assert "python ci/install_chart_tools.py" in machine.calls()
    done = machine.run("install.sh", "--chart-tools")
    assert machine.apt_installs() == [] and "chart tools: already installed" in done.stdout


def test_installed_machine_installs_nothing(machine):
    for command in ("redis-server", "ip", "ss"):
        machine.has(command)
    (machine.state / "ensurepip").touch()
    done = machine.run("install.sh")
    assert done.returncode == 0, done.stderr
    assert not any(c.startswith("apt-get") for c in machine.calls())


def test_not_root_names_the_missing_package_and_stops(machine):
    done = machine.run("install.sh", uid=1000)
    assert done.returncode == 1
    assert "apt-get install redis-server python3-venv" in done.stderr
    assert not any(c.startswith("apt-get") for c in machine.calls())


@pytest.mark.parametrize("args, chart_tools", [
    ((), True),                                              # the whole suite
    (("tests/unit", "-q"), False),
    (("tests/unit", "-k", "tests/deploy"), False),           # an option's value
    (("tests",), True),
    (("tests/deploy/",), True),
    (("tests/unit", "tests/deploy::test_x"), True),
])
def test_test_sh_installs_chart_tools_only_for_the_tests_that_use_them(machine, args,
                                                                       chart_tools):
    done = machine.run("test.sh", *args)
    assert done.returncode == 0, done.stderr
    calls = machine.calls()
    assert any("install_chart_tools" in c for c in calls) == chart_tools
    assert ("npm" in machine.apt_installs()) == chart_tools
    pytest_calls = [c for c in calls if c.startswith("python -m pytest")]
    if args:
        assert pytest_calls == ["python -m pytest -ra -p no:cacheprovider " + " ".join(args)]
    else:   # the whole suite, in lanes
        assert [c.split(" -m ", 2)[-1] for c in pytest_calls] == [
            "not cluster and not bench tests", "cluster and not bench tests", "bench tests"]


@pytest.mark.parametrize("step", ["--upgrade pip", "-e .[cpu,proxy,test,real-model]", "uninstall",
                                  "import vllm_sessionkv"])
def test_a_failing_pip_step_fails_the_install_loudly(machine, step):
    done = machine.run("install.sh", fail_on=step)
    assert done.returncode != 0
    assert "fake failure" in done.stdout + done.stderr
    # and the next run tries again instead of skipping
    assert machine.run("install.sh").returncode == 0
    assert machine.pip_installs() == ["python -m pip install -e .[cpu,proxy,test,real-model]"]


def test_a_failing_chart_tools_step_fails_the_install(machine):
    done = machine.run("install.sh", "--chart-tools", fail_on="install_chart_tools.py")
    assert done.returncode != 0
