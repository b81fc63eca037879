"""``keys.chain_request_keys`` must agree with ``vllm_sessionkv.wire.hashing.request_keys``."""

from __future__ import annotations

import array
import random

import pytest

from sessionkv_proxy.keys import chain_request_keys
from vllm_sessionkv.wire.hashing import request_keys


@pytest.mark.parametrize("salt,lora_name", [(None, None), ("tenant-a", None),
                                            (None, "adapter"), ("tenant-a", "adapter")])
@pytest.mark.parametrize("num_tokens", [0, 15, 16, 17, 100])
def test_without_parent_equals_request_keys(salt, lora_name, num_tokens):
    rng = random.Random(num_tokens)
    tokens = [rng.randrange(2**31) for _ in range(num_tokens)]
    assert chain_request_keys(tokens, 16, salt=salt, lora_name=lora_name) == \
        request_keys(tokens, 16, salt=salt, lora_name=lora_name)


@pytest.mark.parametrize("salt", [None, "tenant-b"])
def test_chaining_from_a_parent_continues_the_whole_prompt_chain(salt):
    rng = random.Random(7)
    tokens = [rng.randrange(50_000) for _ in range(16 * 9)]
    whole = request_keys(tokens, 16, salt=salt)
    head = chain_request_keys(tokens[:16 * 4], 16, salt=salt)
    tail = chain_request_keys(tokens[16 * 4:], 16, parent=head[-1], salt="ignored")
    assert head + tail == whole


def test_salt_separates_tenants():
    tokens = list(range(32))
    assert chain_request_keys(tokens, 16, salt="a") != chain_request_keys(tokens, 16, salt="b")


def test_text_keys_follow_the_texts_common_full_blocks():
    """Keys over a prompt's text (``tokenizer: text``): one per full block, equal
    exactly as far as the two texts' blocks are equal, apart per tenant, and apart
    from token keys over the same bytes."""
    from sessionkv_proxy.keys import text_keys

    base = bytes(random.Random(3).randrange(256) for _ in range(10 * 48))
    keys = text_keys(base, 48)
    assert len(keys) == 10 and len(set(keys)) == 10
    assert text_keys(base + b"x" * 47, 48) == keys            # a partial block: no key
    edited = base[:4 * 48 + 5] + b"!" + base[4 * 48 + 6:]
    other = text_keys(edited, 48)
    assert other[:4] == keys[:4] and all(a != b for a, b in zip(other[4:], keys[4:]))
    assert not set(text_keys(base, 48, salt="tenant-a")) & set(keys)
    assert text_keys(base, 48, salt="tenant-a") == text_keys(base, 48, salt="tenant-a")
    # The bytes request_keys hashes for these ids: without its own seed, a text key
    # would equal the token key.
    ids = list(range(7, 7 + 16 * 3))
    as_bytes = array.array("I", ids).tobytes()
    assert not set(text_keys(as_bytes, 16 * 4)) & set(request_keys(ids, 16))
    assert text_keys(b"short", 48) == []
