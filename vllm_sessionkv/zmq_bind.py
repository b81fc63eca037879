"""The ZMQ sockets an engine binds for its peers and proxies (early decode's inbox,
the handle channel): a port that cannot be bound stops the engine at start-up,
naming the config key that chose it."""

from __future__ import annotations

from collections.abc import Iterable

import zmq

__all__ = ["bind_socket"]


def bind_socket(kind: int, bind: str, config_key: str,
                options: Iterable[tuple[int, int]] = ()) -> tuple[zmq.Context, zmq.Socket]:
    """A new context and a socket of ``kind`` (``LINGER`` 0, then ``options``) bound to
    ``bind``; when the bind fails both are closed and ``ValueError`` names
    ``config_key``."""
    context = zmq.Context()
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in options:
        sock.setsockopt(option, value)
    try:
        sock.bind(bind)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        context.term()
        raise ValueError(f"sessionkv {config_key}: cannot bind {bind}: {exc}") from None
    return context, sock
