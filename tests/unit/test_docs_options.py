"""docs/running.md lists every config key with its default, read from the structs.

The connector's keys (``SessionKVConfig``, ``cost.*``) are the rows of the table under
"### Engines"; the proxy's (``ProxyConfig`` and its nested structs, ``engines[].*``,
``routing.params.*`` from the policy's parameters) the rows under "#### Proxy config
keys".  Each field must have a row whose key cell names it and whose default cell
shows its default: a number equal to it, ``true``/``false``, the string in
backticks, each list element, "required" for a field without one, and some text for
``None`` (whose meaning is a platform or "off").  Rows that name no field fail too,
so a removed key leaves the docs with it.  The proxy's ``--help`` names the same
defaults as the struct.

The same holds for the command lines (each option of the launcher
``examples/local_cluster.py``, ``sessionkv-plan``, ``sessionkv-real-model`` and
``sessionkv-tiny-model``, read from their argparse parsers: a row per flag whose
default cell shows the default, "off" for a switch, "required"), and for the metrics:
docs/metrics.md has a row for every series registered by the proxy's registry
(``ProxyMetrics`` with Redis, and the handle channel's collector) and by the
connector's ``SessionKVPromMetrics`` (NIXL's own series included), with its type and
labels.  Costs a few seconds (the connector's metrics import vLLM).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import connector_series, proxy_series

from sessionkv_proxy import prices
from sessionkv_proxy.__main__ import _parser
from sessionkv_proxy.config import EngineConfig, ProxyConfig
from vllm_sessionkv.config import SessionKVConfig

REPO = Path(__file__).resolve().parents[2]
RUNNING = REPO / "docs" / "running.md"
PLANNER = REPO / "docs" / "planner.md"
METRICS = REPO / "docs" / "metrics.md"
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
    params = prices.routing_params_from_config({})
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


def test_the_proxy_config_section_names_every_flag_that_overrides_it():
    """"flags override it (...)": every flag of sessionkv-proxy but --config itself."""
    section = _section(RUNNING.read_text(), "#### Proxy config keys")
    intro = section[:section.index("| key |")]
    flags = set(parser_flags(_parser())) - {"--config"}
    missing = sorted(f for f in flags if f"`{f}`" not in intro and f"`{f}`/" not in intro
                     and f"/`{f}`" not in intro)
    assert not missing, f"running.md #### Proxy config keys names no {missing}"


# --------------------------------------------------------------------- command lines


def _launcher_parser() -> argparse.ArgumentParser:
    path = REPO / "examples" / "local_cluster.py"
    spec = importlib.util.spec_from_file_location("local_cluster_doc_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._parser()


def _plan_parser() -> argparse.ArgumentParser:
    from vllm_sessionkv.planner import plan
    return plan._parser()


def _real_model_parser() -> argparse.ArgumentParser:
    from vllm_sessionkv.dev import real_model
    return real_model._parser()


def _tiny_model_parser() -> argparse.ArgumentParser:
    from vllm_sessionkv.dev import tiny_model
    return tiny_model._parser()


def _table(section: str) -> dict[str, list[str]]:
    """First cell's backticked names -> the row's other cells, for each table row."""
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) < 3 or cells[0] in ("flag", "metric"):
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = cells[1:]
    return rows


def parser_flags(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Each option's long flag -> its default (REQUIRED, or "off" for a switch)."""
    flags: dict[str, Any] = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            default: Any = "off"
        elif action.required:
            default = REQUIRED
        else:
            default = action.default
        flags[longs[0]] = default
    return flags


def shows_flag(cell: str, default: Any) -> bool:
    if default == "off":
        return cell.startswith("off")
    if isinstance(default, str) and not isinstance(default, bool):
        return f"`{default}`" in cell
    return shows(cell, default)


