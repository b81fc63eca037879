"""Early decode, the sending side: P's connector and the proxy push P's parameters
to D's inbox (``vllm_sessionkv/early_decode.py``) over ZMQ, keyed by an id the
proxy draws per request.  Torch-free: the proxy imports it."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq

from vllm_sessionkv.wire import side_auth
from vllm_sessionkv.wire.protocol import PrefillDone, encode_prefill_done

__all__ = ["EarlyDecodeSender", "new_early_decode_id"]

logger = logging.getLogger("vllm.sessionkv.early_decode")


def new_early_decode_id() -> str:
    # Unguessable: the id alone decides which request P's parameters attach to.
    return os.urandom(16).hex()


class EarlyDecodeSender:
    """Pushes P's parameters to D early-decode sockets (ZMQ PUSH).

    Sends never block and queue only to a live connection (``IMMEDIATE``): a send
    that fails returns False and the caller falls back (P: the proxy pushes; the
    proxy: it sends D the request again after P).  ``endpoints`` connect at once; any
    other endpoint connects on ``connect()`` or on its first send (which then fails:
    the connection is not up yet).  With ``secret`` each message goes out as two
    frames, the payload and its HMAC (``side_auth``); without, as the payload alone."""

    def __init__(self, endpoints: Iterable[str] = (), max_endpoints: int = 1024,
                 secret: str | None = None) -> None:
        self._secret = secret.encode() if secret else None
        self._context = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}
        self._max_endpoints = max_endpoints
        for endpoint in endpoints:
            self._socket(endpoint)

    def connect(self, endpoint: str) -> None:
        """Start connecting now, so that a later send finds the connection up."""
        self._socket(endpoint)

    def connected(self, endpoint: str) -> bool:
        """Whether a send to ``endpoint`` would find a live connection now."""
        sock = self._sockets.get(endpoint)
        return sock is not None and bool(sock.poll(0, zmq.POLLOUT))

    def _socket(self, endpoint: str) -> zmq.Socket | None:
        sock = self._sockets.get(endpoint)
        if sock is None and len(self._sockets) < self._max_endpoints:
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                logger.warning("early decode: cannot connect to %r: %s", endpoint, exc)
                return None
            self._sockets[endpoint] = sock
        return sock

    def send(self, endpoint: str, early_decode_id: str,
             kv_transfer_params: dict[str, Any] | None) -> bool:
        """Push P's parameters (None: P failed, D computes the prompt itself).
        False when the message could not be queued to a live connection."""
        sock = self._socket(endpoint)
        if sock is None:
            return False
        try:
            payload = encode_prefill_done(PrefillDone(early_decode_id=early_decode_id,
                                                      kv_transfer_params=kv_transfer_params))
        except (TypeError, msgspec.EncodeError) as exc:
            logger.warning("early decode: parameters not encodable: %s", exc)
            return False
        try:
            if self._secret is None:
                sock.send(payload, zmq.NOBLOCK)
            else:
                sock.send_multipart(
                    [payload, side_auth.mac(self._secret, side_auth.EARLY_DECODE, payload)],
                    zmq.NOBLOCK)
        except zmq.ZMQError as exc:   # Again: no live connection yet, or queue full
            logger.debug("early decode: cannot push to %s: %s", endpoint, exc)
            return False
        return True

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        self._context.term()
