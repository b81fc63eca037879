"""Every ``kv_transfer_params`` the proxy writes or strips, as pure functions.

The parameters are how P and D hand a request's KV to each other: P's request names
where its prompt's KV may be pulled from (D's handle of the session's last turn, or
nothing yet), P's answer names the blocks D is to read, and D's end-of-turn answer
carries the session's new handle.  Our own fields travel under the one key
``"sessionkv"`` as a versioned :class:`~vllm_sessionkv.wire.protocol.SessionPayload`;
NIXL's stay as vLLM defines them.  Each function here takes values and returns new
ones: no body or parameters passed in is changed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_sessionkv.wire.protocol import (
    EarlyDecodePush,
    PayloadError,
    SessionHandle,
    SessionPayload,
    handle_from_params,
    payload_from_params,
    with_payload,
)

__all__ = ["KEY", "accounting_header", "decode_answer", "early_decode_params",
           "fresh_prefill_params", "handle_of_answer", "pushed_by_prefill",
           "prefill_body", "restore_body", "session_params", "strip_answer",
           "with_hold_hint", "with_params", "without_params"]

KEY = "kv_transfer_params"
# Fields a P request must not carry: it generates one token, never streams.
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")
_json = msgspec.json.Encoder()


def fresh_prefill_params() -> dict[str, Any]:
    """P's parameters when it has no handle to pull from: prefill, keep for D."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def session_params(session_id: str, hold_hint_s: float | None = None) -> dict[str, Any]:
    """For a request D serves alone: D keeps the turn for the session's next P pull
    only if it knows the session (and for as long as the client's hint says)."""
    return with_payload(None, SessionPayload(session_id=session_id,
                                             hold_hint_s=hold_hint_s))


def early_decode_params(early_id: str, session_id: str | None,
                        hold_hint_s: float | None = None) -> dict[str, Any]:
    """D's request under early decode: an id instead of P's parameters, which follow
    over D's early-decode socket under that id (D keeps this hint through them)."""
    return with_payload(None, SessionPayload(early_decode_id=early_id,
                                             session_id=session_id or None,
                                             hold_hint_s=hold_hint_s))


def with_hold_hint(params: dict[str, Any], hold_hint_s: float | None) -> dict[str, Any]:
    """P's parameters for D, carrying the client's hold hint (unchanged without one,
    or when they are not ours to read)."""
    if hold_hint_s is None:
        return params
    try:
        ours = payload_from_params(params)
    except PayloadError:
        return params
    return with_payload(params, msgspec.structs.replace(ours, hold_hint_s=hold_hint_s))


def with_params(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` sending ``params``."""
    return {**body, KEY: params}


def without_params(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` sending no parameters."""
    return {k: v for k, v in body.items() if k != KEY}


def prefill_body(body: dict[str, Any], is_chat: bool, params: dict[str, Any],
                 early_push: EarlyDecodePush | None, first_token_handoff: bool
                 ) -> dict[str, Any]:
    """P's request: the client's capped at one token, not streamed, sending
    ``params`` (the router's: a fresh request, or D's handle), with the early-decode
    push target and without the first-token hand-off when asked."""
    p_body = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    p_body["max_tokens"] = 1
    if is_chat and "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    p_body["stream"] = False
    if early_push is not None or not first_token_handoff:
        ours = payload_from_params(params)
        if early_push is not None:
            ours = msgspec.structs.replace(ours, early_decode_push=early_push)
        if not first_token_handoff:
            ours = msgspec.structs.replace(ours, first_token=False)
        params = with_payload(params, ours)
    p_body[KEY] = params
    return p_body


def restore_body(model: Any, prompt_ids: list[int], session_id: str,
                 tenant: str | None) -> dict[str, Any]:
    """D's host-tier restore: ``prompt_ids`` as a one-token session turn, which D
    answers with a handle on the restored blocks."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt_ids, "max_tokens": 1, "temperature": 0.0,
        "stream": False, "session_id": session_id, KEY: session_params(session_id)}
    if tenant is not None:
        body["cache_salt"] = tenant
    return body


def decode_answer(data: bytes) -> tuple[Any, dict[str, Any] | None]:
    """(the answer's JSON, its parameters or None); raises ``msgspec.DecodeError``."""
    out = msgspec.json.decode(data)
    params = out.get(KEY) if isinstance(out, dict) else None
    return out, params if isinstance(params, dict) else None


def strip_answer(out: dict[str, Any]) -> bytes:
    """The answer as a plain vLLM server sends it: D's handle (engine id, NIXL
    address, blocks, hash chain, session and tenant) is the proxy's business."""
    return _json.encode({**out, KEY: None})


def handle_of_answer(params: dict[str, Any] | None) -> SessionHandle | None:
    """D's handle of the turn it ended, when it kept one (``PayloadError`` for a D
    speaking another protocol version)."""
    if params and params.get("do_remote_decode"):
        return handle_from_params(params)
    return None


def accounting_header(params: dict[str, Any] | None) -> str | None:
    """The engine's token accounting of the request, as a header value."""
    try:
        acct = payload_from_params(params).accounting
    except PayloadError:
        return None
    return msgspec.json.encode(acct).decode() if acct is not None else None


def pushed_by_prefill(p_params: dict[str, Any]) -> bool:
    """Whether P's connector pushed its parameters to D itself (early decode)."""
    try:
        return payload_from_params(p_params).early_decode_pushed
    except PayloadError:
        return False
