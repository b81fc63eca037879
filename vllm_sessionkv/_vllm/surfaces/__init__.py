"""Snapshots of the vLLM surface our contact code touches, one per vLLM release.

Each ``vllm-X.json`` was written by ``python -m vllm_sessionkv.dev.vllm_surface`` from
that release's wheel (parsed, never imported): for every vLLM name we import, every
method our subclasses of vLLM classes define, every private or ``getattr``'d
attribute ``_vllm/`` reaches, and the KV-event structs' fields, what the release has.
``differences`` says what changed between two releases; the engine names it when it
refuses a release that was only checked this way (``version.check_vllm_version``),
and ``tests/unit/test_vllm_surface.py`` checks the snapshots against our code.
Standard library only.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

__all__ = ["differences", "load", "versions"]

_HERE = Path(__file__).resolve().parent
SECTIONS = ("imports", "overrides", "attributes", "inherited_methods", "kv_event_fields")


def versions() -> list[str]:
    """The releases with a snapshot, oldest first."""
    found = [p.stem.removeprefix("vllm-") for p in _HERE.glob("vllm-*.json")]
    return sorted(found, key=lambda v: tuple(int(x) if x.isdigit() else 0
                                             for x in v.split(".")))


@cache
def load(version: str) -> dict | None:
    path = _HERE / f"vllm-{version}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _without_code(value):
    if isinstance(value, list):
        return [_without_code(v) for v in value]
    return re.sub(r" code [0-9a-f]+$", "", value) if isinstance(value, str) else value


def differences(base: str, other: str) -> list[str]:
    """One line per touched item that differs from ``base`` to ``other``: a name gone
    or added, a signature changed, or only the code behind it ("code changed")."""
    a, b = load(base), load(other)
    if a is None or b is None:
        missing = base if a is None else other
        return [f"no surface snapshot of vLLM {missing}"]
    out = []
    for section in SECTIONS:
        for key in sorted(set(a.get(section, {})) | set(b.get(section, {}))):
            old = a.get(section, {}).get(key, "not in snapshot")
            new = b.get(section, {}).get(key, "not in snapshot")
            if old == new:
                continue
            if _without_code(old) == _without_code(new):
                out.append(f"{section} {key}: code changed")
            elif isinstance(old, list) and isinstance(new, list):
                old, new = _without_code(old), _without_code(new)
                added = [str(x) for x in new if x not in old]
                removed = [str(x) for x in old if x not in new]
                out.append(f"{section} {key}: " + "; ".join(
                    ([f"added {', '.join(added)}"] if added else [])
                    + ([f"removed {', '.join(removed)}"] if removed else [])))
            else:
                out.append(f"{section} {key}: {_without_code(old)} -> {_without_code(new)}")
    return out
