"""The handle channel's frames: what D sends and the proxy reads (torch-free).

``[HANDLE_TOPIC, seq (u64 big-endian), protocol.encode_handle(handle)]``, one message
per end-of-turn handle, and ``[WITHDRAW_TOPIC, seq, protocol.encode_withdrawal(w)]``
when D ends a hold before its lease (a subscription to ``HANDLE_TOPIC`` receives both:
ZMQ matches topics by prefix); ``seq`` counts up from 0 per publisher over both, so a
subscriber sees the messages it missed (a gap) and a publisher that restarted (a
number not above the last).  The publisher is ``vllm_sessionkv.handle_channel``; the
proxy's subscriber ``sessionkv_proxy.handle_subscriber``.

With a ``side_port_secret`` a fourth frame carries the HMAC of seq and handle (of
topic, seq and withdrawal for a withdrawal; ``side_auth``); a subscriber with the
secret takes only frames whose HMAC verifies, so a process that takes over D's address
cannot feed the proxy handles or withdraw them.
"""

from __future__ import annotations

from vllm_sessionkv.wire import side_auth

__all__ = ["HANDLE_TOPIC", "Unauthenticated", "WITHDRAW_TOPIC", "decode_frames",
           "encode_frames"]

HANDLE_TOPIC = b"sessionkv-handle"
WITHDRAW_TOPIC = b"sessionkv-handle-withdrawn"
_TOPICS = (HANDLE_TOPIC, WITHDRAW_TOPIC)


class Unauthenticated(ValueError):
    """A message without a valid HMAC, read with a secret."""


def _signed(topic: bytes, seq: bytes, body: bytes) -> tuple[bytes, ...]:
    # A handle's MAC covers seq and body (as before withdrawals existed); a
    # withdrawal's its topic too, so neither passes for the other.
    return (seq, body) if topic == HANDLE_TOPIC else (topic, seq, body)


def encode_frames(seq: int, body: bytes, secret: bytes | None = None,
                  topic: bytes = HANDLE_TOPIC) -> list[bytes]:
    frames = [topic, seq.to_bytes(8, "big"), body]
    if secret is not None:
        frames.append(side_auth.mac(secret, side_auth.HANDLE_CHANNEL,
                                    *_signed(topic, frames[1], body)))
    return frames


def decode_frames(frames: list[bytes], secret: bytes | None = None
                  ) -> tuple[bytes, int, bytes] | None:
    """(topic, seq, body), or None for frames that are not one of our messages; with
    ``secret``, :class:`Unauthenticated` for one without a valid HMAC (without, a
    fourth frame is ignored)."""
    if len(frames) not in (3, 4) or frames[0] not in _TOPICS or len(frames[1]) != 8:
        return None
    if secret is not None and not (len(frames) == 4 and side_auth.verify(
            secret, side_auth.HANDLE_CHANNEL, frames[3],
            *_signed(frames[0], frames[1], frames[2]))):
        raise Unauthenticated("handle channel message without a valid MAC")
    return frames[0], int.from_bytes(frames[1], "big"), frames[2]
