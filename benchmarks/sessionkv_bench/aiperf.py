"""aiperf as the load generator of the load-only scenarios: its command line, its own
venv, and its per-request export read into our statistics.

aiperf is a standard multi-turn load generator (``aiperf profile``): synthetic chat
sessions of several turns, each sent with a session header, with ``--goodput`` SLOs
(DistServe's goodput: requests per second that meet every SLO).  It runs as an external
command from ``benchmarks/.venv-aiperf`` (its dependencies pin numpy, pyzmq, fastapi and
transformers to other versions than vLLM's, so it stays out of the project's venv), and
with every ``AIPERF_*`` variable removed from its environment: aiperf reads each one as
a setting of its own.  Its export's per-request records (``profile_export.jsonl``) are
read back and summarized with our one percentile (``stats.pct``), not aiperf's
interpolated ones; aiperf's own goodput figure is kept beside ours as a check.

Standard library only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sessionkv_bench.stats import pct

VERSION = "0.13.0"
VENV = Path(__file__).resolve().parents[1] / ".venv-aiperf"
RECORDS = "profile_export.jsonl"
SUMMARY = "profile_export_aiperf.json"


@dataclass(frozen=True)
class ChatLoad:
    """One aiperf run: ``conversations`` synthetic chat sessions of ``turns`` turns,
    ``isl`` new prompt tokens a turn (aiperf sends the whole history with each turn),
    ``osl`` answer tokens (``ignore_eos``), ``concurrency`` sessions at once, and the
    SLOs a request must meet to count as good (milliseconds).  ``request_rate``
    (requests a second, aiperf's ``--request-rate``) paces the requests, with
    ``concurrency`` then their ceiling."""

    conversations: int
    turns: int
    isl: int
    osl: int
    concurrency: int
    ttft_slo_ms: float
    itl_slo_ms: float
    seed: int = 0
    session_header: str = "X-Session-ID"
    request_rate: float | None = None


def executable() -> Path:
    return VENV / "bin" / "aiperf"


def ensure_venv() -> Path:
    """``benchmarks/.venv-aiperf`` with aiperf ``VERSION``; its ``aiperf`` executable."""
    exe = executable()
    if exe.exists():
        probe = subprocess.run([str(VENV / "bin" / "python"), "-c",
                                "import importlib.metadata as m; print(m.version('aiperf'))"],
                               capture_output=True, text=True, check=False)
        if probe.stdout.strip() == VERSION:
            return exe
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                    f"aiperf=={VERSION}"], check=True)
    return exe


def environment() -> dict[str, str]:
    """This process's environment without ``AIPERF_*`` (aiperf's own settings)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AIPERF_")}


def command(url: str, model: str, tokenizer: str, load: ChatLoad, out_dir: Path) -> list[str]:
    """``aiperf profile`` for multi-turn streamed chat against ``url``."""
    return [
        str(executable()), "profile", "--url", url, "--endpoint-type", "chat", "--streaming",
        "--model", model, "--tokenizer", tokenizer,
        "--conversation-num", str(load.conversations),
        "--conversation-turn-mean", str(load.turns), "--conversation-turn-stddev", "0",
        "--prompt-input-tokens-mean", str(load.isl), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(load.osl), "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--concurrency", str(load.concurrency), "--session-header", load.session_header,
        "--goodput", f"time_to_first_token:{load.ttft_slo_ms:g} "
                     f"inter_token_latency:{load.itl_slo_ms:g}",
        "--random-seed", str(load.seed), "--output-artifact-dir", str(out_dir),
        "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
    ] + (["--request-rate", f"{load.request_rate:g}"] if load.request_rate else [])


def run(url: str, model: str, tokenizer: str, load: ChatLoad, out_dir: Path,
        log_path: Path) -> dict:
    """Run aiperf and summarize its export; raises RuntimeError (its log's end) when it
    fails."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        done = subprocess.run(command(url, model, tokenizer, load, out_dir),
                              env=environment(), stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"aiperf exited {done.returncode}: " + " | ".join(tail))
    return summarize([out_dir], load)


def _value(rec: dict, name: str) -> float | None:
    m = rec.get("metrics", {}).get(name)
    return None if m is None else m["value"]


def summarize(out_dirs: list[Path], load: ChatLoad) -> dict:
    """Figures from aiperf's exports in ``out_dirs`` (one run each), pooled: per-request
    TTFT, ITL (aiperf's per request: decode time over answer tokens less one) and
    latency in seconds with their p50 / p99, the requests meeting both SLOs, goodput
    (those per second of the runs' summed benchmark durations) and aiperf's own goodput
    over the same durations, to check ours by."""
    records, duration, aiperf_good, version = [], 0.0, 0.0, None
    for out_dir in out_dirs:
        records += [json.loads(line) for line in (out_dir / RECORDS).read_text().splitlines()
                    if line.strip()]
        summary = json.loads((out_dir / SUMMARY).read_text())
        run_s = summary["benchmark_duration"]["avg"]
        duration += run_s
        aiperf_good += summary.get("goodput", {}).get("avg", 0.0) * run_s
        version = summary.get("aiperf_version")
    profiled = [r for r in records
                if r.get("metadata", {}).get("benchmark_phase", "profiling") == "profiling"]
    ok = [r for r in profiled if not r.get("error") and _value(r, "request_latency") is not None]
    ttft = [_value(r, "time_to_first_token") / 1e3 for r in ok]
    itl = [_value(r, "inter_token_latency") / 1e3 for r in ok
           if _value(r, "inter_token_latency") is not None]
    latency = [_value(r, "request_latency") / 1e3 for r in ok]
    good = sum(1 for r in ok
               if _value(r, "time_to_first_token") <= load.ttft_slo_ms
               and (_value(r, "inter_token_latency") or 0.0) <= load.itl_slo_ms)
    out = {
        "requests": len(profiled), "errors": len(profiled) - len(ok),
        "good_requests": good, "duration_s": duration,
        "goodput_rps": good / duration if duration else None,
        "throughput_rps": len(ok) / duration if duration else None,
        "aiperf_goodput_rps": aiperf_good / duration if duration else None,
        "aiperf_version": version,
    }
    for key, xs in (("ttft", ttft), ("itl", itl), ("latency", latency)):
        out[f"{key}_p50_s"] = pct(xs, 0.5)
        out[f"{key}_p99_s"] = pct(xs, 0.99)
    return out
