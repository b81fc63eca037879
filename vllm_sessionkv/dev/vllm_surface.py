"""The vLLM surface our contact code touches, read from a vLLM release's wheel.

    python -m vllm_sessionkv.dev.vllm_surface vllm-0.33.0-...whl
        [--out vllm_sessionkv/_vllm/surfaces/vllm-0.33.0.json]

``pip download --no-deps vllm==0.33.0`` fetches the wheel (the GPU build; nothing in it
is imported or run: its ``.py`` files are parsed with ``ast``).  What our code touches
is read from our own source the same way:

* every ``from vllm... import NAME`` / ``import vllm...`` / ``importlib.import_module
  ("vllm...")`` in the package, and every attribute read off an imported vLLM module;
* every method our subclasses of vLLM classes define (an override, or a hook vLLM
  calls), looked up along the vLLM class's bases;
* every private attribute (``obj._name``) and every ``getattr``/``setattr``/
  ``hasattr`` name given as a literal in ``vllm_sessionkv/_vllm/``, and every
  ``self._name`` our subclasses use without assigning it: which classes of the
  packages we import from define it;
* the fields of the KV-event structs ``proxy/sessionkv_proxy/events.py`` copies.

The snapshot holds, for each of these, what the wheel has: a class, a function's or
method's parameters and a digest of its code (so a method whose body changed shows,
though what the change does must be read), a name, or ``missing``; and the public
methods of each vLLM class we subclass (one vLLM adds is inherited unseen).  ``vllm_sessionkv._vllm.surfaces``
compares snapshots (``tests/unit/test_vllm_surface.py``, the engine's refusal of an
untested release).  The snapshot is small and committed: CI reads it, not the wheel.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import zipfile
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Touched", "WheelIndex", "main", "snapshot", "touched"]

PACKAGE = Path(__file__).resolve().parents[1]          # vllm_sessionkv/
EVENTS = PACKAGE.parent / "proxy" / "sessionkv_proxy" / "events.py"
EVENT_STRUCTS = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "EventBatch")
EVENTS_MODULE = "vllm.distributed.kv_events"
MAX_OWNERS = 6


def _is_vllm(module: str | None) -> bool:
    return module is not None and (module == "vllm" or module.startswith("vllm."))


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Parameter names, ``=`` for a default, ``*``/``**`` as written (no values:
    a changed default is not a changed contract here)."""
    a = fn.args
    parts: list[str] = []
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        parts.append(arg.arg + ("=" if i >= first_default else ""))
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg:
        parts.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        parts.append("*")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        parts.append(arg.arg + ("=" if default is not None else ""))
    if a.kwarg:
        parts.append("**" + a.kwarg.arg)
    prefix = "async " if isinstance(fn, ast.AsyncFunctionDef) else ""
    return f"{prefix}({', '.join(parts)})"


# --- what our code touches --------------------------------------------------------


@dataclass
class Touched:
    imports: set[str] = field(default_factory=set)        # "module:Name" or "module:"
    overrides: set[tuple[str, str]] = field(default_factory=set)   # (vllm "mod:Class", method)
    attributes: set[str] = field(default_factory=set)     # attribute names


