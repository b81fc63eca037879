"""The pull guard on NIXL's side channel (``_vllm/side_channel.py``).

The private vLLM 0.32 surface checked by name, and the patch or accessor checked on
vLLM's own objects.  With vLLM installed these tests fail, never skip: an ImportError
here is the likeliest sign of a vLLM upgrade.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import side_channel  # noqa: E402


def test_stock_starts_the_listener_through_the_instance_attribute():
    """The side-channel listener is started through the instance attribute, so ours
    takes its place, with stock's arguments."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler

    start = inspect.getsource(base_scheduler.NixlBaseConnectorScheduler
                              .set_xfer_handshake_metadata)
    assert "target=self._nixl_handshake_listener" in start
    params = inspect.signature(
        base_scheduler.NixlBaseConnectorScheduler._nixl_handshake_listener).parameters
    assert list(params) == ["encoded_data", "ready_event", "stop_event", "host", "port"]


def test_side_channel_serves_nixl_and_the_guard_and_reports_a_port_it_cannot_bind():
    """Our listener answers NIXL's handshake as stock does, guard calls through the
    ledger's answer, survives a fault in that answer, and reports a taken port
    instead of dying silently (stock's thread dies and the engine waits for ever)."""
    import socket
    import threading
    import time
    import types

    import msgspec
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    from vllm_sessionkv.guard import (GuardCall, GuardOp, SendLedger, decode_answer,
                                      decode_call, encode_answer, encode_call)

    ledger = SendLedger("D", claim_ttl_s=5.0)
    ledger.add("x", 7)
    faults = []

    def answer(raw):
        call = decode_call(raw)
        if call is None:
            return None
        if call.request_id == "boom":
            faults.append(call)
            raise RuntimeError("a bug of ours")
        return encode_answer(ledger.answer(call, time.perf_counter()))

    scheduler = types.SimpleNamespace()
    failure = side_channel.serve_guard_on_side_channel(scheduler, answer)
    ctx = zmq.Context()
    # A plain socket's close frees the port at once (a ZMQ socket's close is
    # asynchronous: its port could still be bound when the listener binds).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=scheduler._nixl_handshake_listener,
                              args=({(0, 0): b"meta"}, ready, stop, "127.0.0.1", port))
    thread.start()
    req, dealer = ctx.socket(zmq.REQ), ctx.socket(zmq.DEALER)
    try:
        assert ready.wait(10) and failure() is None
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        assert req.poll(5000)
        data, ts = req.recv_multipart()
        assert data == b"meta" and isinstance(msgspec.msgpack.decode(ts), float)
        dealer.connect(f"tcp://127.0.0.1:{port}")

        def call(request_id, seq):
            dealer.send_multipart((b"", encode_call(GuardCall(
                op=GuardOp.CLAIM, engine_id="D", request_id=request_id, token=7,
                reader="p/r", member="tp0", seq=seq))))

        call("boom", 1)                  # unanswered, and the listener lives on
        call("x", 2)
        assert dealer.poll(5000)
        assert decode_answer(dealer.recv_multipart()[-1]).seq == 2 and faults
        # A second listener on the same port cannot bind: reported, not hung.
        scheduler2 = types.SimpleNamespace()
        failure2 = side_channel.serve_guard_on_side_channel(scheduler2, answer)
        ready2 = threading.Event()
        scheduler2._nixl_handshake_listener({}, ready2, threading.Event(), "127.0.0.1", port)
        assert ready2.is_set() and isinstance(failure2(), zmq.ZMQError)
    finally:
        req.close(linger=0)
        dealer.close(linger=0)
        stop.set()
        thread.join(10)
        ctx.term()
    assert not thread.is_alive()
