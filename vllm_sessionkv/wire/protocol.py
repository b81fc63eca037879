"""Wire types shared by the connector and the proxy (msgspec structs).

Everything that crosses a process boundary is defined here once.  New fields are
added with defaults only, and unknown fields are accepted, so an older proxy can read
a newer connector's handle and the other way round.

PROTOCOL_VERSION history:
  1: first release (SessionHandle, TokenAccounting).
     PrefillDone added later, with defaults only.
     SessionPayload (what travels under ``kv_transfer_params["sessionkv"]``) typed
     later: the same fields as the dict before it.  SessionHandle became NIXL's
     parameters plus that payload (its copies of the payload's fields were never
     read); engines and proxies of this version write and read only that form.

A reader meets a version it does not know with :class:`UnsupportedVersion` (a
:class:`PayloadError`, a ``ValueError``), never a ``KeyError`` half way through: the engine refuses such a
handle (verdict ``unsupported_version``), the proxy does not use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from typing import Any

import msgspec

__all__ = [
    "EARLY_DECODE_ID_KEY",
    "EARLY_DECODE_PUSHED_KEY",
    "EARLY_DECODE_PUSH_KEY",
    "EarlyDecodePush",
    "FIRST_TOKEN_KEY",
    "FIRST_TOKEN_WANTED_KEY",
    "HANDLE_EXPIRY_MARGIN_S",
    "HandleWithdrawal",
    "PROTOCOL_VERSION",
    "PayloadError",
    "PrefillDone",
    "SESSIONKV_PARAMS_KEY",
    "SUPPORTED_VERSIONS",
    "SessionHandle",
    "SessionPayload",
    "TokenAccounting",
    "UnsupportedVersion",
    "check_version",
    "decode_handle",
    "decode_payload",
    "decode_prefill_done",
    "decode_withdrawal",
    "encode_handle",
    "encode_payload",
    "encode_prefill_done",
    "encode_withdrawal",
    "handle_expired",
    "handle_from_params",
    "handle_is_dead",
    "payload_from_params",
    "session_store_key",
    "with_payload",
]

PROTOCOL_VERSION = 1
# Versions this reader understands; any other is refused (UnsupportedVersion).
SUPPORTED_VERSIONS = frozenset({1})

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

# A handle is not used once its lease has less than this long to run: D releases the
# blocks at the lease's end and vLLM's reader declines a read within 5 s of it.  The
# engine's default ``expiry_margin_s`` and the router's
# ``routing.params.handle_expiry_margin_s``, so that the router never spends a
# single-use handle that P would refuse.
HANDLE_EXPIRY_MARGIN_S = 10.0


def handle_expired(expires_at_unix_s: float, now_unix_s: float,
                   margin_s: float = HANDLE_EXPIRY_MARGIN_S) -> bool:
    """The one expiry rule, for the engine, the router and the policy: a handle whose
    lease ends within ``margin_s`` of ``now_unix_s`` is not used.  An expiry of 0
    means none is known, and never expires."""
    return bool(expires_at_unix_s) and expires_at_unix_s < now_unix_s + margin_s


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


class PayloadError(ValueError):
    """A ``kv_transfer_params["sessionkv"]`` value or a handle that cannot be used."""


class UnsupportedVersion(PayloadError):
    """A payload or handle written under a protocol version this reader does not know."""

    def __init__(self, what: str, version: object) -> None:
        super().__init__(f"{what} has protocol version {version!r}; this reader supports "
                         f"{sorted(SUPPORTED_VERSIONS)}")
        self.version = version


def check_version(what: str, version: object) -> None:
    """Raise :class:`UnsupportedVersion` unless ``version`` is one this reader knows."""
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(what, version)


class EarlyDecodePush(msgspec.Struct, kw_only=True):
    """Where P's connector is to push its parameters (early decode): D's socket and
    the id D holds the request under."""

    endpoint: str
    id: str


class SessionPayload(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Everything of ours in a request's or an answer's ``kv_transfer_params``, under
    the one key ``SESSIONKV_PARAMS_KEY`` (NIXL's own fields stay as vLLM defines them).

    Written by the connector at the end of a turn (the KV claim, accounting, P's
    token) and by the proxy on requests (session id, early decode, first-token
    switch); read by the connector (P verifies the claim before it pulls) and the
    proxy (it stores D's handle for the next turn).  Every field has a default, so a
    writer sends only what it means; a reader ignores fields it does not know and
    refuses versions it does not know (:func:`decode_payload`).
    """

    version: int = PROTOCOL_VERSION
    session_id: str | None = None
    # The KV claim of the engine that answered: the engine block-hash chain of its
    # full blocks (8-byte tails, base64: hashing.encode_chain), the tokens of its
    # partial last block, and the settings the hashes depend on.  None: no claim.
    hash_chain: str | None = None
    tail_token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0
    hash_algo: str = ""
    # Tenant: vLLM's cache_salt.  A claim is never used across tenants.
    tenant: str | None = None
    num_tokens: int = 0
    # Tokens per chain hash (vLLM's hash_block_size); 0: block_size (older writers).
    hash_tokens: int = 0
    # The holder's model identity (_vllm.engine_state.model_identity); a reader
    # serving another model refuses the claim.  "": not stated.
    model_id: str = ""
    # D only: wall-clock (unix seconds) end of its lease on the blocks; 0: none.
    expires_at_unix_s: float = 0.0
    # The holder's token for these blocks (guard.py): a reader claims the blocks
    # with it before reading them and confirms after.  0: no guard (a stock engine,
    # or the guard turned off).
    hold_token: int = 0
    # D only: HTTP URL of the engine holding the blocks, when it advertises one.
    engine_url: str | None = None
    # D only: when the engine process holding the blocks started (unix ns), so a
    # proxy that has seen a later start of the same ``engine_url`` knows the handle
    # names a dead process's blocks (``HandleWithdrawal``).  0: unknown.
    engine_epoch: int = 0
    # How this request's prompt tokens were obtained, on the engine that answered.
    accounting: TokenAccounting | None = None
    # P only: the token P sampled after the prompt (first_token.py), for D.
    first_token_id: int | None = None
    # P only: P pushed its parameters to the D holding the request (early decode).
    early_decode_pushed: bool = False
    # Request to D sent while P still prefills: the id P's parameters will come under.
    early_decode_id: str | None = None
    # Request to P: push your parameters to this D (early decode).
    early_decode_push: EarlyDecodePush | None = None
    # Request to P: false asks P not to export its token (a router's switch; P's own
    # first_token_handoff still applies).
    first_token: bool = True
    # Request to D: the client's X-Session-Hold-S (seconds it expects before the
    # session's next turn), which D's retention rule takes as the hold's lease
    # (retention.py).  None: no hint.
    hold_hint_s: float | None = None