def _py_files(root: Path) -> Iterable[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def touched(package: Path = PACKAGE) -> Touched:
    out = Touched()
    defined_here: set[str] = set()
    trees = {path: ast.parse(path.read_text(), str(path)) for path in _py_files(package)}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined_here.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined_here.add(node.id)
    vllm_names: dict[str, str] = {}          # local alias -> "module:Name" (any file)
    for path, tree in trees.items():
        modules: dict[str, str] = {}         # alias -> vllm module, in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _is_vllm(node.module):
                for alias in node.names:
                    key = f"{node.module}:{alias.name}"
                    out.imports.add(key)
                    vllm_names[alias.asname or alias.name] = key
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_vllm(alias.name):
                        out.imports.add(f"{alias.name}:")
                        modules[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == \
                    "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                    and _is_vllm(str(node.args[0].value)):
                out.imports.add(f"{node.args[0].value}:")
        contact = "_vllm" in path.relative_to(package).parts
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in modules and not node.attr.startswith("__"):
                # a name read off what "from vllm.x import y" gave: a submodule's name,
                # or a class's attribute ("x:y.attr"; the wheel tells which)
                dotted = modules[node.value.id]
                if node.value.id in vllm_local_names(tree):
                    module, _, name = dotted.rpartition(".")
                    out.imports.add(f"{module}:{name}.{node.attr}")
                else:
                    out.imports.add(f"{dotted}:{node.attr}")
            elif contact and isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith(("__", "_sessionkv")) \
                    and node.attr not in defined_here:
                out.attributes.add(node.attr)
            elif contact and isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "setattr", "hasattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) \
                    and not node.args[1].value.startswith("_sessionkv"):
                out.attributes.add(node.args[1].value)
    # Our subclasses of vLLM classes: each method they define, and each self._name
    # they use but never assign (the base class's).
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = [vllm_names.get(b.attr if isinstance(b, ast.Attribute) else
                                    getattr(b, "id", "")) for b in cls.bases]
            bases = [b for b in bases if b]
            if not bases:
                continue
            assigned = {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign,
                        ast.AnnAssign, ast.AugAssign))
                        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                        if isinstance(t, ast.Attribute)}
            for item in cls.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and not item.name.startswith("__") or \
                        isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    for base in bases:
                        out.overrides.add((base, item.name))
            for n in ast.walk(cls):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) \
                        and n.value.id == "self" and n.attr.startswith("_") \
                        and not n.attr.startswith("__") and n.attr not in assigned \
                        and n.attr not in defined_here:
                    out.attributes.add(n.attr)
    return out


def vllm_local_names(tree: ast.Module) -> set[str]:
    """Local names bound by ``from vllm... import NAME`` in this file."""
    return {alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and _is_vllm(node.module)
            for alias in node.names}


# --- what a wheel has -------------------------------------------------------------


@dataclass
class _Class:
    bases: list[str]                          # as written, resolved later
    methods: dict[str, str] = field(default_factory=dict)
    bodies: dict[str, str] = field(default_factory=dict)   # method -> digest of its code
    attributes: set[str] = field(default_factory=set)
    fields: list[str] = field(default_factory=list)   # annotated class-body names, in order


