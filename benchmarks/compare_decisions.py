"""Routing and pull decisions of two agent-benchmark runs, step by step, side by side.

    python benchmarks/compare_decisions.py OLD.json NEW.json [--arms 6-ours-nopull,7-ours]

OLD.json and NEW.json are ``benchmarks/agent_workload.py`` reports (``--out-dir``'s
``agent_workload*.json``), typically ``--quick`` runs of two commits: a restructure
that claims "behaviour unchanged" must route every step of our arms the same way.
For each regime and each of our arms this prints every step's decision as recorded
in both runs (the proxy's route kind and reason, the handle it attached, and P's
accounting: its decision, tokens pulled, hit locally, recomputed, refused), marks
the steps whose decisions differ, and counts them; then the probes' per-step bytes
moved and tokens computed.  Timings (TTFT, priced milliseconds, pull time) are left
out: they are measurements, not decisions.  Exits 1 when any step differs.

Two runs are still two runs: a decision that hinges on load (a pull priced against
a busy P, a route by least load) can flip between them.  Each step shows the load P
priced it at (``load=``, not compared), so a reader can tell such a flip from a
changed rule.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from sessionkv_bench.client import accounting

OUR_ARMS = ("6-ours-nopull", "7-ours")
# P's accounting fields that are decisions or their outcome in tokens.
_ACCOUNTING = ("decision", "pulled_from_peer_tokens", "local_hit_tokens",
               "pulled_from_host_tokens", "recomputed_tokens", "refused_by_verification_tokens")


def step_decision(detail: dict[str, Any]) -> dict[str, Any]:
    """The decisions one step record holds (``runs[regime][arm]["step_detail"][step]``)."""
    prefill = accounting(detail.get("prefill"))   # P's, the x-sessionkv-prefill header
    decision = {"route": detail.get("route"), "reason": detail.get("reason"),
                "handle": detail.get("handle")}
    for key in ("prefill_engine", "decode_engine"):     # recorded by newer reports only
        if key in detail:
            decision[key] = detail[key]
    decision.update({k: prefill.get(k, 0 if k != "decision" else None) for k in _ACCOUNTING})
    if detail.get("error"):
        decision["error"] = detail["error"]
    return decision


def _step_order(step: str) -> tuple:
    """``r1-s3/12`` sorts by session, then step, numerically."""
    return tuple(int(n) if n.isdigit() else n for n in re.split(r"(\d+)", step))


def _short(decision: dict[str, Any] | None) -> str:
    if decision is None:
        return "-"
    parts = [f"{decision['route']}", f"[{decision['reason']}]", f"handle={decision['handle']}"]
    if decision.get("decision"):
        parts.append(str(decision["decision"]))
    parts.append("pulled/local/computed/refused="
                 f"{decision['pulled_from_peer_tokens']}/{decision['local_hit_tokens']}/"
                 f"{decision['recomputed_tokens']}/{decision['refused_by_verification_tokens']}")
    if decision.get("pulled_from_host_tokens"):
        parts.append(f"host={decision['pulled_from_host_tokens']}")
    for key in ("prefill_engine", "decode_engine"):
        if key in decision:
            parts.append(f"{key[0].upper()}={decision[key]}")
    if decision.get("error"):
        parts.append(f"error={str(decision['error'])[:40]}")
    return " ".join(parts)


def _pairs(old: dict, new: dict, section: str, arms: tuple[str, ...]):
    """(key, arm, old's entry, new's entry) under ``section`` ("runs", "probes") for each
    key (a regime, a probe) and arm that either report has."""
    for key in sorted(set(old.get(section, {})) | set(new.get(section, {}))):
        for arm in arms:
            a, b = (run.get(section, {}).get(key, {}).get(arm) for run in (old, new))
            if a is not None or b is not None:
                yield key, arm, a, b


def compare_runs(old: dict, new: dict, arms: tuple[str, ...] = OUR_ARMS
                 ) -> tuple[list[str], int, int]:
    """Printable lines, the number of steps compared and the number that differ."""
    lines: list[str] = []
    compared = differ = 0
    for regime, arm, a, b in _pairs(old, new, "runs", arms):
        steps_a = (a or {}).get("step_detail", {})
        steps_b = (b or {}).get("step_detail", {})
        rows, n_diff = [], 0
        all_steps = sorted(set(steps_a) | set(steps_b), key=_step_order)
        for step in all_steps:
            da = step_decision(steps_a[step]) if step in steps_a else None
            db = step_decision(steps_b[step]) if step in steps_b else None
            same = da == db
            n_diff += not same
            load = [accounting(steps[step].get("prefill")).get("priced_engine_load")
                    for steps in (steps_a, steps_b) if step in steps]
            rows.append(f"  {'  ' if same else '!='} {step:<14} {_short(da):<70} | "
                        f"{'(same)' if same else _short(db)}"
                        + (f"  load={load}" if any(x for x in load) else ""))
            if not same and da and db:
                changed = [k for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)]
                rows.append(f"     {'':<14} differs in: " + ", ".join(
                    f"{k}: {da.get(k)!r} -> {db.get(k)!r}" for k in changed))
        compared += len(all_steps)
        differ += n_diff
        missing = "" if a is not None and b is not None else " (arm missing in one run)"
        lines.append(f"{regime} / {arm}: {n_diff} of {len(all_steps)} steps differ{missing}")
        lines.extend(rows)
    for probe, arm, a, b in _pairs(old, new, "probes", arms):
        pa = [(s.get("step"), s.get("bytes"), s.get("computed")) for s in a or []]
        pb = [(s.get("step"), s.get("bytes"), s.get("computed")) for s in b or []]
        n_diff = sum(x != y for x, y in zip(pa, pb)) + abs(len(pa) - len(pb))
        compared += max(len(pa), len(pb))
        differ += n_diff
        lines += [f"{probe} / {arm}: {n_diff} of {max(len(pa), len(pb))} probe steps differ "
                  "(bytes, computed per step)", f"     old: {[(b_, c) for _, b_, c in pa]}",
                  f"     new: {[(b_, c) for _, b_, c in pb]}"]
    return lines, compared, differ


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--arms", default=",".join(OUR_ARMS),
                   help=f"comma-separated arms to compare (default {','.join(OUR_ARMS)})")
    args = p.parse_args(argv)
    old, new = (json.loads(path.read_text()) for path in (args.old, args.new))
    for name, run in (("old", old), ("new", new)):
        meta = run.get("meta", {})
        print(f"{name}: {meta.get('date')} quick={meta.get('quick')} "
              f"regimes {sorted(run.get('runs', {}))}")
    lines, compared, differ = compare_runs(old, new, tuple(args.arms.split(",")))
    print("\n".join(lines))
    print(f"\n{differ} of {compared} steps differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
