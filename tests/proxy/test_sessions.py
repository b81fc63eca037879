"""Session records and published handles: a handle of an unknown protocol version is
refused by name, never half read."""

from __future__ import annotations

import msgspec

from sessionkv_proxy.sessions import (
    HandleUnreadable,
    SessionRecord,
    decode_published_handle,
    decode_record,
    encode_record,
)
from vllm_sessionkv.wire.protocol import PROTOCOL_VERSION, encode_handle, handle_from_params

PARAMS = {"do_remote_decode": True, "remote_engine_id": "d0",
          "sessionkv": {"session_id": "s", "hash_chain": "", "expires_at_unix_s": 5.0}}


def _bumped(raw: bytes, where: str) -> bytes:
    data = msgspec.json.decode(raw)
    target = data if where == "top" else data["payload"] if where == "payload" \
        else data["handle"]
    target["version"] = PROTOCOL_VERSION + 1
    return msgspec.json.encode(data)


def test_published_handle_of_an_unknown_version_is_refused():
    raw = encode_handle(handle_from_params(PARAMS))
    assert decode_published_handle(raw).expires_at_unix_s == 5.0
    for where in ("top", "payload"):
        assert decode_published_handle(_bumped(raw, where)) == HandleUnreadable(
            "unsupported_version")
    assert decode_published_handle(b"{not json") is None
    assert decode_published_handle(None) is None


def test_record_keeps_routing_but_drops_a_handle_of_an_unknown_version():
    record = SessionRecord(session_id="s", last_decode="http://d0",
                           handle=handle_from_params(PARAMS), prompt_keys=[1, 2])
    raw = encode_record(record)
    assert decode_record(raw) == record
    loaded = decode_record(_bumped(raw, "handle"))
    assert loaded.handle is None
    assert (loaded.last_decode, loaded.prompt_keys) == ("http://d0", [1, 2])


def test_record_written_before_the_typed_handle_still_routes():
    # Fields of the old record (last_prefill, handle_params, ...) are ignored.
    old = msgspec.json.encode({"session_id": "s", "last_prefill": "http://p0",
                               "last_decode": "http://d0", "handle_params": PARAMS,
                               "handle_expires_at_unix_s": 5.0})
    loaded = decode_record(old)
    assert loaded.last_decode == "http://d0" and loaded.handle is None
