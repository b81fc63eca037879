"""The jinja side of rendering a chat template as transformers and vLLM do: the
sandboxed environment transformers compiles templates in, the variables a template
reads, and vLLM's AST check of whether a template loops over content parts
(``content_format``).  Used by :mod:`sessionkv_proxy.chat_template`."""

from __future__ import annotations

import functools
import json
from collections import deque
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

__all__ = ["compiled", "content_format", "template_vars"]


class _AssistantTracker(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` tag; without a mask requested it renders
    its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [],
                                      body).set_lineno(lineno)

    def _generation_support(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' override: no HTML escaping, json.dumps' own options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """transformers' ``_compile_jinja_template`` environment."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@functools.lru_cache(maxsize=64)
def compiled(template: str) -> jinja2.Template:
    return _ENV.from_string(template)


@functools.lru_cache(maxsize=64)
def template_vars(template: str) -> frozenset[str]:
    """The variables a template reads (vLLM's ``_resolve_chat_template_kwargs``)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_ENV.parse(template)))


# vLLM's content-format detection (``renderers/hf.py``, Apache-2.0), on jinja's AST:
# "openai" when some loop iterates over a message's content, else "string".
def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == varname
    return False


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (_is_var_access(node.node, varname) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str,
                            key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _iter_nodes_assign_var_or_elems(root: jinja2.nodes.Node, varname: str):
    yield root, varname
    related = deque([varname])
    while related:
        name = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems_access(assign.node, name):
                assert isinstance(assign.target, jinja2.nodes.Name)
                yield assign, assign.target.name
                if assign.target.name != name:
                    related.append(assign.target.name)


def _iter_nodes_assign_messages_item(root: jinja2.nodes.Node):
    messages_varnames = [v for _, v in _iter_nodes_assign_var_or_elems(root, "messages")]
    for loop in root.find_all(jinja2.nodes.For):
        for varname in messages_varnames:
            if _is_var_or_elems_access(loop.iter, varname):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop, loop.target.name
                break


def _iter_nodes_assign_content_item(root: jinja2.nodes.Node):
    message_varnames = [v for _, v in _iter_nodes_assign_messages_item(root)]
    macro_content_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(
                            _is_var_or_elems_access(arg, v, "content")
                            for v in message_varnames):
                        content_params.add(macro.args[i].name)
                for kwarg in call.kwargs:
                    if (isinstance(kwarg, jinja2.nodes.Keyword) and kwarg.key in param_names
                            and any(_is_var_or_elems_access(kwarg.value, v, "content")
                                    for v in message_varnames)):
                        content_params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                macro_content_params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        for varname in message_varnames:
            if _is_var_or_elems_access(loop.iter, varname, "content"):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop, loop.target.name
                break
        else:
            params = macro_content_params_by_loop.get(id(loop))
            if (isinstance(loop.iter, jinja2.nodes.Name) and params is not None
                    and loop.iter.name in params):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop, loop.target.name
                continue
            if (id(loop) not in loops_in_macros and isinstance(loop.iter, jinja2.nodes.Name)
                    and loop.iter.name == "content"):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop, loop.target.name


@functools.lru_cache(maxsize=64)
def content_format(template: str) -> str:
    """"openai" (content stays a list of parts) or "string" (text parts joined)."""
    try:
        ast = _ENV.parse(template)
    except Exception:
        return "string"
    try:
        next(_iter_nodes_assign_content_item(ast))
    except StopIteration:
        return "string"
    except Exception:
        return "string"
    return "openai"
