"""The session table: where each conversation's KV was left, shared across replicas.

A record lives in the index backend (in-process or Redis) under the session id.  D's
end-of-turn handle arrives two ways: in D's non-streaming response (the proxy stores
it here), or published by the connector to Redis (``vllm_sessionkv.publisher``),
which is the only way for streaming turns in vLLM 0.32.
"""

from __future__ import annotations

import re

import msgspec

from vllm_sessionkv.protocol import SESSIONKV_PARAMS_KEY, SessionHandle, decode_handle

__all__ = ["SessionRecord", "decode_record", "encode_record", "handle_params_for_prefill",
           "valid_session_id"]

_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]+$")


class SessionRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    session_id: str
    last_prefill: str | None = None
    last_decode: str | None = None
    # D's end-of-turn kv_transfer_params, as D returned them (single use).
    handle_params: dict | None = None
    handle_expires_at_unix_s: float = 0.0
    # Router keys of the last prompt, to estimate how much of the next one D holds.
    prompt_keys: list[int] = msgspec.field(default_factory=list)
    tenant: str | None = None
    updated_at_unix_s: float = 0.0


_record_decoder = msgspec.json.Decoder(SessionRecord)
_encoder = msgspec.json.Encoder()


def encode_record(record: SessionRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(raw: bytes) -> SessionRecord | None:
    try:
        return _record_decoder.decode(raw)
    except msgspec.DecodeError:
        return None


def decode_published_handle(raw: bytes | None) -> SessionHandle | None:
    if not raw:
        return None
    try:
        return decode_handle(raw)
    except msgspec.DecodeError:
        return None


def valid_session_id(session_id: object, max_chars: int) -> bool:
    return (isinstance(session_id, str) and 0 < len(session_id) <= max_chars
            and _SESSION_ID_RE.match(session_id) is not None)


def handle_params_for_prefill(handle_params: dict) -> dict:
    """D's end-of-turn params turned into the next turn's P request params."""
    params = {k: v for k, v in handle_params.items()}
    params["do_remote_decode"] = True
    params["do_remote_prefill"] = False
    ours = dict(params.get(SESSIONKV_PARAMS_KEY) or {})
    ours.pop("accounting", None)
    params[SESSIONKV_PARAMS_KEY] = ours
    return params
