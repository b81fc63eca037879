"""A client's generation request, read once into a frozen :class:`ClientRequest`.

vLLM reads a request with pydantic in lax mode: "5" and 5.0 are a max_tokens of 5,
"true" and 1 a stream of True, and no model is its served model.  The proxy reads
the fields it acts on the same way, so that a request vLLM serves is served through
the proxy too, and means the same to both.  What it refuses, it refuses as vLLM
would (the same status and a message naming the field).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from sessionkv_proxy.errors import ApiError
from sessionkv_proxy.sessions import valid_session_id

__all__ = ["HOLD_HINT_HEADER", "ClientRequest", "hold_hint_of", "lax_bool", "lax_int",
           "new_request_id", "read_json", "session_id_of", "validate"]

_body_decoder = msgspec.json.Decoder()
# Request ids: a per-process random prefix and a counter (uuid4 per request costs more
# than the rest of the routing decision).
_REQUEST_ID_PREFIX = f"skv-{os.urandom(6).hex()}-"
_request_counter = itertools.count()

_LAX_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_LAX_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_LAX_INT = re.compile(r"\s*([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?\s*", re.ASCII)
_MAX_CACHE_SALT_CHARS = 128
# The client's hint of how long to hold its session's KV (seconds).
HOLD_HINT_HEADER = "X-Session-Hold-S"
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """One generation request as the proxy read it; nothing changes it afterwards
    (the bodies sent to engines are new dicts built from ``body``)."""

    request_id: str
    path: str          # /v1/completions or /v1/chat/completions
    is_chat: bool
    body: dict[str, Any]   # validated, its lax fields normalized; read only
    raw_body: bytes        # the client's own bytes, sent as they are when unchanged
    session_id: str | None
    # X-Session-Hold-S, clamped: how long the client expects before the session's
    # next turn (D's retention rule takes it as the hold's lease); None: not sent.
    hold_hint_s: float | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def new_request_id(headers: Mapping[str, str]) -> str:
    """The client's ``X-Request-Id``, else a new one."""
    return headers.get("x-request-id") or f"{_REQUEST_ID_PREFIX}{next(_request_counter)}"


def read_json(raw: bytes) -> dict[str, Any]:
    # The server has already refused bodies over max_body_bytes with a 413.
    try:
        body = _body_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def lax_bool(value: Any) -> bool | None:
    if value is None or value.__class__ is bool:
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in _LAX_TRUE:
            return True
        if lowered in _LAX_FALSE:
            return False
    raise ValueError(value)


def lax_int(value: Any) -> int | None:
    if value is None or value.__class__ is int:
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _LAX_INT.fullmatch(value)
        if match:
            return int(match.group(1))
    raise ValueError(value)


def validate(body: dict[str, Any], is_chat: bool, model_ids: frozenset[str]) -> None:
    """Refuse what vLLM would refuse on the fields the proxy reads; normalize those
    fields in ``body`` to what vLLM reads them as.  ``model_ids``: the served models
    (empty while none is known: any model passes)."""
    _validate_model(body.get("model"), model_ids)
    _validate_prompt(body, is_chat)
    if "stream" in body:
        try:
            body["stream"] = lax_bool(body["stream"])
        except ValueError:
            raise ApiError(400, "'stream' must be a boolean", param="stream") from None
    for key in ("max_tokens", "max_completion_tokens", "n"):
        if key not in body:
            continue
        try:
            value = body[key] = lax_int(body[key])
            valid = value is None or value >= 0
        except ValueError:
            valid = False
        if not valid:
            raise ApiError(400, f"'{key}' must be a non-negative integer", param=key)
    _validate_cache_salt(body.get("cache_salt"))
    xargs = body.get("vllm_xargs")
    if "kv_transfer_params" in body or (isinstance(xargs, dict)
                                        and "kv_transfer_params" in xargs):
        # vLLM also reads it from vllm_xargs: that door is closed the same way.
        raise ApiError(400, "'kv_transfer_params' is set by the proxy, not the client",
                       param="kv_transfer_params")


def _validate_model(model: Any, model_ids: frozenset[str]) -> None:
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if model is not None and model_ids and model not in model_ids:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                       type_="NotFoundError", code="model_not_found")


def _validate_prompt(body: dict[str, Any], is_chat: bool) -> None:
    if is_chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "'messages' must be a non-empty list of objects",
                           param="messages")
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise ApiError(400, "'prompt' must be a string or a non-empty list",
                           param="prompt")


def _validate_cache_salt(salt: Any) -> None:
    """The tenant: hashed into the router's keys and the session's store key.  vLLM
    refuses the same (``validate_cache_salt`` in 0.32's
    entrypoints/generate/base/protocol.py), before pydantic would coerce it."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ApiError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
    if len(salt) > _MAX_CACHE_SALT_CHARS or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise ApiError(400, f"'cache_salt' must be at most {_MAX_CACHE_SALT_CHARS} "
                       "characters and must not contain '@', '/', '\\', or NUL",
                       param="cache_salt")


def session_id_of(headers: Mapping[str, str], body: dict[str, Any],
                  session_headers: Sequence[str], max_chars: int) -> str | None:
    """The conversation this request continues: the body's prompt_cache_key, the
    configured session headers in order, then the body's session_id."""
    source, value = "prompt_cache_key", body.get("prompt_cache_key")
    if value is None:
        for source in session_headers:
            value = headers.get(source)
            if value is not None:
                break
        else:
            source, value = "session_id", body.get("session_id")
    if value is None:
        return None
    if not valid_session_id(value, max_chars):
        raise ApiError(400, f"invalid session id in {source}: must be 1-{max_chars} "
                       "characters of [A-Za-z0-9._:@/+=-]", param=source)
    return value


def hold_hint_of(headers: Mapping[str, str], max_s: float) -> float | None:
    """The client's ``X-Session-Hold-S``: seconds until its session's next turn, a
    finite number >= 0 (else a 400 naming the header), clamped to ``max_s``."""
    raw = headers.get(HOLD_HINT_HEADER)
    if raw is None:
        return None
    try:
        hint_s = float(raw.strip())
    except ValueError:
        hint_s = math.nan
    if not math.isfinite(hint_s) or hint_s < 0:
        raise ApiError(400, f"invalid {HOLD_HINT_HEADER}: must be a number of seconds "
                       ">= 0", param=HOLD_HINT_HEADER)
    return min(hint_s, max_s)