class WheelIndex:
    """Top-level names, classes and their attributes of every module in a wheel."""

    def __init__(self, sources: dict[str, str], packages: frozenset[str] = frozenset()
                 ) -> None:
        self.packages = packages                              # modules from __init__.py
        self.modules: dict[str, dict[str, str]] = {}          # module -> name -> kind
        self.aliases: dict[str, dict[str, str]] = {}          # module -> name -> "mod:Name"
        self.classes: dict[str, _Class] = {}                  # "mod:Class"
        for module, text in sources.items():
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            self._index(module, tree)
        self.owners: dict[str, list[str]] = defaultdict(list)
        for qual, cls in self.classes.items():
            for name in sorted(set(cls.methods) | cls.attributes):
                self.owners[name].append(qual)

    @classmethod
    def from_wheel(cls, wheel: Path) -> WheelIndex:
        sources, packages = {}, set()
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    module = name[:-3].replace("/", ".")
                    if module.endswith(".__init__"):
                        module = module.removesuffix(".__init__")
                        packages.add(module)
                    sources[module] = zf.read(name).decode("utf-8", "replace")
        return cls(sources, frozenset(packages))

    def _index(self, module: str, tree: ast.Module) -> None:
        names: dict[str, str] = {}
        aliases: dict[str, str] = {}
        for node in tree.body:
            for target in self._top_level(node):
                names[target] = "name"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = "function " + _signature(node)
            elif isinstance(node, ast.ClassDef):
                names[node.name] = "class"
                self.classes[f"{module}:{node.name}"] = self._class(node)
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(module, node)
                for alias in node.names:
                    local = alias.asname or alias.name
                    names.setdefault(local, "import")
                    aliases[local] = f"{base}:{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names.setdefault((alias.asname or alias.name).split(".")[0], "import")
        self.modules[module] = names
        self.aliases[module] = aliases

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        base = parts if module in self.packages else parts[:-1]
        base = base[:len(base) - node.level + 1] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else []))

    @staticmethod
    def _top_level(node: ast.stmt) -> list[str]:
        if isinstance(node, ast.Assign):
            return [t.id for t in node.targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        if isinstance(node, (ast.If, ast.Try)):
            out = []
            for child in node.body + getattr(node, "orelse", []) + \
                    [h for hand in getattr(node, "handlers", []) for h in hand.body]:
                out += WheelIndex._top_level(child)
                if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                    out.append(child.name)
            return out
        return []

    @staticmethod
    def _class(node: ast.ClassDef) -> _Class:
        cls = _Class(bases=[ast.unparse(b) for b in node.bases])
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                cls.methods[item.name] = _signature(item)
                cls.bodies[item.name] = hashlib.sha256(
                    ast.dump(item).encode()).hexdigest()[:10]
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                cls.attributes.add(item.target.id)
                cls.fields.append(item.target.id)
            elif isinstance(item, ast.Assign):
                cls.attributes.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for sub in ast.walk(node):
            targets: list[ast.expr] = []
            if isinstance(sub, ast.Assign):
                targets = sub.targets
            elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                targets = [sub.target]
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) \
                            and el.value.id in ("self", "cls"):
                        cls.attributes.add(el.attr)
        return cls

    def lookup(self, key: str) -> str:
        """``module:Name`` (``module:`` for the module itself) -> what the wheel has."""
        module, _, name = key.partition(":")
        if not name:
            return "module" if module in self.modules else "missing"
        if "." in name:          # an attribute of an imported name
            owner, _, attr = name.partition(".")
            if f"{module}.{owner}" in self.modules:
                return self.lookup(f"{module}.{owner}:{attr}")
            qual = self.resolve_class(module, owner)
            if qual is not None:
                return self.method(qual, attr)
            found = self.lookup(f"{module}:{owner}")
            return "missing" if found == "missing" else "an attribute of an object (unchecked)"
        if f"{module}.{name}" in self.modules:
            return "module"
        kind = self.modules.get(module, {}).get(name)
        if kind is None:
            return "missing"
        if kind == "import":   # re-exported: describe what it names
            target = self.aliases.get(module, {}).get(name)
            if target and target != key:
                found = self.lookup(target)
                if found != "missing":
                    return found
            return "name"
        return kind

    def resolve_class(self, module: str, name: str) -> str | None:
        if f"{module}:{name}" in self.classes:
            return f"{module}:{name}"
        target = self.aliases.get(module, {}).get(name)
        if target:
            mod, _, cls = target.partition(":")
            if mod != module:
                return self.resolve_class(mod, cls)
        return None

    def mro(self, qual: str) -> list[str]:
        out, todo = [], [qual]
        while todo:
            current = todo.pop(0)
            if current in out or current not in self.classes:
                continue
            out.append(current)
            module = current.partition(":")[0]
            for base in self.classes[current].bases:
                base = base.split("[")[0]
                if "." in base:    # module.Class
                    alias, _, cls = base.rpartition(".")
                    target = self.aliases.get(module, {}).get(alias)
                    resolved = self.resolve_class(target.replace(":", "."), cls) \
                        if target else None
                else:
                    resolved = self.resolve_class(module, base)
                if resolved:
                    todo.append(resolved)
        return out

    def method(self, qual: str, name: str) -> str:
        for cls in self.mro(qual):
            if name in self.classes[cls].methods:
                owner, found = cls.partition(":")[2], self.classes[cls]
                return f"{owner}.{name} {found.methods[name]} code {found.bodies[name]}"
            if name in self.classes[cls].attributes:
                return f"{cls.partition(':')[2]}.{name} attribute"
        return "not defined by vLLM"

    def attribute(self, name: str, scope: set[str]) -> list[str]:
        """The classes that define ``name``, in the packages our imports come from."""
        owners = []
        for qual in self.owners.get(name, []):
            module = qual.partition(":")[0]
            if not any(module == p or module.startswith(p + ".") for p in scope):
                continue
            cls = self.classes[qual]
            kind = cls.methods.get(name)
            owners.append(f"{qual} " + (f"method {kind} code {cls.bodies[name]}" if kind
                                        else "attribute"))
        return owners


