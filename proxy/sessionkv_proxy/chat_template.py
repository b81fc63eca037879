"""Token ids for a ``/v1/chat/completions`` request, rendered in the proxy.

vLLM 0.32 turns a chat request into token ids in four steps (all mirrored here,
with jinja2 and ``tokenizers``; no torch, no transformers, no vLLM):

1. the request as pydantic reads it (``ChatCompletionRequest``): message content
   parts, assistant ``tool_calls`` and ``tools`` are normalized (``_tool_dicts``,
   ``_tool_calls``);
2. the messages into a conversation (``renderers/chat_utils.py``
   ``_parse_chat_message_content``): string content and ``{"type": "text"}`` parts,
   joined with "\\n" where the template takes string content, kept as parts where it
   loops over them (``content_format``, vLLM's AST check in ``renderers/hf.py``);
   tool results as one string; tool-call arguments parsed to objects;
3. the template (``safe_apply_chat_template``, then transformers'
   ``apply_chat_template``): the request's ``chat_template``, else the model
   directory's (``chat_template.jinja``, ``additional_chat_templates/``, or
   ``tokenizer_config.json``; named templates with "tool_use" for tools), rendered in
   transformers' sandboxed environment with the model's named special tokens, the
   request's ``chat_template_kwargs`` that the template reads, ``tools``,
   ``documents``, ``add_generation_prompt`` (default true) and
   ``continue_final_message``;
4. the text tokenized with ``add_special_tokens`` (default false for chat), as for a
   completions prompt (``tokenizer.py``).

Whatever is not mirrored raises ``Unsupported`` and the router asks an engine's
``/tokenize`` instead: images, audio and other non-text parts, part types or tool
calls of another shape, ``truncate_prompt_tokens``, a template that fails, a model
directory with a processor (whose template vLLM would prefer) or without a template.
Not visible from here, and caught only by the start-up probe against an engine
(``PROBES``): ``vllm serve --chat-template`` or ``--default-chat-template-kwargs``, a
``--tokenizer-mode`` other than auto/hf, and vLLM's own renderers for some model
types (gpt-oss harmony, DeepSeek V3.2/V4, Kimi K3, Mistral; refused here by
``model_type`` where known).  Templates that print the date (``strftime_now``) use
the proxy's clock and time zone.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from sessionkv_proxy.chat_jinja import compiled, content_format, template_vars
from sessionkv_proxy.tokenizer import LocalTokenizer, read_json_object

__all__ = ["PROBES", "REQUEST_TEMPLATE_PROBE", "ChatRenderer", "Unsupported",
           "content_format"]


class Unsupported(Exception):
    """The proxy cannot render this request exactly as vLLM would."""


# The start-up check: each conversation's ids from the proxy against an engine's
# /tokenize with the same fields (``messages`` and the rest of the request).
PROBES: tuple[dict[str, Any], ...] = (
    {"messages": [{"role": "system", "content": "You are a careful assistant."},
                  {"role": "user", "content": "Hello, world! naïve café 東京 🚀"}]},
    {"messages": [{"role": "user", "content": "What is 2 + 2?"},
                  {"role": "assistant", "content": "4, as  always.\n"},
                  {"role": "user", "content": "  And 3 + 3?  "}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "first part"},
                                               {"type": "text", "text": "second part"}]}]},
    {"messages": [{"role": "user", "content": "Say hi."},
                  {"role": "assistant", "content": "Hi!"}],
     "add_generation_prompt": False},
)
# Whether the engines render a request's own ``chat_template`` (vLLM refuses it
# without ``--trust-request-chat-template``), and the same way.
REQUEST_TEMPLATE_PROBE: dict[str, Any] = {
    "messages": [{"role": "user", "content": "template probe"}],
    "chat_template": ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                      "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"),
}

# vLLM renders these model types with renderers of its own, not the HF template.
_OWN_RENDERER_MODEL_TYPES = frozenset({"gpt_oss", "deepseek_v32", "deepseek_v4", "kimi_k3"})
# Files that make vLLM prefer the AutoProcessor's chat template (``resolve_chat_template``).
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json",
                    "video_preprocessor_config.json", "chat_template.json")
# transformers 5 ``SPECIAL_TOKENS_ATTRIBUTES``: the named tokens a template sees.
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
# ``apply_chat_template``'s own parameters (vLLM's ``_get_hf_base_chat_template_params``).
# A request's chat_template_kwargs naming one of these changes tokenization or the
# call itself; such requests go to the engine.
_HF_CALL_PARAMS = frozenset({"self", "conversation", "tools", "documents", "chat_template",
                             "tokenize", "padding", "truncation", "max_length",
                             "return_tensors", "return_dict", "return_assistant_tokens_mask",
                             "tokenizer_kwargs"})
_HF_BASE_PARAMS = _HF_CALL_PARAMS | {"add_generation_prompt", "continue_final_message"}
# vLLM's ``_KNOWN_CONTENT_PART_FIELDS``: a text part keeps its other fields.
KNOWN_CONTENT_PART_FIELDS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
    "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
    "thinking", "type", "uuid", "video_embeds", "video_url"})
# Part types vLLM reads as text, and the field holding the text.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
               "refusal": "refusal", "thinking": "thinking"}
_SKIP_IF_NONE = ("text", "refusal")
_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# Request fields that change the prompt in ways not mirrored here.
_NOT_MIRRORED = ("truncate_prompt_tokens", "mm_processor_kwargs", "media_io_kwargs")
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# --------------------------------------------------------------------------- the request
def _merge_kwargs(defaults: dict[str, Any] | None, overrides: dict[str, Any] | None
                  ) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: None and "auto" leave the default."""
    return (defaults or {}) | {k: v for k, v in (overrides or {}).items()
                               if v is not None and not (isinstance(v, str) and v == "auto")}


