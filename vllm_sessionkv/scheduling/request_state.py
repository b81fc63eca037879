"""One object per request: its session payload, decoded once, and what the scheduler
half decided for it, from vLLM's first question about it to ``request_finished``."""

from __future__ import annotations

from typing import Any

from vllm_sessionkv.scheduling.remote_plan import RemotePlan
from vllm_sessionkv.wire.protocol import (
    PayloadError,
    SessionPayload,
    UnsupportedVersion,
    payload_from_params,
)

__all__ = ["PayloadRead", "RequestState", "RequestStates", "read_payload"]


class PayloadRead:
    """A request's ``kv_transfer_params["sessionkv"]``: the payload (empty when absent
    or unreadable) and, when unreadable, why (a verdict reason) and the error."""

    __slots__ = ("payload", "refusal", "error")

    def __init__(self, payload: SessionPayload, refusal: str | None = None,
                 error: str = "") -> None:
        self.payload, self.refusal, self.error = payload, refusal, error


def read_payload(params: dict[str, Any] | None) -> PayloadRead:
    try:
        return PayloadRead(payload_from_params(params))
    except UnsupportedVersion as exc:
        return PayloadRead(SessionPayload(), "unsupported_version", str(exc))
    except (PayloadError, TypeError, ValueError) as exc:
        return PayloadRead(SessionPayload(), "malformed_handle", str(exc))


class RequestState:
    """What the scheduler half knows about one request."""

    __slots__ = ("params", "read", "plan", "local_hit_tokens", "host_plan",
                 "host_restored_tokens", "first_token_id", "hold_hint_s")

    def __init__(self, params: dict[str, Any] | None) -> None:
        self.params = params
        self.read = read_payload(params)
        # The remote KV plan (P->D or D->P), kept until the request finishes.
        self.plan: RemotePlan | None = None
        # Local prefix hit of a request that brought no remote KV (for accounting);
        # None until vLLM asked about it.
        self.local_hit_tokens: int | None = None
        # A host-tier restore decided for it: (start block, blocks); then its tokens.
        self.host_plan: tuple[int, int] | None = None
        self.host_restored_tokens = 0
        # First-token handoff (D): P's token this request continues from.
        self.first_token_id: int | None = None
        # The client's X-Session-Hold-S, as the proxy forwarded it (retention.py).
        self.hold_hint_s: float | None = self.read.payload.hold_hint_s

    @property
    def payload(self) -> SessionPayload:
        return self.read.payload


class RequestStates:
    """The live requests' states, by request id."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def of(self, request_id: str, params: dict[str, Any] | None) -> RequestState:
        """The request's state; its payload is decoded again only if its params were
        replaced (early decode swaps in P's)."""
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = RequestState(params)
        elif state.params is not params:
            state.params, state.read = params, read_payload(params)
            # P's parameters (early decode) do not repeat the proxy's hint to D.
            if state.read.payload.hold_hint_s is not None:
                state.hold_hint_s = state.read.payload.hold_hint_s
        return state

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def pop(self, request_id: str) -> RequestState | None:
        return self._states.pop(request_id, None)

    def first_tokens(self) -> dict[str, int]:
        """P's token each handed-off request continues from (first-token handoff)."""
        return {rid: s.first_token_id for rid, s in self._states.items()
                if s.first_token_id is not None}

    def planned(self) -> list[tuple[str, RemotePlan]]:
        return [(rid, s.plan) for rid, s in self._states.items() if s.plan is not None]
