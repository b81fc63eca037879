"""A session's prompt tokenized from its last turn's (``text_ids.py``) gives the ids
of tokenizing the whole text, on tokenizers of several kinds built here (byte-level
BPE as Qwen/SmolLM, Metaspace "first" and a Llama-2 style normalizer, added tokens
with every flag, one added token a prefix of another), over conversations that grow,
are edited in the middle, shrink and are sent again."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from sessionkv_proxy.text_ids import ExtendingIds

CHAT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
WORDS = ["the", "user", "asked", "about", "café", "東京", "🚀", "42", "3.14", "x=y+1",
         "  ", "\n", "\n\n", " \n ", "\t", "<tool>", "<sw>", "<norm>", "<|im_start|>",
         "<|im_end|>", "<|im_start|>assistant", "assistant", "<", "|>", "ka", "to", "ri"]
CORPUS = [" ".join(random.Random(i).choice(WORDS) for _ in range(40)) for i in range(200)]


def _trained(pre_tokenizer=None, normalizer=None, alphabet=()) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(CHAT), initial_alphabet=list(alphabet),
        show_progress=False))
    return tok


def _byte_level(add_prefix_space: bool = False) -> Tokenizer:
    return _trained(pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space),
                    alphabet=pre_tokenizers.ByteLevel.alphabet())


def _with_flagged_tokens(tok: Tokenizer) -> Tokenizer:
    tok.add_special_tokens([AddedToken("<tool>", lstrip=True, rstrip=True),
                            AddedToken("<sw>", single_word=True),
                            AddedToken("<|im_start|>assistant", normalized=False)])
    tok.add_tokens([AddedToken("<norm>", normalized=True)])
    return tok


def _split_special(tok: Tokenizer) -> Tokenizer:
    tok.encode_special_tokens = True
    return tok


TOKENIZERS = {
    "byte_level": _byte_level,
    "byte_level_prefix_space": lambda: _byte_level(add_prefix_space=True),
    "byte_level_flagged_tokens": lambda: _with_flagged_tokens(_byte_level()),
    "metaspace_first": lambda: _trained(pre_tokenizers.Metaspace(prepend_scheme="first")),
    "metaspace_always_flagged": lambda: _with_flagged_tokens(
        _trained(pre_tokenizers.Metaspace(prepend_scheme="always"))),
    "llama2_normalizer": lambda: _trained(normalizer=normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])),
    "nfkc_lowercase": lambda: _with_flagged_tokens(_trained(
        pre_tokenizers.Whitespace(), normalizers.Sequence(
            [normalizers.NFKC(), normalizers.Lowercase()]))),
    "split_special_tokens": lambda: _split_special(_byte_level()),
}


def _render(messages: list[tuple[str, str]], generation_prompt: bool = True) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def _content(rng: random.Random) -> str:
    sep = rng.choice(["", " "])
    return sep.join(rng.choice(WORDS) for _ in range(rng.randrange(0, 30)))


def _texts(rng: random.Random, steps: int):
    """A session's prompts: turns added, and now and then an earlier message edited,
    the conversation cut short, or the same prompt sent again."""
    messages: list[tuple[str, str]] = [("system", _content(rng))]
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.1 and len(messages) > 1:
            i = rng.randrange(len(messages))
            messages[i] = (messages[i][0], _content(rng))
        elif roll < 0.2 and len(messages) > 2:
            del messages[rng.randrange(1, len(messages)):]
        elif roll < 0.3:
            pass
        else:
            messages += [("user", _content(rng)), ("assistant", _content(rng))]
        yield _render(messages[:-1] if messages[-1][0] == "assistant" else messages,
                      generation_prompt=rng.random() < 0.8)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_ids_equal_the_whole_texts(name: str) -> None:
    tok = TOKENIZERS[name]()
    ids = ExtendingIds(tok, check_first=0, check_every=10**9)   # no self-check
    rng = random.Random(name)
    for session in range(12):
        for text in _texts(rng, 14):
            assert ids.ids(f"s{session}", text, False) == \
                tok.encode(text, add_special_tokens=False).ids, (name, text)
    if name == "split_special_tokens":
        assert not ids.enabled and ids.extended == 0
    else:
        assert ids.enabled and ids.extended > 50


def test_special_tokens_or_no_session_tokenize_the_whole_text() -> None:
    tok = _byte_level()
    ids = ExtendingIds(tok)
    for text in (_render([("user", "hi")]), _render([("user", "hi"), ("assistant", "yo"),
                                                     ("user", "more")])):
        assert ids.ids("s", text, True) == tok.encode(text, add_special_tokens=True).ids
        assert ids.ids(None, text, False) == tok.encode(text, add_special_tokens=False).ids
    assert ids.extended == 0


def test_sessions_past_the_budget_are_dropped_oldest_first() -> None:
    tok = _byte_level()
    ids = ExtendingIds(tok, max_tokens=300, check_first=0, check_every=10**9)
    rng = random.Random(1)
    conversations = {f"s{i}": [("user", _content(rng))] for i in range(6)}
    for _ in range(4):
        for key, messages in conversations.items():
            messages += [("assistant", _content(rng)), ("user", _content(rng))]
            text = _render(messages)
            assert ids.ids(key, text, False) == tok.encode(text, add_special_tokens=False).ids
            assert ids._tokens == sum(len(t.ids) for t in ids._texts.values()) <= 300


class _Wrong:
    """A tokenizer whose ids of a text starting at a cut token are off by one token:
    what the self-check is there to catch."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.encode_special_tokens = tok.encode_special_tokens

    def get_added_tokens_decoder(self):
        return self._tok.get_added_tokens_decoder()

    def encode(self, text: str, add_special_tokens: bool = True):
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        if text.startswith("<|im_end|>") and len(enc.ids) > 2:
            return _Encoding(enc, enc.ids + [7])
        return enc