def _class_key(key: str) -> tuple[str, str]:
    module, _, name = key.partition(":")
    return module, name


def snapshot(index: WheelIndex, what: Touched, version: str, wheel: str,
             sha256: str) -> dict:
    imports = {key: index.lookup(key) for key in sorted(what.imports)}
    overrides = {}
    for base, method in sorted(what.overrides):
        qual = index.resolve_class(*_class_key(base))
        overrides[f"{base}.{method}"] = "missing class" if qual is None \
            else index.method(qual, method)
    # Private and getattr'd names are looked up in the packages we import from (a
    # public name like num_blocks is defined all over vLLM).
    scope = set()
    for key in what.imports:
        module = key.partition(":")[0]
        if module != "vllm":     # vllm.__version__ only
            scope.add(module.rpartition(".")[0] if module.count(".") >= 3 else module)
    attributes = {}
    for name in sorted(what.attributes):
        owners = index.attribute(name, scope)
        attributes[name] = owners[:MAX_OWNERS] + (
            [f"... {len(owners) - MAX_OWNERS} more"] if len(owners) > MAX_OWNERS else [])
    # Every method the vLLM classes we subclass have (along their bases): one vLLM adds
    # is inherited by our subclass unseen (e.g. a new lifecycle hook).
    inherited = {}
    for base in sorted({b for b, _ in what.overrides}):
        qual = index.resolve_class(*_class_key(base))
        inherited[base] = "missing class" if qual is None else sorted(
            {m for c in index.mro(qual) for m in index.classes[c].methods
             if not m.startswith("_")})
    members = {}
    for base in sorted({b for b, _ in what.overrides}):
        qual = index.resolve_class(*_class_key(base))
        members[base] = [] if qual is None else sorted(
            {m for c in index.mro(qual) for m in
             set(index.classes[c].methods) | index.classes[c].attributes})
    events = {}
    for struct in EVENT_STRUCTS:
        cls = index.classes.get(f"{EVENTS_MODULE}:{struct}")
        events[struct] = cls.fields if cls else "missing"
    return {"vllm_version": version, "wheel": wheel, "wheel_sha256": sha256,
            "imports": imports, "overrides": overrides, "attributes": attributes,
            "inherited_methods": inherited, "kv_event_fields": events,
            # every member name along each subclassed class's bases: tells an override
            # (in here) from a method of our own (not), for the coverage test
            "base_members": members}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_sessionkv.dev.vllm_surface",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", type=Path, help="a vLLM wheel (pip download --no-deps vllm==X)")
    p.add_argument("--out", type=Path, help="where to write the snapshot (default: "
                   "vllm_sessionkv/_vllm/surfaces/vllm-VERSION.json)")
    args = p.parse_args(argv)
    match = re.match(r"vllm-([0-9][^-]*)-", args.wheel.name)
    if not match:
        p.error(f"not a vLLM wheel name: {args.wheel.name}")
    version = match.group(1)
    sha = hashlib.sha256(args.wheel.read_bytes()).hexdigest()
    data = snapshot(WheelIndex.from_wheel(args.wheel), touched(), version,
                    args.wheel.name, sha)
    out = args.out or PACKAGE / "_vllm" / "surfaces" / f"vllm-{version}.json"
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    missing = [k for section in ("imports", "overrides") for k, v in data[section].items()
               if v.startswith("missing")]
    print(f"{out}: {len(data['imports'])} imports, {len(data['overrides'])} methods, "
          f"{len(data['attributes'])} attributes; missing: {missing or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
