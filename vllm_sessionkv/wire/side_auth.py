"""Message authentication on the engines' side ports (torch-free; the proxy imports it).

D's early-decode inbox (ZMQ PULL) attaches whatever ``PrefillDone`` arrives to the
request its id names, and the proxy keeps whatever handle D's handle channel (ZMQ
PUB) sends.  With a shared secret (``side_port_secret`` in the connector's config
and the proxy's, or ``SESSIONKV_SIDE_PORT_SECRET`` in their environments), each such
message carries an HMAC-SHA256 of its bytes, keyed by the secret and bound to its
channel (a MAC made for one channel never verifies on the other), and a receiver
with the secret drops and counts every message without a valid one.  The MAC is
compared in constant time.  docs/operations.md (*Security*) has the threat model.
"""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = ["EARLY_DECODE", "HANDLE_CHANNEL", "MAC_BYTES", "MIN_SECRET_CHARS",
           "SECRET_ENV", "check_secret", "mac", "secret_from_env", "verify"]

# The environment variable both sides read when their config sets no secret.
SECRET_ENV = "SESSIONKV_SIDE_PORT_SECRET"
# A shorter secret is refused at start-up (an HMAC key of a few characters is a
# guess away).
MIN_SECRET_CHARS = 16
MAC_BYTES = 32

# Channel labels: the MAC covers label, a zero byte, then the message.
EARLY_DECODE = b"sessionkv-early-decode"
HANDLE_CHANNEL = b"sessionkv-handle-channel"


def check_secret(secret: str | None, key: str) -> None:
    """``ValueError`` naming ``key`` for a secret too short to key an HMAC."""
    if secret is not None and len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{key} must be at least {MIN_SECRET_CHARS} characters "
                         f"(got {len(secret)})")


def secret_from_env() -> str | None:
    return os.environ.get(SECRET_ENV) or None


def mac(secret: bytes, channel: bytes, *parts: bytes) -> bytes:
    digest = hmac.new(secret, channel + b"\0", hashlib.sha256)
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


def verify(secret: bytes, channel: bytes, tag: bytes, *parts: bytes) -> bool:
    return len(tag) == MAC_BYTES and hmac.compare_digest(tag, mac(secret, channel, *parts))
