"""The proxy reads the request fields it acts on as vLLM's pydantic models do."""

from __future__ import annotations

import pytest

from sessionkv_proxy.request import lax_bool as _lax_bool
from sessionkv_proxy.request import lax_int as _lax_int

pydantic = pytest.importorskip("pydantic")


class _VllmFields(pydantic.BaseModel):
    # As in vLLM 0.32's CompletionRequest / ChatCompletionRequest.
    max_tokens: int | None = None
    stream: bool | None = False


INT_VALUES = ["5", " 5 ", "5.0", "5.", "5.000", "-0.0", "5_0.0", "5.0_0", " +5.0 ", "05",
              "\t5\n", "\u0665", "+5", "-1", "5_0", "0", 5.0, 5, True, False, None, 5.5,
              "1e3", "0x10", "", "five", "5.5", float("inf"), [5], {"n": 5}]
BOOL_VALUES = [True, False, None, 1, 0, 1.0, 0.0, 2, -1, "true", "True", "TRUE", "yes",
               "on", "1", "t", "y", "false", "off", "no", "0", "f", "n", "maybe",
               " true ", "", [True]]


def _pydantic(field: str, value):
    try:
        return getattr(_VllmFields(**{field: value}), field)
    except pydantic.ValidationError:
        return ValueError


def _ours(fn, value):
    try:
        return fn(value)
    except ValueError:
        return ValueError


@pytest.mark.parametrize("value", INT_VALUES, ids=repr)
def test_max_tokens_reads_as_pydantic_reads_it(value):
    theirs, ours = _pydantic("max_tokens", value), _ours(_lax_int, value)
    assert ours == theirs and type(ours) is type(theirs), (value, ours, theirs)


@pytest.mark.parametrize("value", BOOL_VALUES, ids=repr)
def test_stream_reads_as_pydantic_reads_it(value):
    theirs, ours = _pydantic("stream", value), _ours(_lax_bool, value)
    assert ours == theirs and type(ours) is type(theirs), (value, ours, theirs)
