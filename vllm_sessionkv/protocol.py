"""Wire types shared by the connector and the proxy (msgspec structs).

Everything that crosses a process boundary is defined here once.  New fields are
added with defaults only, and unknown fields are accepted, so an older proxy can read
a newer connector's handle and the other way round.

PROTOCOL_VERSION history:
  1: first release (SessionHandle, TokenAccounting).
     PrefillDone added later, with defaults only.
"""

from __future__ import annotations

import hashlib

import msgspec

__all__ = [
    "EARLY_DECODE_ID_KEY",
    "EARLY_DECODE_PUSHED_KEY",
    "EARLY_DECODE_PUSH_KEY",
    "FIRST_TOKEN_KEY",
    "FIRST_TOKEN_WANTED_KEY",
    "HANDLE_KEY_PREFIX",
    "PROTOCOL_VERSION",
    "PrefillDone",
    "SESSIONKV_PARAMS_KEY",
    "SessionHandle",
    "TokenAccounting",
    "decode_handle",
    "decode_prefill_done",
    "encode_handle",
    "encode_prefill_done",
    "published_handle_key",
    "session_store_key",
]

PROTOCOL_VERSION = 1

# Everything we add to vLLM's ``kv_transfer_params`` lives under this one key, so the
# stock NIXL fields stay exactly as vLLM defines them.
SESSIONKV_PARAMS_KEY = "sessionkv"

# Under ``kv_transfer_params["sessionkv"]`` of a D request sent while P still
# prefills: the id under which P's parameters will reach D (see ``PrefillDone``).
EARLY_DECODE_ID_KEY = "early_decode_id"
# Under a P request's ``kv_transfer_params["sessionkv"]``: {"endpoint", "id"} of the D
# holding the request, for P's connector to push its parameters to directly; P's
# answer then says ``early_decode_pushed: true`` under its own "sessionkv".
EARLY_DECODE_PUSH_KEY = "early_decode_push"
EARLY_DECODE_PUSHED_KEY = "early_decode_pushed"
# Under P's ``kv_transfer_params["sessionkv"]``: the token P sampled after the prompt
# (first_token.py), for D to continue from.
FIRST_TOKEN_KEY = "first_token_id"
# Under a P request's ``kv_transfer_params["sessionkv"]``: false asks P not to
# export its token (a router's switch; P's own first_token_handoff still applies).
FIRST_TOKEN_WANTED_KEY = "first_token"

# Redis key prefix under which engines publish each session's latest handle.
HANDLE_KEY_PREFIX = "sessionkv:handle:"


def session_store_key(session_id: str, tenant: str | None) -> str:
    """The one name of a session in every shared store (the proxy's session records,
    the engines' published handles): the tenant (vLLM's ``cache_salt``) is part of
    it, so one tenant's turns can never overwrite another's record under the same
    session id.  The tenant is hashed (any string fits, none is stored in clear);
    the tag before the first ``:`` never contains one, so no session id can make two
    tenants' keys equal."""
    tag = "-" if tenant is None else \
        hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{tag}:{session_id}"


def published_handle_key(session_id: str, tenant: str | None,
                         prefix: str = HANDLE_KEY_PREFIX) -> str:
    """The Redis key under which D publishes a session's latest handle."""
    return prefix + session_store_key(session_id, tenant)


class SessionHandle(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Where a conversation's KV lives after a turn, and what it holds.

    Published by D at the end of each turn: in the response's ``kv_transfer_params``
    and out of band (Redis), because vLLM 0.32's streaming responses carry no
    ``kv_transfer_params``.
    """

    session_id: str
    engine_id: str
    # NIXL side channel of the engine holding the blocks.
    host: str
    port: int
    # Block ids per KV-cache group, in sequence order.
    block_ids: list[list[int]]
    # Tokens whose KV the blocks hold (prompt plus generated, minus the last sampled one).
    num_tokens: int
    block_size: int
    # Engine block-hash chain of the full blocks, 8-byte tails, base64 (hashing.encode_chain).
    hash_chain: str
    hash_algo: str = "sha256"
    # Tenant: vLLM's cache_salt.  A handle is never used across tenants.
    tenant: str | None = None
    # Wall-clock (unix seconds) expiry of D's lease on the blocks.
    expires_at_unix_s: float = 0.0
    # HTTP URL of the engine holding the blocks, when it advertises one.
    engine_url: str | None = None
    # The stock NIXL parameters D returned, kept verbatim for the next P request.
    nixl_params: dict = msgspec.field(default_factory=dict)
    version: int = PROTOCOL_VERSION


class TokenAccounting(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How one request's prompt tokens were obtained (per engine)."""

    prompt_tokens: int = 0
    local_hit_tokens: int = 0
    pulled_from_peer_tokens: int = 0
    pulled_from_host_tokens: int = 0
    recomputed_tokens: int = 0
    refused_by_verification_tokens: int = 0
    pulled_bytes: int = 0
    pull_ms: float = 0.0
    # The cost model's prices for this request's pull-or-recompute decision.
    priced_pull_ms: float = 0.0
    priced_recompute_ms: float = 0.0
    # The engine-load estimate those prices (and the synchronous-read choice) used.
    priced_engine_load: float = 0.0
    decision: str = ""
    # D continued from the token P sampled: it computed no prompt token, and its
    # first step computed the KV of that token (first_token.py).
    first_token_from_prefill: bool = False


class PrefillDone(msgspec.Struct, omit_defaults=True, kw_only=True):
    """P's parameters for a D request the proxy sent while P was prefilling.

    Pushed by the proxy to D's early-decode socket (ZMQ PUSH -> PULL) once P answers.
    D's scheduler holds the request, which names ``early_decode_id``, until this
    arrives.  ``kv_transfer_params`` is what P returned, exactly what D would have
    got in the request body had it been sent after P; None when P failed, and D then
    computes the prompt itself.
    """

    early_decode_id: str
    kv_transfer_params: dict | None = None
    version: int = PROTOCOL_VERSION


_handle_decoder = msgspec.json.Decoder(SessionHandle)
_prefill_done_decoder = msgspec.json.Decoder(PrefillDone)
_encoder = msgspec.json.Encoder()


def encode_handle(handle: SessionHandle) -> bytes:
    return _encoder.encode(handle)


def decode_handle(raw: bytes | str) -> SessionHandle:
    """Decode a handle; raises ``msgspec.ValidationError`` naming the bad field."""
    return _handle_decoder.decode(raw)


def encode_prefill_done(message: PrefillDone) -> bytes:
    return _encoder.encode(message)


def decode_prefill_done(raw: bytes) -> PrefillDone:
    """Decode a message; raises ``msgspec.DecodeError`` (incl. ValidationError)."""
    return _prefill_done_decoder.decode(raw)
