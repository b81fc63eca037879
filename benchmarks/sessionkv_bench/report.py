"""What every report's head states: the commit the run measured and the command as
typed, with no path of the machine it ran on.  Standard library only."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The code a run loads: a change there, uncommitted, is named in the report.
MEASURED = ("vllm_sessionkv", "proxy", "benchmarks")


def git(*argv: str) -> str:
    """``git argv`` in this checkout, its output stripped; "" when git fails."""
    try:
        return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def commit(paths: tuple[str, ...] = MEASURED) -> str:
    """The checkout's commit (12 hex digits), with " (with uncommitted changes)" when
    ``paths`` differ from it.  Outside git (a ``git archive`` copy) ``SESSIONKV_COMMIT``
    names it, else "?"."""
    head = git("rev-parse", "--short=12", "HEAD")
    if not head:
        return os.environ.get("SESSIONKV_COMMIT", "?")
    return head + (" (with uncommitted changes)" if git("status", "--porcelain", "--", *paths)
                   else "")


def public_command(script: str, argv: list[str], path_flags: dict[str, str]) -> str:
    """``python benchmarks/<script> argv`` as a report states it: the value of each flag
    in ``path_flags`` replaced by the name it maps to (``--model MODEL_DIR``), and any
    other absolute path by its last part."""
    out, hide = [], None
    for a in argv:
        if hide is not None:
            out.append(hide)
            hide = None
            continue
        flag, eq, _ = a.partition("=")
        if flag in path_flags:
            out.append(f"{flag}={path_flags[flag]}" if eq else a)
            hide = None if eq else path_flags[flag]
            continue
        out.append(Path(a).name if a.startswith("/") else a)
    return " ".join([f"python benchmarks/{script}", *out])


def machine_line() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, load average {load} at start")


def python_build(python: str) -> dict:
    """What a benchmark needs to say about an interpreter that runs a Python router:
    its version and how it was built.  The build matters: the same proxy code costs
    measurably less CPU on a distribution's CPython (Debian's links the interpreter
    into the executable) than on one built with pyenv's defaults (no
    ``--enable-optimizations``, the interpreter in ``libpython.so``), so a report names
    the one it ran on.  Exits when that interpreter cannot import the proxy."""
    probe = ("import json, platform, sys, sysconfig, sessionkv_proxy; "
             "args = sysconfig.get_config_var('CONFIG_ARGS') or ''; "
             "print(json.dumps({'executable': sys.executable, "
             "'version': platform.python_version(), 'prefix': sys.base_prefix, "
             "'compiler': platform.python_compiler(), "
             "'enable_optimizations': '--enable-optimizations' in args, "
             "'libpython_so': any('libpython' in line for line in open('/proc/self/maps'))"
             "}))")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{python} cannot run the proxy ({out.stderr.strip()[-300:]}); "
                         "install it there: <python> -m pip install -e '.[proxy]'")
    return json.loads(out.stdout)


def python_line(info: dict) -> str:
    """One line for a report, e.g. ``CPython 3.11.2 from /usr (GCC 12.2.0; the
    interpreter linked into the executable)``."""
    where = ("in libpython.so" if info["libpython_so"]
             else "linked into the executable")
    opt = "; configured --enable-optimizations" if info["enable_optimizations"] else ""
    return (f"CPython {info['version']} from {info['prefix']} ({info['compiler']}; the "
            f"interpreter {where}{opt})")


