"""The proxy package's shape, checked on its source (no imports, under a second):
no import cycle between its modules, no module over 600 lines, no function over 80,
no ``state`` bag threaded through functions, and ``kv_transfer_params`` written in
one module (``handoff.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sessionkv_proxy

PACKAGE = Path(sessionkv_proxy.__file__).parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
PARAMS_KEY = "kv_transfer_params"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imports(name: str) -> set[str]:
    """The package's modules ``name`` imports, wherever the import stands (a cycle
    through a function-level or TYPE_CHECKING import is still a cycle of ideas)."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def _cycle() -> list[str] | None:
    graph = {name: _imports(name) for name in MODULES}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for dep in sorted(graph[name]):
            found = visit(dep, path + [name])
            if found:
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return None


def test_no_import_cycle():
    assert _cycle() is None


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    # Negative control: a module made to import one that imports it is reported.
    monkeypatch.setitem(TREES, "sessionkv_proxy.errors", ast.parse(
        "from sessionkv_proxy.server import Response\n"))
    monkeypatch.setitem(TREES, "sessionkv_proxy.server", ast.parse(
        "from sessionkv_proxy.errors import ApiError\n"))
    assert _cycle() is not None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_FILE_LINES, f"{MODULES[name]}: {lines} lines"


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_function_size():
    long = [f"{MODULES[name].name}:{fn.name} {fn.end_lineno - fn.lineno + 1} lines"
            for name, tree in TREES.items() for fn in _functions(tree)
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long


def test_no_state_parameter():
    threaded = [f"{MODULES[name].name}:{fn.name}" for name, tree in TREES.items()
                for fn in _functions(tree)
                for arg in fn.args.args + fn.args.kwonlyargs if arg.arg == "state"]
    assert not threaded


def _writes_params(tree: ast.AST) -> list[int]:
    """Lines that set or remove a body's ``kv_transfer_params``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and isinstance(node.slice, ast.Constant) and node.slice.value == PARAMS_KEY:
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value == PARAMS_KEY for k in node.keys):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("pop", "setdefault") and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == PARAMS_KEY:
            lines.append(node.lineno)
    return lines


def test_kv_transfer_params_are_written_in_handoff_only():
    writers = {MODULES[name].name: lines for name, tree in TREES.items()
               if (lines := _writes_params(tree)) and name != "sessionkv_proxy.handoff"}
    assert not writers
    # Negative control: each way of writing them is seen.
    for source in ('body["kv_transfer_params"] = p', '{"kv_transfer_params": p}',
                   'body.pop("kv_transfer_params", None)'):
        assert _writes_params(ast.parse(source)), source