class _Encoding:
    def __init__(self, enc, ids: list[int]) -> None:
        self._enc, self.ids = enc, ids

    def token_to_chars(self, i: int):
        return self._enc.token_to_chars(i)


def test_a_wrong_extension_is_caught_answered_whole_and_turns_extending_off(caplog) -> None:
    tok = _byte_level()
    ids = ExtendingIds(_Wrong(tok), check_first=1)
    first = _render([("user", "the user asked")])
    second = _render([("user", "the user asked"), ("assistant", "ka to ri"),
                      ("user", "about café")])
    assert ids.ids("s", first, False) == tok.encode(first, add_special_tokens=False).ids
    with caplog.at_level(logging.ERROR, "sessionkv_proxy.text_ids"):
        assert ids.ids("s", second, False) == tok.encode(second, add_special_tokens=False).ids
    assert "tokenized whole from now on" in caplog.text
    assert not ids.enabled and not ids._texts


async def test_the_router_tokenizes_a_chat_sessions_turn_from_its_last(tmp_path: Path) -> None:
    from sessionkv_proxy.config import load_config
    from sessionkv_proxy.engines import EnginePool
    from sessionkv_proxy.index.memory import MemoryIndex
    from sessionkv_proxy.router import Router
    from sessionkv_proxy.upstream import UpstreamPool

    _byte_level().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", '
        '"chat_template": "{% for m in messages %}<|im_start|>{{ m[\'role\'] }}\\n'
        '{{ m[\'content\'] }}<|im_end|>\\n{% endfor %}{% if add_generation_prompt %}'
        '<|im_start|>assistant\\n{% endif %}"}')
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    config = load_config(None, {"engines": [{"url": "http://127.0.0.1:9", "role": "decode"}],
                                "tokenizer": str(tmp_path)})
    upstream = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=1.0)
    try:
        keys = Router(config, EnginePool.from_configs(config.engines), MemoryIndex(),
                      upstream).prompt_keys
        keys.local_tokenizer_ok = keys.local_chat_ok = True   # what a passed check sets
        messages = [{"role": "user", "content": "the user asked about café"}]
        for turn in range(3):
            body = {"model": "m", "messages": list(messages)}
            assert await keys.token_ids(body, True, "session-a") == keys.local_chat.ids(body)
            messages += [{"role": "assistant", "content": f"ka to ri {turn}"},
                         {"role": "user", "content": "and 東京?"}]
        assert keys.chat_ids.extended == 2
        assert await keys.token_ids(body, True) == keys.local_chat.ids(body)   # no session
        assert keys.chat_ids.extended == 2
    finally:
        await upstream.close()
