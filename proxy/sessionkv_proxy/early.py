"""The proxy's end of early decode: P's parameters pushed to the D holding a request.

With early decode the proxy sends a disaggregated request to D at the same time as
to P, so D's front end (HTTP, parsing, tokenizing, its engine's input path) runs
while P prefills instead of after it.  D's connector holds the request until P's
``kv_transfer_params`` arrive on D's early-decode socket (ZMQ PULL, the connector's
``early_decode_port``); this module pushes them there.  The engine side is
``vllm_sessionkv/early_decode.py``; the message is ``protocol.PrefillDone``.

Sockets connect at start-up and send without blocking, queueing only to a live
connection (``IMMEDIATE``): a send that fails returns False and the caller sends D
the request again the ordinary way, after P.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import zmq

from vllm_sessionkv.protocol import PrefillDone, encode_prefill_done

__all__ = ["EarlyDecodeSender", "new_early_decode_id"]

logger = logging.getLogger("sessionkv_proxy.early")


def new_early_decode_id() -> str:
    # Unguessable: the id alone decides which request P's parameters attach to.
    return os.urandom(16).hex()


class EarlyDecodeSender:
    def __init__(self, endpoints: Iterable[str]) -> None:
        self._context = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}
        for endpoint in endpoints:
            if endpoint in self._sockets:
                continue
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock

    def send(self, endpoint: str, early_decode_id: str,
             kv_transfer_params: dict[str, Any] | None) -> bool:
        """Push P's parameters (None: P failed, D computes the prompt itself).
        False when the message could not be queued to a live connection."""
        sock = self._sockets.get(endpoint)
        if sock is None:
            return False
        payload = encode_prefill_done(PrefillDone(early_decode_id=early_decode_id,
                                                  kv_transfer_params=kv_transfer_params))
        try:
            sock.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as exc:   # Again: no live connection, or its queue is full
            logger.warning("early decode: cannot push to %s: %s", endpoint, exc)
            return False
        return True

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        self._context.term()
