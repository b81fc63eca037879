"""A request-rate sweep's names and plot (``chat_goodput.py --rates``): each target at
each offered rate is one run, ``target@rate``.  Standard library only, but for the plot,
which the side venv's python runs (matplotlib lives there, the project's packages
do not)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot", "run_name", "split_run"]


def run_name(target: str, rate: float | None) -> str:
    """A target at one offered rate: ``7-ours@0.5`` (the target alone without one)."""
    return target if rate is None else f"{target}@{rate:g}"


def split_run(name: str) -> tuple[str, float | None]:
    target, _, rate = name.partition("@")
    return target, float(rate) if rate else None


def plot(json_path: str, out_dir: str, stem: str) -> None:
    """``stem``_sweep.png: goodput, TTFT p99 and ITL p99 against the offered rate, a
    line per target (run by the side venv's python: matplotlib lives there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    series: dict[str, list[tuple[float, dict]]] = {}
    for name, res in data["targets"].items():
        target, rate = split_run(name)
        if rate is not None and "pooled" in res:
            series.setdefault(target, []).append((rate, res["pooled"]))
    if not series:
        return
    panels = (("goodput_rps", "goodput (req/s meeting both SLOs)", 1.0),
              ("ttft_p99_s", "TTFT p99 (ms)", 1e3), ("itl_p99_s", "ITL p99 (ms)", 1e3))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5))
    for ax, (key, label, scale) in zip(axes, panels):
        for target, points in sorted(series.items()):
            points.sort(key=lambda p: p[0])
            ax.plot([r for r, _ in points], [(p[key] or 0.0) * scale for _, p in points],
                    marker="o", label=target)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out_dir) / f"{stem}_sweep.png", dpi=100)
    plt.close(fig)
