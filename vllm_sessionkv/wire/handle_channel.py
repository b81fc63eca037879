"""The handle channel's frames: what D sends and the proxy reads (torch-free).

``[HANDLE_TOPIC, seq (u64 big-endian), protocol.encode_handle(handle)]``, one message
per end-of-turn handle; ``seq`` counts up from 0 per publisher, so a subscriber sees
the handles it missed (a gap) and a publisher that restarted (a number not above the
last).  The publisher is ``vllm_sessionkv.handle_channel``; the proxy's subscriber
``sessionkv_proxy.handle_subscriber``.
"""

from __future__ import annotations

__all__ = ["HANDLE_TOPIC", "decode_frames", "encode_frames"]

HANDLE_TOPIC = b"sessionkv-handle"


def encode_frames(seq: int, handle_bytes: bytes) -> list[bytes]:
    return [HANDLE_TOPIC, seq.to_bytes(8, "big"), handle_bytes]


def decode_frames(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, encoded handle), or None for frames that are not a handle message."""
    if len(frames) != 3 or frames[0] != HANDLE_TOPIC or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big"), frames[2]
