"""The proxy refuses exactly the ``cache_salt`` values vLLM 0.32's request models
refuse: a 400 from either, never a request the proxy takes and vLLM would not (or
one the proxy refuses that vLLM would serve)."""

from __future__ import annotations

import importlib.util

import pytest

from sessionkv_proxy.request import validate
from sessionkv_proxy.errors import ApiError

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

# With vLLM installed a moved module fails these tests, never skips them.
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402

SALTS = [None, "t", "tenant-a", "é東🚀", "x" * 128, "x" * 129, "", " ", 5, 0, 5.0, 5.5,
         True, False, [], ["t"], {"t": 1}, "a@b", "a/b", "a\\b", "a\x00b", "a:b", "a\nb"]


def _refused_by_vllm(model, body: dict) -> bool:
    try:
        model.model_validate(body)
    except Exception:   # pydantic's ValidationError, or vLLM's own, raised as is
        return True
    return False


def _refused_by_proxy(body: dict, is_chat: bool) -> bool:
    try:
        validate(dict(body), is_chat, frozenset())
    except ApiError as err:
        assert err.status == 400 and err.param == "cache_salt", err.message
        return True
    return False


@pytest.mark.parametrize("salt", SALTS, ids=repr)
def test_cache_salt_is_refused_as_vllm_refuses_it(salt):
    completion = {"model": "m", "prompt": "hello", "cache_salt": salt}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "cache_salt": salt}
    assert _refused_by_proxy(completion, False) == _refused_by_vllm(CompletionRequest,
                                                                     completion)
    assert _refused_by_proxy(chat, True) == _refused_by_vllm(ChatCompletionRequest, chat)
