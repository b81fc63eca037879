"""``keys.chain_request_keys`` must agree with ``vllm_sessionkv.hashing.request_keys``."""

from __future__ import annotations

import random

import pytest

from sessionkv_proxy.keys import chain_request_keys
from vllm_sessionkv.hashing import request_keys


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
