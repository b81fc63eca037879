"""The session table: where each conversation's KV was left, shared across replicas.

A record lives in the index backend (in-process or Redis) under the session id.  D's
end-of-turn handle arrives three ways: in D's non-streaming response (the proxy stores
it here), published by the connector to Redis (``vllm_sessionkv.publisher``), or sent
on D's handle channel, which this proxy keeps in its index's in-process table
(``handle_subscriber.py``); the last two are the only ways for streaming turns in
vLLM 0.32.  All are the one typed ``protocol.SessionHandle``.
"""

from __future__ import annotations

import logging
import re

import msgspec

from vllm_sessionkv.wire.protocol import PayloadError, SessionHandle, check_version, decode_handle

__all__ = ["HandleUnreadable", "SessionRecord", "decode_published_handle", "decode_record",
           "encode_record", "valid_session_id"]

logger = logging.getLogger("sessionkv_proxy.sessions")

_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]+$")


class SessionRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    session_id: str
    # URL of the D that served the session's last turn.
    last_decode: str | None = None
    # D's end-of-turn handle (single use).
    handle: SessionHandle | None = None
    # Router keys of the last prompt, to estimate how much of the next one D holds.
    prompt_keys: list[int] = msgspec.field(default_factory=list)
    tenant: str | None = None
    updated_at_unix_s: float = 0.0


class HandleUnreadable(msgspec.Struct, frozen=True):
    """A published handle this proxy cannot use, and why (``unsupported_version``)."""

    reason: str


_record_decoder = msgspec.json.Decoder(SessionRecord)
_encoder = msgspec.json.Encoder()


def encode_record(record: SessionRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(raw: bytes) -> SessionRecord | None:
    """A stored record; None when unreadable.  A handle in it of a protocol version
    this proxy does not know is dropped (the record's other fields still route)."""
    try:
        record = _record_decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    if record.handle is not None:
        try:
            check_version("session handle", record.handle.version)
            check_version("session payload", record.handle.payload.version)
        except PayloadError as exc:
            logger.warning("session %s: stored handle not used: %s", record.session_id, exc)
            record.handle = None
    return record


def decode_published_handle(raw: bytes | None) -> SessionHandle | HandleUnreadable | None:
    """The handle an engine published; None when there is none or it is malformed."""
    if not raw:
        return None
    try:
        return decode_handle(raw)
    except PayloadError as exc:   # UnsupportedVersion
        logger.warning("published handle not used: %s", exc)
        return HandleUnreadable("unsupported_version")
    except msgspec.DecodeError:
        return None


def valid_session_id(session_id: object, max_chars: int) -> bool:
    return (isinstance(session_id, str) and 0 < len(session_id) <= max_chars
            and _SESSION_ID_RE.match(session_id) is not None)
