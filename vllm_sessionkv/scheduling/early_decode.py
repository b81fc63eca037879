"""Early decode in the scheduler half (``vllm_sessionkv/early_decode.py``): as D, a
request sent while P prefills waits for P's parameters, then goes on exactly as if
sent after P; as P, our parameters are pushed straight to the D holding the request,
not after they travel back through our API server and the proxy."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from vllm_sessionkv.early_decode import EarlyDecodeInbox, Outcome
from vllm_sessionkv.scheduling.counters import StatsSink
from vllm_sessionkv.wire.early_decode import EarlyDecodeSender
from vllm_sessionkv.wire.protocol import (
    EARLY_DECODE_PUSHED_KEY,
    SESSIONKV_PARAMS_KEY,
    SessionPayload,
    encode_payload,
)

__all__ = ["EarlyDecode", "params_without_early_decode"]

logger = logging.getLogger("vllm.sessionkv.scheduler")

_WAITING = object()


def params_without_early_decode(ours: SessionPayload) -> dict[str, Any] | None:
    """What a request is left with when P's parameters will not come: a plain turn
    (a session's id stays, so D still holds the turn for the next one)."""
    rest = msgspec.structs.replace(ours, early_decode_id=None)
    return {SESSIONKV_PARAMS_KEY: encode_payload(rest)} if rest != SessionPayload() else None


class EarlyDecode:
    def __init__(self, inbox: EarlyDecodeInbox | None, secret: str | None = None) -> None:
        self.inbox = inbox                      # as D; None without early_decode_port
        self._sender: EarlyDecodeSender | None = None   # as P, made on first use
        self._secret = secret                   # signs P's pushes (side_auth)

    def params_when_ready(self, request_id: str, ours: SessionPayload,
                          stats: StatsSink) -> Any:
        """The params a request sent early goes on with (``ours`` names its
        early-decode id): P's once they are in, or what is left without them when
        they will not come; a value ``waiting`` is true of while P's are awaited."""
        early_id = ours.early_decode_id
        if self.inbox is None:
            outcome, p_params, waited_s = "refused", None, 0.0
            logger.warning("sessionkv early decode request_id=%s: this engine has no "
                           "early_decode_port; computing the prompt here", request_id)
        else:
            result, p_params, waited_s = self.inbox.poll(early_id)
            for reason, count in self.inbox.take_refused().items():
                if count:
                    stats.record(f"early_decode_refused_{reason}", count)
            if result is Outcome.WAITING:
                return _WAITING
            outcome = result.value
        stats.record(f"early_decode_{outcome}")
        stats.record("early_decode_wait_s", waited_s)
        log = logger.debug if outcome == "ready" else logger.warning
        log("sessionkv early decode request_id=%s outcome=%s waited_ms=%.1f",
            request_id, outcome, waited_s * 1e3)
        return p_params if p_params is not None else params_without_early_decode(ours)

    @staticmethod
    def waiting(result: Any) -> bool:
        return result is _WAITING

    def forget(self, ours: SessionPayload) -> None:
        """The request ended (aborted while waiting for P): drop what is kept for it."""
        if ours.early_decode_id and self.inbox is not None:
            self.inbox.forget(ours.early_decode_id)

    def _push_target(self, ours: SessionPayload) -> tuple[str, str] | None:
        """(D's endpoint, id) a P request asks us to push our parameters to."""
        push = ours.early_decode_push
        if push is None or not (push.endpoint.startswith("tcp://") and push.id):
            return None
        if self._sender is None:
            self._sender = EarlyDecodeSender(secret=self._secret)
        return push.endpoint, push.id

    def connect(self, ours: SessionPayload) -> None:
        # While P prefills, so the push at the end finds the connection up.
        target = self._push_target(ours)
        if target is not None:
            self._sender.connect(target[0])

    def push(self, ours: SessionPayload, out: dict[str, Any], stats: StatsSink) -> None:
        """Hand our parameters to the D holding the request now.  The proxy pushes
        them itself unless our answer says this push went out."""
        target = self._push_target(ours)
        if target is not None and self._sender.send(target[0], target[1], out):
            out[SESSIONKV_PARAMS_KEY][EARLY_DECODE_PUSHED_KEY] = True
            stats.record("early_decode_pushed_by_prefill")

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
        if self._sender is not None:
            self._sender.close()