@pytest.mark.parametrize("doc, heading, parser", [
    (RUNNING, "#### Launcher flags", _launcher_parser),
    (RUNNING, "#### sessionkv-real-model", _real_model_parser),
    (RUNNING, "#### sessionkv-tiny-model", _tiny_model_parser),
    (PLANNER, "## Flags and defaults", _plan_parser),
], ids=["launcher", "real-model", "tiny-model", "planner"])
def test_every_flag_is_documented_with_its_default(doc, heading, parser):
    rows = {k: v[0] for k, v in _table(_section(doc.read_text(), heading)).items()}
    expected = parser_flags(parser())
    missing = sorted(set(expected) - set(rows))
    assert not missing, f"{doc.name} {heading}: flags with no row: {missing}"
    wrong = {k: (rows[k], expected[k]) for k in expected
             if not shows_flag(rows[k], expected[k])}
    assert not wrong, f"{doc.name} {heading}: default cells that do not show it: {wrong}"
    unknown = sorted(set(rows) - set(expected))
    assert not unknown, f"{doc.name} {heading}: rows that name no flag: {unknown}"


def test_the_flag_check_fails_on_a_missing_or_wrong_row():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=3)
    p.add_argument("--mode", default="cost")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--config", required=True)
    flags = parser_flags(p)
    assert flags == {"--n": 3, "--mode": "cost", "--quiet": "off", "--config": REQUIRED}
    assert shows_flag("`3`", 3) and not shows_flag("`30`", 3)
    assert shows_flag("`cost`", "cost") and not shows_flag("cost", "cost")
    assert shows_flag("off (on: quiet)", "off") and not shows_flag("`true`", "off")
    rows = _table("| flag | default | meaning |\n|---|---|---|\n| `--n` | `3` | x |\n")
    assert set(flags) - set(rows) == {"--mode", "--quiet", "--config"}


# -------------------------------------------------------------------------- metrics


def proxy_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    return proxy_series()


def connector_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    pytest.importorskip("prometheus_client")
    pytest.importorskip("vllm_sessionkv.stats")
    return connector_series()


def _check_metric_rows(rows: dict[str, list[str]], expected) -> list[str]:
    problems = []
    for name, (kind, labels) in sorted(expected.items()):
        if name not in rows:
            problems.append(f"{name}: no row")
            continue
        kind_cell, labels_cell = rows[name][0], rows[name][1]
        if kind_cell != kind:
            problems.append(f"{name}: type cell {kind_cell!r}, registered {kind}")
        named = set(re.findall(r"`([^`]+)`", labels_cell))
        if named != set(labels):
            problems.append(f"{name}: labels cell names {sorted(named)}, "
                            f"registered {sorted(labels)}")
        if len(rows[name]) < 3 or not rows[name][2]:
            problems.append(f"{name}: no meaning")
    problems += [f"{name}: a row naming no registered metric"
                 for name in sorted(set(rows) - set(expected))]
    return problems


@pytest.mark.parametrize("heading, metrics", [
    ("## Proxy", proxy_metrics),
    ("## Connector", connector_metrics),
], ids=["proxy", "connector"])
def test_every_registered_metric_is_documented(heading, metrics):
    rows = _table(_section(METRICS.read_text(), heading))
    problems = _check_metric_rows(rows, metrics())
    assert not problems, f"docs/metrics.md {heading}: " + "; ".join(problems)


def test_the_metric_check_fails_on_a_missing_or_wrong_row():
    expected = {"a_total": ("counter", ("engine", "reason")), "b": ("gauge", ())}
    rows = _table("| metric | type | labels | meaning |\n|---|---|---|---|\n"
                  "| `a_total` | counter | `engine`, `reason` | x |\n"
                  "| `b` | gauge | none | y |\n")
    assert _check_metric_rows(rows, expected) == []
    assert _check_metric_rows({"b": rows["b"]}, expected) == ["a_total: no row"]
    wrong = {**rows, "a_total": ["gauge", "`engine`", "x"]}
    assert len(_check_metric_rows(wrong, expected)) == 2
    assert _check_metric_rows({**rows, "c": ["gauge", "", "z"]}, expected) == [
        "c: a row naming no registered metric"]
    # Every series of both registries is found, counters under their exported name.
    proxy = proxy_metrics()
    assert proxy["sessionkv_proxy_requests_total"] == ("counter", ("endpoint", "status"))
    assert proxy["sessionkv_proxy_channel_handles_total"][1] == ("engine", "outcome")
    assert proxy["sessionkv_proxy_redis_up"] == ("gauge", ())
    connector = connector_metrics()
    assert connector["sessionkv_session_holds_released_total"] == (
        "counter", ("engine", "reason"))
    assert connector["sessionkv_host_restore_seconds"][0] == "histogram"
