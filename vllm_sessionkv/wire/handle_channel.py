"""The handle channel's frames: what D sends and the proxy reads (torch-free).

``[HANDLE_TOPIC, seq (u64 big-endian), protocol.encode_handle(handle)]``, one message
per end-of-turn handle; ``seq`` counts up from 0 per publisher, so a subscriber sees
the handles it missed (a gap) and a publisher that restarted (a number not above the
last).  The publisher is ``vllm_sessionkv.handle_channel``; the proxy's subscriber
``sessionkv_proxy.handle_subscriber``.

With a ``side_port_secret`` a fourth frame carries the HMAC of seq and handle
(``side_auth``); a subscriber with the secret takes only frames whose HMAC verifies,
so a process that takes over D's address cannot feed the proxy handles.
"""

from __future__ import annotations

from vllm_sessionkv.wire import side_auth

__all__ = ["HANDLE_TOPIC", "Unauthenticated", "decode_frames", "encode_frames"]

HANDLE_TOPIC = b"sessionkv-handle"


class Unauthenticated(ValueError):
    """A handle message without a valid HMAC, read with a secret."""


def encode_frames(seq: int, handle_bytes: bytes, secret: bytes | None = None
                  ) -> list[bytes]:
    frames = [HANDLE_TOPIC, seq.to_bytes(8, "big"), handle_bytes]
    if secret is not None:
        frames.append(side_auth.mac(secret, side_auth.HANDLE_CHANNEL, frames[1],
                                    handle_bytes))
    return frames


def decode_frames(frames: list[bytes], secret: bytes | None = None
                  ) -> tuple[int, bytes] | None:
    """(seq, encoded handle), or None for frames that are not a handle message;
    with ``secret``, :class:`Unauthenticated` for one without a valid HMAC (without,
    a fourth frame is ignored)."""
    if len(frames) not in (3, 4) or frames[0] != HANDLE_TOPIC or len(frames[1]) != 8:
        return None
    if secret is not None and not (len(frames) == 4 and side_auth.verify(
            secret, side_auth.HANDLE_CHANNEL, frames[3], frames[1], frames[2])):
        raise Unauthenticated("handle message without a valid MAC")
    return int.from_bytes(frames[1], "big"), frames[2]
