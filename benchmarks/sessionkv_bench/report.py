"""What every report's head states: the commit the run measured and the command as
typed, with no path of the machine it ran on.  Standard library only."""

from __future__ import annotations

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
