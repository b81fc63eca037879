"""Token ids for a ``/v1/completions`` string prompt, computed in the proxy.

Routing hashes the prompt's token ids into KV block keys.  Asking an engine's
``/tokenize`` costs an HTTP round trip on the critical path; this module gives the
same ids from the model's ``tokenizer.json`` with the Rust ``tokenizers`` library
(no torch, no transformers).

What vLLM 0.32 does for a completions string prompt (``renderers/base.py``
``_tokenize_prompt``): ``tokenizer(prompt, add_special_tokens=..., truncation=...)``
on the tokenizer ``AutoTokenizer.from_pretrained`` gives (transformers 5).  For the
generic fast tokenizer (``tokenizer_class`` ``TokenizersBackend`` or
``PreTrainedTokenizerFast``) that is ``tokenizer.json`` plus these edits from
``tokenizer_config.json``, all mirrored here:

* special tokens it names (``bos_token`` ... ``mask_token``, other ``*_token`` keys,
  ``extra_special_tokens``/``additional_special_tokens``, ``added_tokens_decoder``;
  ``special_tokens_map.json`` when there is no ``added_tokens_decoder``) that
  ``tokenizer.json`` lacks are added, so they are matched whole in the text;
* BOS/EOS come from the post-processor of ``tokenizer.json`` alone: transformers 5
  drops ``add_bos_token``/``add_eos_token`` of ``tokenizer_config.json`` whenever a
  ``tokenizer.json`` exists (``_from_pretrained``), unlike transformers 4's
  ``LlamaTokenizerFast``, which rebuilt the post-processor from them.  (A missing
  post-processor becomes ``$A``, which adds nothing: the same ids.)  So nothing is
  done here, and the tests pin it against vLLM's loader;
* ``split_special_tokens`` (special tokens in the text are split like plain text);
* truncation and padding baked into ``tokenizer.json`` are off (vLLM passes
  ``truncation=False`` to ``/tokenize``).

Not covered (the ids may differ; the proxy's self-check against the engine then
turns this off, see ``first_mismatch``):

* model-specific tokenizer classes (``LlamaTokenizerFast``, ``Qwen2Tokenizer``, ...)
  or no ``tokenizer_class`` at all: transformers 5 may rebuild their normalizer and
  pre-tokenizer in Python instead of reading ``tokenizer.json``;
* ``--tokenizer-mode`` other than ``auto``/``hf`` (mistral, deepseek, ...), a
  ``vllm serve --tokenizer`` other than the directory given here, a
  ``sentence_bert_config.json`` with ``do_lower_case``, ``fix_mistral_regex``,
  encoder-decoder models;
* request fields vLLM applies after tokenizing: ``truncate_prompt_tokens`` (and with
  it ``truncation_side``), ``prompt_embeds``.  ``ids_for_completion`` returns None
  for those and the router asks the engine.  Prompts over the model's length are
  refused by the engine whatever ids route them.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

__all__ = ["PROBES", "LocalTokenizer", "first_mismatch", "read_json_object",
           "resolve_tokenizer_file"]

logger = logging.getLogger("sessionkv_proxy.tokenizer")

_GENERIC_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast")
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
_TOKEN_PROPS = ("single_word", "lstrip", "rstrip", "normalized", "special")

# Compared with the engine's /tokenize once, with and without special tokens: where
# tokenizers usually differ (bytes, whitespace runs, text next to special tokens).
PROBES = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café — 東京 🚀👍🏽 émoji",
    "  leading and trailing spaces  ",
    "multiple    spaces\tand\ttabs",
    "line one\nline two\n\n\nline five\r\n",
    "<s></s><|bos|><|eos|><|im_start|>user\nhi<|im_end|><|endoftext|><unk>[INST]",
    " <|im_start|> spaced <|im_end|> ",
    "def f(x):\n    return x**2  # 42\n",
)


def resolve_tokenizer_file(path: str) -> Path:
    """``tokenizer.json`` for a model directory or the file itself; ValueError if
    neither exists."""
    p = Path(path).expanduser()
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"tokenizer must be 'engine', 'none', a directory holding "
                         f"tokenizer.json or a tokenizer.json file; {path!r} is none")
    return file


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file's object; {} when the file is missing or holds something else."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


class LocalTokenizer:
    """A model's tokenizer as vLLM applies it to a completions string prompt."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import AddedToken, Tokenizer
        except ImportError:
            raise ValueError(f"tokenizer {path!r}: tokenizing in the proxy needs the "
                             "'tokenizers' package (pip install 'vllm-sessionkv[proxy]')"
                             ) from None
        file = resolve_tokenizer_file(path)
        try:
            tok = Tokenizer.from_file(str(file))
            cfg = read_json_object(file.parent / "tokenizer_config.json")
        except Exception as exc:
            raise ValueError(f"tokenizer {path!r}: cannot load {file}: {exc}") from None
        self.path = str(file)
        self.tokenizer_class = cfg.get("tokenizer_class")
        if self.tokenizer_class not in _GENERIC_CLASSES:
            logger.warning("tokenizer %s: tokenizer_class %s may be rebuilt by transformers "
                           "differently from tokenizer.json; the check against the engine "
                           "decides whether local ids are used", file, self.tokenizer_class)
        tok.no_truncation()
        tok.no_padding()

        def added(value: Any, special: bool | None) -> Any:
            if isinstance(value, str):
                return AddedToken(value, special=True, normalized=False)
            if isinstance(value, dict) and isinstance(value.get("content"), str):
                props = {k: value[k] for k in _TOKEN_PROPS if k in value}
                if special is not None:
                    props["special"] = special
                return AddedToken(value["content"], **props)
            return None

        decoder = cfg.get("added_tokens_decoder")
        specials = cfg if decoder else {**read_json_object(file.parent / "special_tokens_map.json"),
                                        **cfg}
        plain = [added(v, None) for _, v in
                 sorted((decoder or {}).items(), key=lambda kv: int(kv[0]))]
        named = [added(v, True) for k, v in specials.items()
                 if k in _NAMED_SPECIAL or (k.endswith("_token") and isinstance(v, (str, dict)))]
        extra = specials.get("extra_special_tokens") or specials.get("additional_special_tokens")
        named += [added(v, True) for v in
                  (extra.values() if isinstance(extra, dict) else extra or ())]
        # Like transformers: only tokens tokenizer.json lacks (the Rust side skips a
        # content it already has, so existing tokens keep their lstrip/rstrip).
        have = {t.content for t in tok.get_added_tokens_decoder().values()}
        tok.add_tokens([t for t in plain if t is not None and t.content not in have])
        tok.add_special_tokens([t for t in named if t is not None and t.content not in have])

        tok.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        self._tok = tok

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer``, set up as above (read, never changed)."""
        return self._tok

    @classmethod
    @functools.lru_cache(maxsize=4)
    def load(cls, path: str) -> "LocalTokenizer":
        """One instance per path: config validation and the router share it."""
        return cls(path)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def ids_for_completion(self, body: dict[str, Any]) -> list[int] | None:
        """The ids vLLM gives ``body["prompt"]`` (a string), or None where the request
        asks for something not mirrored here (the engine is asked instead)."""
        add_special = body.get("add_special_tokens", True)
        if (not isinstance(add_special, bool) or body.get("truncate_prompt_tokens") is not None
                or body.get("prompt_embeds")):
            return None
        return self.encode(body["prompt"], add_special)


def first_mismatch(cases: list[tuple[str, bool]], local: list[list[int]],
                   engine: list[list[int]]) -> tuple[str, bool] | None:
    """The first ``(probe, add_special_tokens)`` whose local ids differ from the
    engine's, or None when all agree."""
    for case, ours, theirs in zip(cases, local, engine, strict=True):
        if list(ours) != list(theirs):
            return case
    return None
