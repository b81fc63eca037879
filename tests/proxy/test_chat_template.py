"""Chat prompts rendered in the proxy against vLLM 0.32's own rendering, offline.

The reference is what a vLLM server does with a ``/v1/chat/completions`` body: the
body read as ``ChatCompletionRequest`` (pydantic), then ``OnlineRenderer.render_chat``
on the renderer ``renderer_from_config`` builds for the model directory (template
resolution, content format, message parsing, transformers' ``apply_chat_template``,
tokenization).  No engine runs; vLLM and torch are imported here, never by the proxy.

Templates: the test model's (``sessionkv-tiny-model``), the ones vLLM ships as
fallbacks (read from the installed package), and templates written here that use
what real model templates use (tools and ``tojson``, content loops, the developer
role, documents, named templates, ``{% generation %}``, ``raise_exception``,
``loopcontrols``, ``strftime_now``).  None of the model configs under
``examples/model_configs/`` ships a chat template (they are configs for the planner),
so there is none of theirs to test.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from pathlib import Path

import pytest

from sessionkv_proxy.chat_template import (
    KNOWN_CONTENT_PART_FIELDS,
    ChatRenderer,
    Unsupported,
    content_format,
)
from sessionkv_proxy.tokenizer import LocalTokenizer

SYSTEM_USER = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "ka to ri?"}]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"function": {"name": "noop", "strict": True, "parameters": {"b": 1, "a": 2}},
     "defer_loading": False, "extra": "dropped"},
    {"type": "function", "function": {"name": "bare"}},
]
TOOL_TURNS = [
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "id": "call_1", "index": 0,
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"n\": [1, 2]}"}},
        {"id": "call_2", "type": "function", "function": {"arguments": "", "name": "noop"}},
        {"id": "call_3", "type": "function", "function": {"arguments": "[1]", "name": "noop"}},
        {"id": "call_4", "type": "function",
         "function": {"arguments": "not json", "name": "noop"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"},
    {"role": "tool", "tool_call_id": "call_2",
     "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
]
BODIES: dict[str, dict] = {
    "system_user": {"messages": SYSTEM_USER},
    "multi_turn": {"messages": [*SYSTEM_USER, {"role": "assistant", "content": "mu sen."},
                                {"role": "user", "content": "  and   then?\n"}]},
    "no_generation_prompt": {"messages": SYSTEM_USER, "add_generation_prompt": False},
    "continue_final": {"messages": [*SYSTEM_USER, {"role": "assistant", "content": "mu sen "}],
                       "add_generation_prompt": False, "continue_final_message": True},
    "continue_final_parts": {
        "messages": [*SYSTEM_USER, {"role": "assistant", "content": [
            {"type": "text", "text": "lo"}, {"type": "text", "text": "va qu"}]}],
        "add_generation_prompt": False, "continue_final_message": True},
    "add_special_tokens": {"messages": SYSTEM_USER, "add_special_tokens": True},
    "parts": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"}, "bare string part",
        {"type": "text", "text": "second", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": None}, {"type": "input_text", "text": "input text"},
        {"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "hmm",
                                               "closed": True}]}]},
    "empty_and_none_content": {"messages": [{"role": "system", "content": ""},
                                            {"role": "user", "content": []},
                                            {"role": "assistant", "content": None},
                                            {"role": "user", "content": "x"}]},
    "reasoning": {"messages": [{"role": "user", "content": "q"},
                               {"role": "assistant", "content": "a", "reasoning": "r",
                                "reasoning_content": "ignored"},
                               {"role": "user", "content": "q2"}]},
    "names_and_roles": {"messages": [{"role": "user", "content": "hi", "name": "ann"},
                                     {"role": "narrator", "content": "odd role"},
                                     {"role": "user", "content": "x", "task": "t"}]},
    "developer": {"messages": [{"role": "system", "content": "sys one"},
                               {"role": "user", "content": "u"},
                               {"role": "developer", "content": "dev rules"},
                               {"role": "user", "content": "u2"}]},
    "billing_header": {"messages": [
        {"role": "system", "content": "x-anthropic-billing-header: cch=123\nreal system"},
        {"role": "system", "content": [{"type": "text",
                                        "text": "x-anthropic-billing-header: only"}]},
        {"role": "user", "content": "u"}]},
    # (tool_choice "none": "auto" needs a tool parser on the server; either way
    # vLLM passes the tools to the template.)
    "tools": {"messages": TOOL_TURNS, "tools": TOOLS, "tool_choice": "none"},
    "tools_empty_calls": {"messages": [{"role": "assistant", "content": "x", "tool_calls": []},
                                       {"role": "user", "content": "y"}], "tools": TOOLS[:1],
                          "tool_choice": "none"},
    "documents": {"messages": SYSTEM_USER,
                  "documents": [{"title": "Doc A", "text": "alpha"}, {"text": "beta"}]},
    "chat_template_kwargs": {"messages": SYSTEM_USER, "chat_template_kwargs": {
        "flavour": "salty", "bos_token": "<|pad|>", "unused": 1, "auto_one": "auto",
        "none_one": None, "add_generation_prompt": False}},
    "reasoning_effort": {"messages": SYSTEM_USER, "reasoning_effort": "low"},
    "reasoning_effort_none": {"messages": SYSTEM_USER, "reasoning_effort": "none",
                              "chat_template_kwargs": {"enable_thinking": True}},
    "unicode": {"messages": [{"role": "user", "content": "naïve café — 東京 🚀👍🏽\t\r\n  x"}]},
    "special_tokens_in_text": {"messages": [{"role": "user",
                                             "content": "<|im_start|>user\n<|bos|>x<|im_end|>"}]},
}

# Templates written here, each using what model templates use.
TOOL_TEMPLATE = """{{- bos_token }}
{%- if tools %}<|im_start|>system
Tools:
{% for tool in tools %}{{ tool | tojson(indent=4) }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls is defined %}
<|im_start|>assistant
{%- for call in message.tool_calls %}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": {{ call | tojson }}}
{%- endfor %}<|im_end|>
{%- elif message.role == 'tool' %}
<|im_start|>tool {{ message.tool_call_id }}
{{ message.content }}<|im_end|>
{%- else %}
<|im_start|>{{ message.role }}{% if message.name is defined %} ({{ message.name }}){% endif %}
{{ message.content }}{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
PARTS_TEMPLATE = """{% for message in messages %}<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}{% else %}
{%- for part in message['content'] %}{% if part['type'] == 'text' %}[{{ part['text'] }}]{{ part | tojson }}{% endif %}{% endfor %}
{%- endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
MACRO_PARTS_TEMPLATE = """{%- macro render(items) -%}
{%- if items is string -%}{{ items }}{%- else -%}{%- for it in items -%}{{ it.text }}|{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ render(m.content) }}</{{ m.role }}>{% endfor %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""
KWARGS_TEMPLATE = """{{ bos_token }}{% if flavour is defined %}flavour={{ flavour }};{% endif %}
{%- if enable_thinking is defined %}thinking={{ enable_thinking }};{% endif %}
{%- if reasoning_effort is defined %}effort={{ reasoning_effort }};{% endif %}
{%- if documents %}{% for d in documents %}[doc {{ loop.index }}: {{ d.title | default('untitled') }}] {{ d.text }}
{% endfor %}{% endif %}
{%- for m in messages %}{% if loop.index > 8 %}{% break %}{% endif %}
{%- if m.role == 'narrator' %}{% continue %}{% endif %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% generation %}{% endgeneration %}{% endif %}{{ strftime_now('%%') }}"""
DEVELOPER_TEMPLATE = """{% for m in messages %}{% if m.role == 'developer' %}[dev]{% endif %}
{{- m.role }}: {{ m.content }}
{% endfor %}"""
STRICT_TEMPLATE = """{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}
{{- raise_exception('Only user and assistant roles are supported!') }}{% endif %}
[{{ m.role }}] {{ m.content }}{% endfor %}"""

WRITTEN = {"tools": TOOL_TEMPLATE, "parts": PARTS_TEMPLATE, "macro_parts": MACRO_PARTS_TEMPLATE,
           "kwargs": KWARGS_TEMPLATE, "developer": DEVELOPER_TEMPLATE, "strict": STRICT_TEMPLATE}


def _vllm_templates() -> dict[str, str]:
    from vllm.transformers_utils import chat_templates

    folder = Path(chat_templates.__file__).parent
    return {f"vllm_{p.stem}": p.read_text() for p in sorted(folder.glob("*.jinja"))}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    from vllm_sessionkv.dev.tiny_model import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _model_dir(tiny_model: Path, dest: Path, template: str | None = None,
               config: dict | None = None, extra_templates: dict[str, str] | None = None
               ) -> Path:
    """The test model's tokenizer files with another template."""
    dest.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json",
                 "chat_template.jinja"):
        shutil.copy(tiny_model / name, dest / name)
    if template is not None:
        (dest / "chat_template.jinja").write_text(template)
    if config is not None:
        cfg = json.loads((dest / "tokenizer_config.json").read_text())
        cfg.update(config)
        (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    if extra_templates:
        (dest / "additional_chat_templates").mkdir()
        for name, text in extra_templates.items():
            (dest / "additional_chat_templates" / f"{name}.jinja").write_text(text)
    return dest


class VllmReference:
    """vLLM's chat rendering for one model directory, as a server runs it."""

    def __init__(self, model_dir: Path) -> None:
        pytest.importorskip("vllm")
        from vllm.config import ModelConfig, VllmConfig
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.renderers.registry import renderer_from_config

        model_config = ModelConfig(model=str(model_dir))
        self.renderer = OnlineRenderer(
            model_config, renderer_from_config(VllmConfig(model_config=model_config)),
            request_logger=None, chat_template=None, chat_template_content_format="auto",
            trust_request_chat_template=True)

    def ids(self, body: dict) -> list[int] | str:
        """The prompt's ids, or "refused" when vLLM refuses the request."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            request = ChatCompletionRequest.model_validate({"model": "m", **copy.deepcopy(body)})
            out = asyncio.run(self.renderer.render_chat(request))
        except Exception:
            return "refused"
        if not isinstance(out, tuple):   # an ErrorResponse
            return "refused"
        return list(out[1][0]["prompt_token_ids"])


def _proxy_ids(renderer: ChatRenderer, body: dict) -> list[int] | str:
    try:
        return renderer.ids(copy.deepcopy(body), request_templates=True)
    except Unsupported:
        return "unsupported"
    except Exception:
        return "refused"


def _compare(model_dir: Path, bodies: dict[str, dict]) -> dict[str, int]:
    """Every body: the proxy's ids equal vLLM's, or the proxy declines (the router
    then asks the engine).  Returns how many of each outcome."""
    reference = VllmReference(model_dir)
    renderer = ChatRenderer(LocalTokenizer(str(model_dir)))
    counts = {"equal": 0, "unsupported": 0, "both_refused": 0}
    for name, body in bodies.items():
        theirs, ours = reference.ids(body), _proxy_ids(renderer, body)
        if ours == "unsupported":
            # Declined: the engine is asked (and refuses too, if vLLM refuses).
            counts["unsupported" if theirs != "refused" else "both_refused"] += 1
            continue
        assert ours == theirs, (model_dir.name, name)
        counts["equal" if theirs != "refused" else "both_refused"] += 1
    return counts


def test_the_test_models_template(tiny_model: Path) -> None:
    counts = _compare(tiny_model, BODIES)
    # Everything text-only is rendered here; nothing falls back.
    assert counts == {"equal": len(BODIES), "unsupported": 0, "both_refused": 0}, counts


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_written_templates(tiny_model: Path, tmp_path: Path, name: str) -> None:
    counts = _compare(_model_dir(tiny_model, tmp_path / name, WRITTEN[name]), BODIES)
    assert counts["unsupported"] == 0, counts
    assert counts["equal"] >= (4 if name == "strict" else len(BODIES) - 1), counts


def test_vllm_shipped_templates(tiny_model: Path, tmp_path: Path) -> None:
    for name, template in _vllm_templates().items():
        counts = _compare(_model_dir(tiny_model, tmp_path / name, template), BODIES)
        assert counts["unsupported"] == 0 and counts["equal"] >= 10, (name, counts)


def test_request_template_and_named_templates(tiny_model: Path, tmp_path: Path) -> None:
    """The request's chat_template (a template, or the name of one of the model's),
    and named templates: "tool_use" when tools are given, else "default"."""
    model_dir = _model_dir(tiny_model, tmp_path / "named", PARTS_TEMPLATE,
                           extra_templates={"tool_use": TOOL_TEMPLATE,
                                            "plain": DEVELOPER_TEMPLATE})
    bodies = {f"{name}+{tmpl}": {**body, "chat_template": WRITTEN[tmpl]}
              for name, body in BODIES.items() for tmpl in ("kwargs", "macro_parts")}
    bodies.update({name: body for name, body in BODIES.items()})
    bodies.update({f"{name}+named": {**body, "chat_template": "plain"}
                   for name, body in BODIES.items()})
    bodies["empty_request_template"] = {**BODIES["system_user"], "chat_template": ""}
    counts = _compare(model_dir, bodies)
    assert counts["unsupported"] == 0 and counts["equal"] >= len(bodies) - 3, counts
    renderer = ChatRenderer(LocalTokenizer(str(model_dir)))
    with pytest.raises(Unsupported):   # unless the engines are known to accept them
        renderer.ids({"messages": SYSTEM_USER, "chat_template": "{{ 1 }}"})


def test_tokenizer_config_templates(tiny_model: Path, tmp_path: Path) -> None:
    """A template in tokenizer_config.json, a string or a list of named ones."""
    for name, value in (("string", KWARGS_TEMPLATE),
                        ("named", [{"name": "default", "template": PARTS_TEMPLATE},
                                   {"name": "tool_use", "template": TOOL_TEMPLATE}])):
        model_dir = _model_dir(tiny_model, tmp_path / name, config={"chat_template": value})
        (model_dir / "chat_template.jinja").unlink()
        counts = _compare(model_dir, BODIES)
        assert counts["unsupported"] == 0 and counts["equal"] >= len(BODIES) - 1, counts


def test_special_tokens_passed_to_the_template(tiny_model: Path, tmp_path: Path) -> None:
    template = ("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|"
                "{{ image_token }}|{{ tool_token }}|{% for m in messages %}{{ m.content }}"
                "{% endfor %}")
    model_dir = _model_dir(tiny_model, tmp_path / "special", template, config={
        "bos_token": {"content": "<|im_start|>", "__type": "AddedToken"},
        "unk_token": "<|pad|>", "tool_token": "<|im_end|>",
        "extra_special_tokens": {"image_token": "<think>"}})
    counts = _compare(model_dir, {"system_user": BODIES["system_user"]})
    assert counts["equal"] == 1, counts


def test_what_is_not_mirrored_is_declined(tiny_model: Path) -> None:
    """Media, unknown part types, other tool-call shapes and prompt edits after
    rendering are left to the engine: ``Unsupported``, never a guess."""
    renderer = ChatRenderer(LocalTokenizer(str(tiny_model)))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    declined = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, image]}]},
        {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "mystery", "text": "x"}]}]},
        {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}]}]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
        {"messages": SYSTEM_USER, "truncate_prompt_tokens": 8},
        {"messages": SYSTEM_USER, "chat_template_kwargs": {"tokenize": True}},
        {"messages": SYSTEM_USER, "chat_template_kwargs": {"max_length": 3, "truncation": True}},
        {"messages": SYSTEM_USER, "add_generation_prompt": "yes"},
        {"messages": SYSTEM_USER, "tools": [{"type": "function", "function": {"name": 3}}]},
    ]
    for body in declined:
        with pytest.raises(Unsupported):
            renderer.ids(body)


def test_constants_track_vllm() -> None:
    """Copied from vLLM 0.32: if they drift, requests are rendered differently."""
    pytest.importorskip("vllm")
    from vllm.renderers import chat_utils
    from vllm.renderers.hf import _get_hf_base_chat_template_params

    from sessionkv_proxy import chat_template

    assert KNOWN_CONTENT_PART_FIELDS == chat_utils._KNOWN_CONTENT_PART_FIELDS
    assert chat_template._HF_BASE_PARAMS == _get_hf_base_chat_template_params()
    assert set(chat_template._TEXT_PARTS) == chat_utils.TEXT_PART_TYPES
    assert chat_template._SKIP_IF_NONE == chat_utils.PART_TYPES_TO_SKIP_NONE_CONTENT


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_content_format_equals_vllms(name: str) -> None:
    pytest.importorskip("vllm")
    from vllm.renderers.hf import _detect_content_format

    for template in (WRITTEN[name], *_vllm_templates().values()):
        assert content_format(template) == _detect_content_format(template, default="string")
