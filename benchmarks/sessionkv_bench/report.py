"""What every report's head states: the commit the run measured and the command as
typed, with no path of the machine it ran on.  Standard library only."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "docs" / "benchmarks"   # where the committed reports live
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


def meta(script: str, argv: list[str], path_flags: dict[str, str]) -> dict:
    """What a report's head states, taken at the start of a run: date (UTC), commit,
    machine and the command as typed (``public_command``)."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(),
            "machine": machine_line(), "command": public_command(script, argv, path_flags)}


def head(title: str, meta: dict) -> list[str]:
    """A report's first lines: its title, then date, commit, machine and command (what
    tests/unit/test_benchmark_reports.py asks of every committed report)."""
    return [f"# {title}", "",
            f"{meta['date']}, commit {meta['commit']}. Machine: {meta['machine']}.",
            f"Command: `{meta['command']}`.", ""]


def table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table; None cells print as "-"."""
    cell = lambda x: "-" if x is None else str(x)  # noqa: E731
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows])


def ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds in a table cell; ``-`` for no figure."""
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def write(out_dir: Path, stem: str, data: dict, markdown: str,
          plot: tuple[str, str] | None = None) -> list[Path]:
    """``stem.json`` and ``stem.md`` under ``out_dir`` and, with ``plot`` (module,
    function), its figures: ``module.function(json_path, out_dir, stem)`` run by the side
    venv's python (matplotlib lives there; skipped when that venv is absent).  Refuses
    to write a path of this machine (a checkout, a temporary directory, a home) into a
    report.  Returns the files written."""
    text = json.dumps(data, indent=1, default=str) + "\n"
    local = re.compile(r"(?<![\w<])/(?:tmp|work|root|home)/(?![\w.-]+\.lock\b)[\w.-]")
    for found in (local.search(text), local.search(markdown)):
        if found or str(REPO) in text + markdown:
            raise ValueError(f"{stem}: the report would name a local path "
                             f"({found.group(0) if found else REPO})")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(text)
    md_path.write_text(markdown.rstrip("\n") + "\n")
    written = [json_path, md_path]
    if plot is not None:
        from sessionkv_bench.arms import SIDE_PY, call_in_side_venv

        if SIDE_PY.exists():
            err = call_in_side_venv(plot[0], plot[1], str(json_path), str(out_dir), stem)
            if err:
                raise RuntimeError(f"{stem}: plot failed: {err}")
            written += sorted(out_dir.glob(f"{stem}*.png"))
    return written
