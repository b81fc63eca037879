"""The pull guard (``guard.py``) served on the engine's NIXL side channel, beside
NIXL's own handshake."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
from vllm.utils.network_utils import make_zmq_path

__all__ = ["serve_guard_on_side_channel"]

logger = logging.getLogger("vllm.sessionkv")


def serve_guard_on_side_channel(scheduler: NixlPullConnectorScheduler,
                                answer: Callable[[bytes], bytes | None]
                                ) -> Callable[[], Exception | None]:
    """Serve the pull guard on the engine's NIXL side channel beside NIXL's handshake.

    Stock code starts ``self._nixl_handshake_listener`` as a thread in
    ``set_xfer_handshake_metadata``; an instance attribute of that name takes its
    place.  It is stock's loop (vLLM 0.32.0 ``base_scheduler.py``) with one branch
    added: a message ``answer`` recognises gets ``answer``'s bytes back.  It runs in
    the scheduler process, which holds the guard's ledger.

    Returns a function giving the error that stopped the listener from binding its
    port, if one did: stock's thread dies with it and the engine waits for it for
    ever; ours reports it, for the scheduler to stop the engine saying why."""
    failure: list[Exception] = []

    def listener(encoded_data: dict[tuple[int, int], Any], ready_event: Any,
                 stop_event: Any, host: str, port: int) -> None:
        import zmq

        path = make_zmq_path("tcp", host, port)
        try:
            ctx = zmq_ctx(zmq.ROUTER, path)
            sock = ctx.__enter__()
        except zmq.ZMQError as exc:
            failure.append(exc)
            ready_event.set()
            return
        try:
            sock.setsockopt(zmq.RCVTIMEO, 1000)
            ready_event.set()
            _serve_side_channel(sock, encoded_data, stop_event, answer)
        finally:
            ctx.__exit__(None, None, None)

    scheduler._nixl_handshake_listener = listener
    return lambda: failure[0] if failure else None


def _serve_side_channel(sock: Any, encoded_data: dict[tuple[int, int], Any],
                        stop_event: Any, answer: Callable[[bytes], bytes | None]) -> None:
    import msgspec
    import zmq

    while True:
        try:
            identity, _, msg = sock.recv_multipart()
        except zmq.Again:
            if stop_event.is_set():
                break
            continue
        except ValueError:   # not three frames: not for us, nor for NIXL
            continue
        try:
            reply = answer(msg)
        except Exception:   # the handshake must outlive any fault of ours
            logger.exception("sessionkv side channel: guard call not answered")
            continue
        if reply is not None:
            sock.send_multipart((identity, b"", reply))
            continue
        try:
            msg, target_pp_rank, target_tp_rank = msgspec.msgpack.decode(msg)
            data = encoded_data[(target_pp_rank, target_tp_rank)]
        except (msgspec.DecodeError, ValueError, TypeError, KeyError):
            logger.warning("sessionkv side channel: unreadable message dropped")
            continue
        if msg != GET_META_MSG:
            logger.warning("Connection listener got unexpected message %s", msg)
        ts = msgspec.msgpack.encode(time.perf_counter())
        sock.send_multipart((identity, b"", data, ts))