def _tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """``[tool.model_dump() for tool in request.tools]`` of vLLM's
    ``ChatCompletionToolsParam``: description and parameters always present,
    strict and defer_loading only when set, other fields dropped."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Unsupported("tools is not a list")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise Unsupported("a tool that is not a function")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Unsupported("a tool without a function name")
        desc, params = fn.get("description"), fn.get("parameters")
        strict, defer, tool_defer = (fn.get("strict"), fn.get("defer_loading"),
                                     tool.get("defer_loading"))
        if not (isinstance(desc, (str, type(None))) and isinstance(params, (dict, type(None)))
                and all(v is None or v.__class__ is bool for v in (strict, defer, tool_defer))):
            raise Unsupported("a tool field of another type")
        if defer is None:
            defer = tool_defer
        function: dict[str, Any] = {"name": fn["name"], "description": desc,
                                    "parameters": copy.deepcopy(params)}
        if strict is not None:
            function["strict"] = strict
        if defer is not None:
            function["defer_loading"] = defer
        dumped: dict[str, Any] = {"type": "function", "function": function}
        if tool_defer is not None:
            dumped["defer_loading"] = tool_defer
        out.append(dumped)
    return out


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant's tool calls as pydantic validates them (id, function, type, then
    other fields) and vLLM's ``_postprocess_messages`` leaves them (arguments parsed
    to an object; empty, unparsable or not an object: ``{}``)."""
    if not isinstance(calls, list):
        raise Unsupported("tool_calls is not a list")
    out = []
    for call in calls:
        if not isinstance(call, dict) or call.get("type") != "function" or "custom" in call:
            raise Unsupported("a tool call that is not a function call")
        fn = call.get("function")
        if (not isinstance(call.get("id"), str) or not isinstance(fn, dict)
                or set(fn) != {"name", "arguments"} or not isinstance(fn["name"], str)
                or not isinstance(fn["arguments"], str)):
            raise Unsupported("a tool call of another shape")
        try:
            args = json.loads(fn["arguments"]) if fn["arguments"] else {}
        except json.JSONDecodeError:
            args = {}
        if not isinstance(args, dict):
            args = {}
        extra = {k: copy.deepcopy(v) for k, v in call.items()
                 if k not in ("id", "function", "type")}
        out.append({"id": call["id"], "function": {"arguments": args, "name": fn["name"]},
                    "type": "function", **extra})
    return out


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops Claude Code's attribution line from system text parts."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else (
            part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None)
        if not (isinstance(text, str) and text.startswith(_CLAUDE_CODE_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _content(role: str, content: Any, wrap: bool) -> Any:
    """A message's content as vLLM's ``_parse_chat_message_content_parts`` leaves it:
    text parts as ``{"type": "text", "text": ...}`` dicts (openai format) or joined
    with "\\n" (string format)."""
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise Unsupported("content that is neither a string nor a list")
    if role == "system":
        parts = _strip_billing_header(parts)
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            out.append({"type": "text", "text": part} if wrap else part)
            continue
        if not isinstance(part, dict) or part.get("uuid") is not None:
            raise Unsupported("a content part vLLM reads as media")
        kind = part.get("type")
        if kind not in _TEXT_PARTS or any(k in part for k in KNOWN_CONTENT_PART_FIELDS
                                         - {"type", "text", "refusal", "thinking", "closed",
                                            "name", "prompt_cache_breakpoint"}):
            raise Unsupported(f"content part type {kind!r}")
        text = part.get(_TEXT_PARTS[kind])
        if text is None and kind in _SKIP_IF_NONE:
            continue
        if not isinstance(text, str):
            raise Unsupported("a text part without text")
        if wrap:
            out.append({"type": "text", "text": text,
                        **{k: copy.deepcopy(v) for k, v in part.items()
                           if k not in KNOWN_CONTENT_PART_FIELDS}})
        else:
            out.append(text)
    return out if wrap else "\n".join(out)


def conversation(messages: Any, fmt: str) -> list[dict[str, Any]]:
    """vLLM's ``parse_chat_messages`` for text-only messages."""
    if not isinstance(messages, list) or not messages:
        raise Unsupported("messages is not a non-empty list")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Unsupported("a message without a role")
        role = message["role"]
        msg: dict[str, Any] = {"role": role,
                               "content": _content(role, message.get("content"),
                                                   fmt == "openai")}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                calls = _tool_calls(message["tool_calls"])
                if calls:    # vLLM drops an empty list
                    msg["tool_calls"] = calls
            reasoning = message.get("reasoning")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise Unsupported("reasoning is not a string")
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            content = msg["content"]
            if isinstance(content, list):
                if any(item.get("type") != "text" for item in content):
                    raise Unsupported("a tool result with parts other than text")
                msg["content"] = "\n".join(item.get("text", "") for item in content)
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if isinstance(message.get("task"), str):
            msg["task"] = message["task"]
        if role == "developer":
            if message.get("tools") is not None:
                raise Unsupported("tools on a developer message")
            msg["tools"] = None
        out.append(msg)
    return out


def _developer_to_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's fallback for templates that do not know the developer role:
    developer messages become system ones, all merged into one first message."""
    converted = []
    for msg in conv:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"}
            msg["role"] = "system"
        converted.append(msg)
    system: list[str] = []
    rest = []
    merge = False
    for i, msg in enumerate(converted):
        if msg["role"] == "system":
            if i > 0 or system:
                merge = True
            content = msg.get("content", "")
            if isinstance(content, list):
                content = "\n".join(p["text"] if isinstance(p, dict) else p
                                    for p in content
                                    if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
            if content:
                system.append(content)
        else:
            rest.append(msg)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


def _render(template: str, conv: list[dict[str, Any]], kwargs: dict[str, Any],
            tools: list[dict[str, Any]] | None, documents: Any, add_generation_prompt: bool,
            continue_final_message: bool) -> str:
    """transformers' ``render_jinja_template`` for one conversation."""
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise Unsupported("documents that are not objects")
    final = None
    if continue_final_message:
        conv = copy.deepcopy(conv)
        final = conv[-1].get("content")
        if final is None or "content" not in template:
            raise Unsupported("continue_final_message without content to continue")
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise Unsupported("continue_final_message without text to continue")
        else:
            conv[-1]["content"] = final + _CONTINUE_TAG
    rendered = compiled(template).render(
        messages=conv, tools=tools, documents=documents,
        add_generation_prompt=add_generation_prompt, **kwargs)
    if continue_final_message:
        if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise Unsupported("the template drops the final message")
        at = rendered.rindex(_CONTINUE_TAG.strip())
        if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:at]
        else:
            rendered = rendered[:at].rstrip()
    return rendered


# --------------------------------------------------------------------------- the model
def load_templates(model_dir: Path) -> str | dict[str, str] | None:
    """The model directory's chat template(s), as transformers 5 loads them:
    ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` before
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named ones)."""
    templates: dict[str, str] = {}
    default = model_dir / "chat_template.jinja"
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        for file in extra.glob("*.jinja"):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = read_json_object(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value}
    return value if isinstance(value, str) else None


def special_tokens_map(model_dir: Path) -> dict[str, str]:
    """transformers 5's ``special_tokens_map``: the named special tokens (and other
    ``*_token`` strings and named ``extra_special_tokens``) of
    ``tokenizer_config.json``, with ``special_tokens_map.json`` over them when the
    config has no ``added_tokens_decoder``."""
    cfg = read_json_object(model_dir / "tokenizer_config.json")
    if "added_tokens_decoder" not in cfg:
        cfg = {**cfg, **read_json_object(model_dir / "special_tokens_map.json")}

    def content(value: Any) -> str | None:
        if isinstance(value, str):
            return value
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            return value["content"]
        return None

    named = {k: content(cfg.get(k)) for k in _NAMED_SPECIAL}
    extra = cfg.get("extra_special_tokens", cfg.get("additional_special_tokens"))
    for key, value in cfg.items():
        if key.endswith("_token") and key not in named and content(value) is not None:
            named[key] = content(value)
    if isinstance(extra, dict):
        named.update({k: content(v) for k, v in extra.items()})
    return {k: v for k, v in named.items() if v is not None}


class ChatRenderer:
    """A model directory's chat template(s), applied to a chat request as vLLM does."""

    def __init__(self, tokenizer: LocalTokenizer) -> None:
        self.tokenizer = tokenizer
        model_dir = Path(tokenizer.path).parent
        self.model_dir = model_dir
        self.templates = load_templates(model_dir)
        self.special_tokens = special_tokens_map(model_dir)
        model_type = read_json_object(model_dir / "config.json").get("model_type")
        processor = [f for f in _PROCESSOR_FILES if (model_dir / f).is_file()]
        # Why chat requests cannot be rendered here at all; None when they can.
        self.unusable: str | None = (
            f"{model_dir} has no chat template" if self.templates is None
            else f"vLLM renders model_type {model_type} with its own renderer"
            if model_type in _OWN_RENDERER_MODEL_TYPES
            else f"{model_dir} has {processor[0]}, whose template vLLM may prefer"
            if processor else None)

    def _template(self, requested: str | None, tools: list | None) -> str:
        """vLLM's ``resolve_chat_template`` through transformers' ``get_chat_template``."""
        templates = self.templates
        if isinstance(templates, dict):
            if requested is not None:
                return templates.get(requested, requested)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise Unsupported("several chat templates and no default")
        if requested is not None:
            return requested
        if templates is None:
            raise Unsupported("no chat template")
        return templates

    def render(self, body: dict[str, Any], request_templates: bool = False
               ) -> tuple[str, bool]:
        """The prompt text vLLM renders for ``body`` and its ``add_special_tokens``.
        Raises ``Unsupported`` (or the template's own error) where the engine must
        be asked; ``request_templates``: the engines accept a request's template."""
        if self.unusable:
            raise Unsupported(self.unusable)
        if any(body.get(k) is not None for k in _NOT_MIRRORED):
            raise Unsupported("a field that changes the prompt after rendering")
        agp = body.get("add_generation_prompt", True)
        cfm = body.get("continue_final_message", False)
        add_special = body.get("add_special_tokens", False)
        if not all(v.__class__ is bool for v in (agp, cfm, add_special)) or (agp and cfm):
            raise Unsupported("generation-prompt flags vLLM reads otherwise or refuses")
        requested = body.get("chat_template")
        user_kwargs = body.get("chat_template_kwargs")
        if user_kwargs is None:
            user_kwargs = {}
        if not isinstance(user_kwargs, dict) or not isinstance(requested, (str, type(None))):
            raise Unsupported("chat_template or chat_template_kwargs of another type")
        if requested is not None and not request_templates:
            raise Unsupported("a request template, which the engines may refuse")
        requested = requested or None   # build_chat_params: "" is the default template
        if user_kwargs.keys() & (_HF_CALL_PARAMS | {"messages"}):
            raise Unsupported("chat_template_kwargs naming a parameter of the call")
        documents = body.get("documents")
        if documents is not None and not (
                isinstance(documents, list) and all(
                    isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                    for d in documents)):
            raise Unsupported("documents that are not lists of string objects")
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in _REASONING_EFFORTS:
            raise Unsupported("reasoning_effort of another value")
        tools = _tool_dicts(body.get("tools"))

        # ChatCompletionRequest.build_chat_params, then with_defaults(tools, tokenize).
        extra: dict[str, Any] = {"add_generation_prompt": agp, "continue_final_message": cfm,
                                 "documents": documents, "reasoning_effort": effort}
        if effort is not None and "enable_thinking" not in user_kwargs:
            extra["enable_thinking"] = effort != "none"
        kwargs = _merge_kwargs({"tools": tools, "tokenize": False},
                               _merge_kwargs(user_kwargs, extra))
        template = self._template(requested, tools)
        conv = conversation(body.get("messages"), content_format(template))
        if (any(m["role"] == "developer" for m in conv)
                and '"developer"' not in template and "'developer'" not in template):
            conv = _developer_to_system(conv)
        # resolve_chat_template_kwargs: only what the template reads (or the call takes).
        accepted = template_vars(template) | _HF_BASE_PARAMS
        call = {k: v for k, v in kwargs.items()
                if k in accepted and k not in ("tools", "tokenize", "chat_template")}
        call.pop("return_dict", None)
        documents = call.pop("documents", None)
        agp = call.pop("add_generation_prompt", False)
        cfm = call.pop("continue_final_message", False)
        text = _render(template, conv, {**self.special_tokens, **call}, kwargs.get("tools"),
                       documents, agp, cfm)
        return text, add_special

    def ids(self, body: dict[str, Any], request_templates: bool = False) -> list[int]:
        """The prompt's token ids as vLLM computes them; raises as ``render``."""
        text, add_special = self.render(body, request_templates)
        return self.tokenizer.encode(text, add_special)