class SessionHandle(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Where a conversation's KV lives after a turn, and what it holds: D's
    end-of-turn ``kv_transfer_params``, typed.

    Returned by D in the response and published out of band (Redis, D's handle
    channel), because vLLM 0.32's streaming responses carry no
    ``kv_transfer_params``; stored by the proxy
    for the session's next turn, whose P request it becomes (``prefill_params``).
    """

    # NIXL's own parameters as D returned them (remote_engine_id, remote_block_ids,
    # remote_host, remote_port, remote_num_tokens, ...), without ours.
    nixl_params: dict[str, Any]
    payload: SessionPayload
    version: int = PROTOCOL_VERSION

    @property
    def session_id(self) -> str | None:
        return self.payload.session_id

    @property
    def tenant(self) -> str | None:
        return self.payload.tenant

    @property
    def expires_at_unix_s(self) -> float:
        return self.payload.expires_at_unix_s

    @property
    def engine_url(self) -> str | None:
        return self.payload.engine_url

    def params(self) -> dict[str, Any]:
        """The handle as ``kv_transfer_params`` again."""
        return with_payload(self.nixl_params, self.payload)

    def prefill_params(self) -> dict[str, Any]:
        """The next turn's P request parameters: D's, asking P to pull from D."""
        params = with_payload(self.nixl_params,
                              msgspec.structs.replace(self.payload, accounting=None))
        params["do_remote_decode"] = True
        params["do_remote_prefill"] = False
        return params


class HandleWithdrawal(msgspec.Struct, omit_defaults=True, kw_only=True):
    """D ended a hold before its lease: the handle naming it (``hold_token``) is dead.

    Sent on D's handle channel and written to Redis (``redis_keys.withdrawn``) so that
    no proxy replica attaches it; a lost one costs the next turn a refused claim and a
    recompute, never correctness (D's pull guard refuses the claim).  ``reason`` is the
    hold's end (``holds.RELEASE_REASONS``)."""

    session_id: str
    hold_token: int
    tenant: str | None = None
    reason: str = ""
    engine_url: str | None = None
    engine_epoch: int = 0
    # How long a handle of this hold could still be live (its lease), seconds.
    ttl_s: float = 0.0
    version: int = PROTOCOL_VERSION


_encoder = msgspec.json.Encoder()
_withdrawal_decoder = msgspec.json.Decoder(HandleWithdrawal)
_handle_decoder = msgspec.json.Decoder(SessionHandle)
_prefill_done_decoder = msgspec.json.Decoder(PrefillDone)


class _Versioned(msgspec.Struct):
    """Any of our messages, read for its version only (before its other fields, whose
    types a future version may change)."""

    version: object = PROTOCOL_VERSION


_versioned_decoder = msgspec.json.Decoder(_Versioned)


def encode_payload(payload: SessionPayload) -> dict[str, Any]:
    """The payload as the plain dict that travels in ``kv_transfer_params``; its
    version is always written."""
    out = msgspec.to_builtins(payload)
    out["version"] = payload.version
    return out


def decode_payload(raw: object) -> SessionPayload:
    """Read a ``kv_transfer_params["sessionkv"]`` value (None: an empty payload).

    Raises :class:`UnsupportedVersion` for a version this reader does not know, and
    :class:`PayloadError` naming the bad field for anything else malformed."""
    if raw is None:
        return SessionPayload()
    if not isinstance(raw, Mapping):
        raise PayloadError(f"expected an object, got {type(raw).__name__}")
    check_version("session payload", raw.get("version", PROTOCOL_VERSION))
    try:
        return msgspec.convert(dict(raw), SessionPayload)
    except msgspec.ValidationError as exc:
        raise PayloadError(str(exc)) from None


def payload_from_params(params: Mapping[str, Any] | None) -> SessionPayload:
    """The payload of a request's or an answer's ``kv_transfer_params``
    (:func:`decode_payload`'s errors)."""
    return decode_payload((params or {}).get(SESSIONKV_PARAMS_KEY))


def with_payload(params: Mapping[str, Any] | None, payload: SessionPayload
                 ) -> dict[str, Any]:
    """A copy of ``params`` carrying ``payload`` under ``SESSIONKV_PARAMS_KEY``."""
    out = dict(params or {})
    out[SESSIONKV_PARAMS_KEY] = encode_payload(payload)
    return out


def handle_from_params(params: Mapping[str, Any]) -> SessionHandle:
    """D's end-of-turn ``kv_transfer_params`` as a handle (``decode_payload``'s
    errors)."""
    payload = payload_from_params(params)
    nixl = {k: v for k, v in params.items() if k != SESSIONKV_PARAMS_KEY}
    return SessionHandle(nixl_params=msgspec.to_builtins(nixl), payload=payload)


def encode_handle(handle: SessionHandle) -> bytes:
    return _encoder.encode(handle)


def decode_handle(raw: bytes | str) -> SessionHandle:
    """Decode a handle: :class:`UnsupportedVersion` for a version this reader does not
    know, ``msgspec.DecodeError`` (incl. ``ValidationError``) naming a bad field."""
    check_version("session handle", _versioned_decoder.decode(raw).version)
    handle = _handle_decoder.decode(raw)
    check_version("session payload", handle.payload.version)
    return handle


def encode_withdrawal(message: HandleWithdrawal) -> bytes:
    return _encoder.encode(message)


def decode_withdrawal(raw: bytes | str) -> HandleWithdrawal:
    """Decode a withdrawal: :class:`UnsupportedVersion` or ``msgspec.DecodeError``."""
    check_version("handle withdrawal", _versioned_decoder.decode(raw).version)
    return _withdrawal_decoder.decode(raw)


def handle_is_dead(handle: SessionHandle, withdrawn: Collection[int],
                   epochs: Mapping[str, int]) -> str | None:
    """Why a handle names blocks its engine no longer holds for it, or None: its hold
    was withdrawn (``withdrawn``: the session's withdrawn hold tokens), or its engine
    has started since (``epochs``: the latest known start of each engine URL).  The
    one rule for the proxy's routing read and its channel table."""
    payload = handle.payload
    if payload.hold_token and payload.hold_token in withdrawn:
        return "withdrawn"
    latest = epochs.get(payload.engine_url or "") if payload.engine_epoch else None
    if latest is not None and latest > payload.engine_epoch:
        return "engine_restarted"
    return None


def encode_prefill_done(message: PrefillDone) -> bytes:
    return _encoder.encode(message)


def decode_prefill_done(raw: bytes) -> PrefillDone:
    """Decode a message; raises ``msgspec.DecodeError`` (incl. ValidationError)."""
    return _prefill_done_decoder.decode(raw)
