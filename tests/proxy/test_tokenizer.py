"""The proxy's local tokenizer against vLLM's own tokenizer loading, and its config.

The reference is what vLLM 0.32's /tokenize does for a completions string prompt:
``vllm.tokenizers.get_tokenizer`` (AutoTokenizer through vLLM's registry), called
with the encode kwargs of ``TokenizeParams`` (``renderers/base.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sessionkv_proxy.config import ConfigError, load_config
from sessionkv_proxy.tokenizer import PROBES, LocalTokenizer, first_mismatch

TEXTS = [*PROBES, "", " ", "a", "\n", "  \n  ", "ka to ri mu sen", "the user is a tool call",
         "<|bos|>", "x<|eos|>y", "<|im_start|><|im_start|>", "<think>reason</think> answer",
         "<|tool|> call <|tool|>", "<|bos", "|eos|>", "ﬁ ligature ÅÅ \u00a0nbsp \u200bzw",
         "数学 123 4567 89.01 -2e10", "\t\ttabs\t", "emoji 👨‍👩‍👧‍👦 family", "a" * 300,
         "repeat " * 50, "MiXeD CaSe WORDS", "\\n escaped \\t", "'quotes' \"double\" `tick`"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    from vllm_sessionkv.dev.tiny_model import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _vllm_ids(model_dir: Path, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    pytest.importorskip("vllm")
    from vllm.renderers.params import TokenizeParams
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(model_dir))
    kwargs = TokenizeParams(max_total_tokens=None, max_output_tokens=0,
                            add_special_tokens=add_special_tokens).get_encode_kwargs()
    return [list(tok(text, **kwargs)["input_ids"]) for text in texts]


def _variant(tiny_model: Path, dest: Path, config: dict | None = None,
             post_processor: object = ...) -> Path:
    """A copy of the tiny model's tokenizer files with edits: keys merged into
    tokenizer_config.json, the post-processor of tokenizer.json replaced."""
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model / name, dest / name)
    if config:
        cfg = json.loads((dest / "tokenizer_config.json").read_text())
        cfg.update(config)
        (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    if post_processor is not ...:
        tj = json.loads((dest / "tokenizer.json").read_text())
        tj["post_processor"] = post_processor
        (dest / "tokenizer.json").write_text(json.dumps(tj))
    return dest


_BOS_TEMPLATE = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
               {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
             {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}},
}

VARIANTS = {
    "as_generated": ({}, ...),
    # transformers 4 rebuilt the post-processor from these flags; 5 ignores them.
    "config_add_bos": ({"add_bos_token": True}, ...),
    "config_add_bos_eos": ({"add_bos_token": True, "add_eos_token": True}, ...),
    "config_add_eos_only": ({"add_eos_token": True}, ...),
    # tokenizer.json adds BOS; an explicit add_bos_token false removes it.
    "json_bos": ({}, _BOS_TEMPLATE),
    "json_bos_config_false": ({"add_bos_token": False}, _BOS_TEMPLATE),
    "no_post_processor": ({}, None),
    "no_post_processor_add_bos": ({"add_bos_token": True}, None),
    # Special tokens tokenizer_config.json names but tokenizer.json lacks are added.
    "extra_special": ({"extra_special_tokens": ["<|im_start|>", "<|im_end|>", "<|tool|>"]}, ...),
    "named_special_new": ({"unk_token": "<|unk|>", "sep_token": "<|tool|>"}, ...),
    "split_special_tokens": ({"split_special_tokens": True}, ...),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_local_ids_equal_vllm(tiny_model: Path, tmp_path: Path, name: str,
                              add_special_tokens: bool) -> None:
    config, post_processor = VARIANTS[name]
    model_dir = _variant(tiny_model, tmp_path / name, config, post_processor)
    expected = _vllm_ids(model_dir, TEXTS, add_special_tokens)
    local = LocalTokenizer(str(model_dir))
    got = [local.encode(text, add_special_tokens) for text in TEXTS]
    for text, ours, theirs in zip(TEXTS, got, expected):
        assert ours == theirs, (name, text)
    if add_special_tokens and name in ("config_add_bos", "json_bos"):
        # transformers 5 ignores add_bos_token when tokenizer.json exists: BOS comes
        # from its post-processor alone.
        assert ("json" in name) == (got[0][:1] == [0])


def test_tokenizer_json_file_path(tiny_model: Path) -> None:
    by_file = LocalTokenizer(str(tiny_model / "tokenizer.json"))
    by_dir = LocalTokenizer(str(tiny_model))
    for text in TEXTS:
        assert by_file.encode(text) == by_dir.encode(text)


def test_ids_for_completion_falls_back_where_not_mirrored(tiny_model: Path) -> None:
    local = LocalTokenizer.load(str(tiny_model))
    assert local.ids_for_completion({"prompt": "ka to"}) == local.encode("ka to")
    assert (local.ids_for_completion({"prompt": "ka to", "add_special_tokens": False})
            == local.encode("ka to", False))
    for extra in ({"truncate_prompt_tokens": 4}, {"truncate_prompt_tokens": -1},
                  {"prompt_embeds": ["AAAA"]}, {"add_special_tokens": "yes"}):
        assert local.ids_for_completion({"prompt": "ka to", **extra}) is None, extra


def _engines() -> list[dict]:
    return [{"url": "http://127.0.0.1:9", "role": "decode"}]


@pytest.mark.parametrize("bad", ["/nonexistent/model-dir", "empty-dir"])
def test_config_bad_tokenizer_path_names_the_key(tmp_path: Path, bad: str) -> None:
    if bad == "empty-dir":
        bad = str(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(None, {"engines": _engines(), "tokenizer": bad})
    assert "tokenizer" in str(info.value) and bad in str(info.value)


def test_config_unreadable_tokenizer_json_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError) as info:
        load_config(None, {"engines": _engines(), "tokenizer": str(tmp_path)})
    assert "tokenizer" in str(info.value) and str(tmp_path) in str(info.value)


def test_config_accepts_engine_none_and_a_model_dir(tiny_model: Path) -> None:
    for value in ("engine", "none", str(tiny_model), str(tiny_model / "tokenizer.json")):
        assert load_config(None, {"engines": _engines(), "tokenizer": value}).tokenizer == value


async def test_router_uses_local_ids_once_checked(tiny_model: Path) -> None:
    from sessionkv_proxy.engines import EnginePool
    from sessionkv_proxy.index.memory import MemoryIndex
    from sessionkv_proxy.router import Router
    from sessionkv_proxy.upstream import UpstreamPool

    config = load_config(None, {"engines": _engines(), "tokenizer": str(tiny_model)})
    upstream = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=1.0)
    try:
        router = Router(config, EnginePool.from_configs(config.engines), MemoryIndex(),
                        upstream)
        assert router.prompt_keys.local_tokenizer is LocalTokenizer.load(str(tiny_model))
        router.prompt_keys.local_tokenizer_ok = True  # what a passed check sets
        body = {"prompt": "the user is a tool call", "add_special_tokens": False}
        assert (await router.prompt_keys.token_ids(body, is_chat=False)
                == router.prompt_keys.local_tokenizer.encode(body["prompt"], False))
        assert await router.prompt_keys.token_ids({"prompt": [5, 6, 7]}, is_chat=False) == [5, 6, 7]
    finally:
        await upstream.close()


def test_first_mismatch_names_the_first_differing_probe() -> None:
    cases = [("a", True), ("b", True), ("c", False)]
    assert first_mismatch(cases, [[1], [2, 3], []], [[1], [2, 3], []]) is None
    assert first_mismatch(cases, [[0, 1], [2], [4]], [[1], [2], [5]]) == ("a", True)
    assert first_mismatch(cases, [[1], [2, 3], [4]], [[1], [2, 3], [4, 4]]) == ("c", False)
    with pytest.raises(ValueError):
        first_mismatch(cases, [[1], [2]], [[1], [2]])  # a missing answer is no verdict
