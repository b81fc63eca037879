"""Reading engines' and routers' Prometheus metrics: sums over label sets, histogram
means and quantiles, counter deltas.  ``requests`` is imported in ``_lines``, where it
is used: the side venv's python imports the benchmarks without it."""

from __future__ import annotations

import math


def _lines(url: str) -> list[str]:
    """The lines of an engine's or router's /metrics page."""
    import requests

    return requests.get(url + "/metrics", timeout=30).text.splitlines()


def _samples(url: str):
    """(name, line, value) of each sample on the /metrics page."""
    for line in _lines(url):
        if line.startswith("#"):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        yield line.split("{", 1)[0].split(" ", 1)[0], line, value


def metric_sums(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum each named Prometheus sample over its label sets; absent names are left out."""
    out: dict[str, float] = {}
    for name, _, value in _samples(url):
        if name in names:
            out[name] = out.get(name, 0.0) + value
    return out


def histogram_buckets(url: str, name: str) -> dict[float, float]:
    """A Prometheus histogram's cumulative bucket counts, ``le`` -> count, summed
    over its other labels."""
    out: dict[float, float] = {}
    for line in _lines(url):
        if line.startswith(name + "_bucket{") and 'le="' in line:
            le = float(line.split('le="', 1)[1].split('"', 1)[0])
            out[le] = out.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus's estimate: linear within the bucket the quantile falls in (the
    lower bound of the first bucket is 0; past the last finite bound, that bound)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below
                                           else 1.0)
        lower, below = le, count
    return lower


# ------------------------------------------------------------ engine counters
def engine_counters(url: str, prefixes: tuple[str, ...] = ("sessionkv_", "vllm:nixl_")
                    ) -> dict[str, float]:
    """Every counter (and histogram count and sum) of one engine named with one of
    ``prefixes``, summed over label sets that differ only in engine and model.
    Keys: ``name{label=value,...}``."""
    types: dict[str, str] = {}
    out: dict[str, float] = {}
    for line in _lines(url):
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind.strip()
            continue
        if not line.startswith(prefixes):   # comments and blank lines too
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        family = next((f for f in (name, name.removesuffix("_total"),
                                   name.removesuffix("_count"), name.removesuffix("_sum"))
                       if f in types), name)
        kind = types.get(family, "untyped")
        if kind == "gauge" or name.endswith(("_created", "_bucket")):
            continue
        if kind == "histogram" and not name.endswith(("_count", "_sum")):
            continue
        kept = []
        for pair in labels.rstrip("}").split(","):
            key, _, val = pair.partition("=")
            if key and key not in ("engine", "model_name"):
                kept.append(f"{key}={val.strip(chr(34))}")
        key = name + ("{" + ",".join(kept) + "}" if kept else "")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            pass
    return out


def counter_sum(counters: dict[str, float], *needles: str) -> float:
    """The counters whose key holds every needle, summed."""
    return sum(v for k, v in counters.items() if all(n in k for n in needles))


def counters_by_label(counters: dict[str, float], name: str) -> dict[str, float]:
    """``name{label=x}`` -> {x: value}."""
    out: dict[str, float] = {}
    for key, value in counters.items():
        if key.startswith(name + "{"):
            label = key[len(name) + 1:-1].split("=", 1)[-1]
            out[label] = out.get(label, 0.0) + value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What each counter of :func:`engine_counters` moved by (only those that moved)."""
    return {k: round(v - before.get(k, 0.0), 6) for k, v in sorted(after.items())
            if round(v - before.get(k, 0.0), 6)}
