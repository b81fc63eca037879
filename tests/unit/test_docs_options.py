"""docs/running.md lists every config key with its default, read from the structs.

The connector's keys (``SessionKVConfig``, ``cost.*``) are the rows of the table under
"### Engines"; the proxy's (``ProxyConfig`` and its nested structs, ``engines[].*``,
``routing.params.*`` from the policy's parameters) the rows under "#### Proxy config
keys".  Each field must have a row whose key cell names it and whose default cell
shows its default: a number equal to it, ``true``/``false``, the string in
backticks, each list element, "required" for a field without one, and some text for
``None`` (whose meaning is a platform or "off").  Rows that name no field fail too,
so a removed key leaves the docs with it.  The proxy's ``--help`` names the same
defaults as the struct.  Costs well under a second.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sessionkv_proxy import policy
from sessionkv_proxy.__main__ import _parser
from sessionkv_proxy.config import EngineConfig, ProxyConfig
from vllm_sessionkv.config import SessionKVConfig

RUNNING = Path(__file__).resolve().parents[2] / "docs" / "running.md"
REQUIRED = object()
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?(?![\w.])")


def _section(text: str, heading: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)   # "# comments" in code
    start = text.index(heading + "\n")
    level = heading.split(" ")[0]
    rest = text[start + len(heading):]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def _rows(section: str) -> dict[str, str]:
    """key -> default cell, for each table row of three or more cells."""
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) < 3 or cells[0] == "key":
            continue
        keys = re.findall(r"`([^`]+)`", cells[0])
        defaults = cells[1].split(", ") if len(keys) > 1 else [cells[1]]
        assert len(defaults) == len(keys), f"row {cells[0]}: one default per key"
        rows.update(zip(keys, defaults))
    return rows


def _fields(struct: Any, prefix: str = "", instance: Any = None) -> dict[str, Any]:
    """Dotted key -> default, nested structs flattened (their instance's values)."""
    out: dict[str, Any] = {}
    for f in msgspec.structs.fields(struct):
        if instance is not None:
            default = getattr(instance, f.name)
        elif f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = REQUIRED
        if isinstance(default, msgspec.Struct):
            out.update(_fields(type(default), f"{prefix}{f.name}.", default))
        else:
            out[prefix + f.name] = default
    return out


def connector_fields() -> dict[str, Any]:
    return _fields(SessionKVConfig)


def proxy_fields() -> dict[str, Any]:
    fields = _fields(ProxyConfig)
    del fields["routing.params"]   # a dict: its keys are the policy's parameters below
    fields.update(_fields(EngineConfig, "engines[]."))
    params = policy.routing_params_from_config({})
    fields.update(_fields(type(params), "routing.params.", params))
    fields["routing.params.kv_bytes_per_token"] = 0.0   # read by the router, not the policy
    return fields


def shows(cell: str, default: Any) -> bool:
    if default is REQUIRED:
        return cell.startswith("required")
    if default is None:
        return bool(cell)
    if isinstance(default, bool):
        return f"`{str(default).lower()}`" in cell
    if isinstance(default, (int, float)):
        return any(math.isclose(float(n), default, rel_tol=1e-9, abs_tol=0.0)
                   for n in NUMBER.findall(cell))
    if isinstance(default, str):
        return f"`{default}`" in cell
    if isinstance(default, list):
        return all(f"`{item}`" in cell for item in default)
    if hasattr(default, "value"):   # an enum
        return f"`{default.value}`" in cell
    raise AssertionError(f"no rule for a default of type {type(default).__name__}")


@pytest.mark.parametrize("heading, fields", [
    ("### Engines", connector_fields),
    ("#### Proxy config keys", proxy_fields),
])
def test_every_key_is_documented_with_its_default(heading, fields):
    rows = _rows(_section(RUNNING.read_text(), heading))
    expected = fields()
    missing = sorted(set(expected) - set(rows))
    assert not missing, f"{heading}: keys with no row: {missing}"
    wrong = {k: (rows[k], expected[k]) for k in expected if not shows(rows[k], expected[k])}
    assert not wrong, f"{heading}: default cells that do not show the default: {wrong}"
    unknown = sorted(set(rows) - set(expected))
    assert not unknown, f"{heading}: rows that name no config key: {unknown}"


def test_the_check_fails_on_a_wrong_default():
    """The negative control: a changed default or a dropped row is caught."""
    rows = _rows("| key | default | meaning |\n|---|---|---|\n"
                 "| `a`, `b` | `120`, none | x |\n| `c` | `2e-5` | y |\n")
    assert rows == {"a": "`120`", "b": "none", "c": "`2e-5`"}
    assert shows(rows["a"], 120.0) and not shows(rows["a"], 12.0)
    assert shows(rows["c"], 2e-05) and not shows(rows["c"], 2e-06)
    assert not shows("`false`", True) and not shows("", None)


def test_the_proxy_help_names_the_struct_defaults():
    help_text = " ".join(_parser().format_help().split())
    defaults = _fields(ProxyConfig)
    for flag, key in (("--host HOST", "host"), ("--port PORT", "port"),
                      ("--log-level LEVEL", "log_level"), ("--policy", "routing.policy"),
                      ("--tokenizer", "tokenizer")):
        start = help_text.index(flag, help_text.index("options:"))
        entry = help_text[start:start + 400]
        assert f"default {defaults[key]}" in entry or f"({defaults[key]})" in entry \
            or f"default: {defaults[key]}" in entry or f"'{defaults[key]}'" in entry, \
            (flag, entry[:200])
    for action in _parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
