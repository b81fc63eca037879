"""D's end-of-turn handles on a ZMQ channel the proxies subscribe to.

vLLM 0.32 returns ``kv_transfer_params`` only in non-streamed answers, so a proxy
relaying a stream never sees D's handle in the answer.  Redis carries it where one is
configured (``publisher.py``); this channel carries it without one: D binds a ZMQ PUB
socket (``handle_channel_port``) and sends each handle as it exports it; every proxy
that names the socket (``--decode url=...,handles=tcp://HOST:PORT``) subscribes,
keeps the handle for the session's next turn, and hands it to P as it would a handle
from the answer.

Delivery is best effort by design.  A send never blocks the scheduler (a PUB socket
drops what a slow subscriber cannot take, above ``_SEND_HWM`` messages); a handle
that is lost or arrives after the next turn was routed costs that turn's reuse only:
P verifies every block against the prompt and claims it under the pull guard before
it reads.  Frames carry a sequence number per publisher, so a subscriber counts the
handles it missed.

The frames are ``wire/handle_channel.py``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import zmq

from vllm_sessionkv.config import SessionKVConfig
from vllm_sessionkv.wire.handle_channel import WITHDRAW_TOPIC, encode_frames
from vllm_sessionkv.wire.protocol import (
    HandleWithdrawal,
    PayloadError,
    encode_handle,
    encode_withdrawal,
    handle_from_params,
)
from vllm_sessionkv.zmq_bind import bind_socket

__all__ = ["HandleChannel"]

logger = logging.getLogger("vllm.sessionkv.handle_channel")

# Messages queued per subscriber before the socket drops new ones for it.
_SEND_HWM = 1000


class HandleChannel:
    """The publishing end, in D's engine-core process (the scheduler's thread only)."""

    @classmethod
    def from_config(cls, config: SessionKVConfig, data_parallel_size: int
                    ) -> HandleChannel | None:
        """The channel ``config`` asks for (None: ``handle_channel_port`` is 0); a port
        it cannot bind stops the engine at start-up, naming the address."""
        if not config.handle_channel_port:
            return None
        if data_parallel_size > 1:
            # Every rank's scheduler would bind the one port.
            raise ValueError("sessionkv handle_channel_port does not support "
                             "data_parallel_size > 1")
        channel = cls(f"tcp://{config.handle_channel_bind_host}:"
                      f"{config.handle_channel_port}", config.side_port_secret)
        logger.info("sessionkv handle channel: sending session handles on %s",
                    channel.endpoint)
        return channel

    def __init__(self, bind: str, secret: str | None = None) -> None:
        self._secret = secret.encode() if secret else None   # signs each handle
        self._context, self._socket = bind_socket(zmq.PUB, bind, "handle_channel_port",
                                                  [(zmq.SNDHWM, _SEND_HWM)])
        # The bound address (a "*" port resolved), for logs and tests.
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0

    def publish(self, params: Mapping[str, Any]) -> bool:
        """Send D's end-of-turn ``kv_transfer_params`` as a handle; False when they do
        not make one (logged).  Never blocks."""
        try:
            raw = encode_handle(handle_from_params(params))
        except PayloadError as exc:
            logger.warning("sessionkv: handle not sent on the channel: %r", exc)
            return False
        return self._send(encode_frames(self._seq, raw, self._secret))

    def withdraw(self, withdrawal: HandleWithdrawal) -> bool:
        """Send a withdrawal (D ended the hold a handle names).  Never blocks."""
        return self._send(encode_frames(self._seq, encode_withdrawal(withdrawal),
                                        self._secret, WITHDRAW_TOPIC))

    def _send(self, frames: list[bytes]) -> bool:
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:   # not expected of PUB (it drops); never raise here
            logger.warning("sessionkv: handle channel send failed: %r", exc)
            return False
        self._seq += 1
        return True

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
