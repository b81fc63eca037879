"""D's inbox for P's parameters of requests sent before P finished ("early decode").

Sent after P, a D request pays D's whole front end (HTTP, parsing, tokenizing, the
engine's input path) after P's prefill, on the critical path.  Sent at the same time
as P's, it pays that while P computes, and waits in D's scheduler (the connector
answers "not yet" to ``get_num_new_matched_tokens``, holding no blocks) until the
proxy pushes P's ``kv_transfer_params`` here.  From then on the request is exactly
the one the proxy would have sent after P: same parameters, same verification.

The socket is a ZMQ PULL bound in the engine-core process; the scheduler drains it
without blocking at each step.  The parameters come from P's own connector when it
can reach D (it pushes them as its request finishes, before its answer travels back
through its API server and the proxy), else from the proxy (both send with
``wire/early_decode.EarlyDecodeSender``).  Unclaimed messages (the D request was aborted, or
never came) and requests whose message never comes (the proxy died) both expire
after ``timeout_s``; an expired request computes its prompt itself, so a lost
message costs time, never correctness.  A message for a request already held is
never expired: it waits until the request takes it or ends, however long the
scheduler (under KV pressure) takes to come back to the request.

Whoever reaches the port could push a forged ``PrefillDone`` (the id is unguessable,
but seen by anyone on the path).  With a ``side_port_secret`` the inbox takes only
messages whose HMAC (``wire/side_auth.py``) verifies, and drops and counts the rest
(``refused``): a forged message changes nothing.  Without one it takes any message,
as before; docs/operations.md (*Security*) says when that is acceptable.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from vllm_sessionkv.wire import side_auth
from vllm_sessionkv.wire.protocol import decode_prefill_done
from vllm_sessionkv.zmq_bind import bind_socket

__all__ = ["EarlyDecodeInbox", "Outcome", "REFUSED_REASONS"]

logger = logging.getLogger("vllm.sessionkv.early_decode")


class Outcome(enum.Enum):
    WAITING = "waiting"          # P has not answered yet: hold the request
    READY = "ready"              # P's parameters are in: load from P
    PREFILL_FAILED = "prefill_failed"  # P failed: compute the prompt here
    TIMED_OUT = "timed_out"      # nothing came in time: compute the prompt here


# Why a message on the port was dropped (``sessionkv_early_decode_messages_refused``).
REFUSED_REASONS = ("unauthenticated", "malformed")


class EarlyDecodeInbox:
    def __init__(self, bind: str, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 secret: str | None = None) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._secret = secret.encode() if secret else None
        self._context, self._socket = bind_socket(zmq.PULL, bind, "early_decode_port")
        self.endpoint = bind
        # early_decode_id -> (P's params or None, arrival time)
        self._arrived: dict[str, tuple[dict[str, Any] | None, float]] = {}
        # early_decode_id -> when the scheduler first asked for it
        self._waiting: dict[str, float] = {}
        # Messages dropped since the last take_refused(), by reason (REFUSED_REASONS).
        self.refused = dict.fromkeys(REFUSED_REASONS, 0)

    def take_refused(self) -> dict[str, int]:
        """The messages dropped since the last call, by reason (then zeroed)."""
        taken, self.refused = self.refused, dict.fromkeys(REFUSED_REASONS, 0)
        return taken

    def _authentic(self, frames: list[bytes]) -> bytes | None:
        """The message's payload, or None when it needs a MAC and has no valid one.
        Without a secret a trailing MAC frame is ignored."""
        if self._secret is None:
            return frames[0]
        if len(frames) != 2 or not side_auth.verify(self._secret, side_auth.EARLY_DECODE,
                                                     frames[1], frames[0]):
            return None
        return frames[0]

    def _drain(self, now: float) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            raw = self._authentic(frames)
            if raw is None:
                if not any(self.refused.values()):   # logged once until counted
                    logger.warning("sessionkv early decode: a message without a valid "
                                   "MAC dropped (side_port_secret differs, or a sender "
                                   "that has none)")
                self.refused["unauthenticated"] += 1
                continue
            try:
                message = decode_prefill_done(raw)
            except msgspec.DecodeError as exc:
                self.refused["malformed"] += 1
                logger.warning("sessionkv early decode: malformed message dropped: %s", exc)
                continue
            params = message.kv_transfer_params
            self._arrived[message.early_decode_id] = (
                params if isinstance(params, dict) else None, now)
        # Only a message no request has asked for expires: one for a held request
        # waits for it (its request takes it or ends, forget()), however long the
        # scheduler takes to come back to it.
        cutoff = now - self.timeout_s
        for key in [k for k, (_, at) in self._arrived.items()
                    if at < cutoff and k not in self._waiting]:
            del self._arrived[key]

    def poll(self, early_decode_id: str) -> tuple[Outcome, dict[str, Any] | None, float]:
        """(outcome, P's params when READY, seconds the request has waited)."""
        now = self._clock()
        self._drain(now)
        first_asked = self._waiting.setdefault(early_decode_id, now)
        waited_s = now - first_asked
        arrived = self._arrived.pop(early_decode_id, None)
        if arrived is not None:
            del self._waiting[early_decode_id]
            params = arrived[0]
            if params is None:
                return Outcome.PREFILL_FAILED, None, waited_s
            return Outcome.READY, params, waited_s
        if waited_s >= self.timeout_s:
            del self._waiting[early_decode_id]
            return Outcome.TIMED_OUT, None, waited_s
        return Outcome.WAITING, None, waited_s

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a message; True when one is there to read,
        or already read for a request still held (the next step releases it)."""
        if any(key in self._arrived for key in self._waiting):
            return True
        return bool(self._socket.poll(max(0, int(timeout_s * 1000))))

    def forget(self, early_decode_id: str) -> None:
        """The request ended while waiting (aborted): drop what is kept for it."""
        self._waiting.pop(early_decode_id, None)
        self._arrived.pop(early_decode_id, None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
