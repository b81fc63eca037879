"""Fixtures for the pull guard's reader tests: a holder answering guard calls from a
real ledger over real ZMQ, as the NIXL side channel does."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import zmq

from vllm_sessionkv.guard import SendLedger, decode_call, encode_answer


@dataclass
class GuardHolder:
    ledger: SendLedger
    port: int
    _answering: threading.Lock

    def stall(self) -> None:
        """From now on calls queue unanswered (a side channel that stalls); an
        answer being sent is sent first."""
        self._answering.acquire()

    def resume(self) -> None:
        """Answer the queued calls, in order, and the later ones."""
        self._answering.release()


@pytest.fixture
def guard_holder():
    """A ROUTER answering guard calls from a ledger, as the side channel does."""
    ledger = SendLedger("D", claim_ttl_s=30.0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop, answering = threading.Event(), threading.Lock()

    def serve():
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50) and answering.acquire(timeout=0.05):
                try:
                    identity, _, msg = sock.recv_multipart()
                    call = decode_call(msg)
                    sock.send_multipart((identity, b"", encode_answer(
                        ledger.answer(call, time.perf_counter()))))
                finally:
                    answering.release()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    holder = GuardHolder(ledger, port, answering)
    yield holder
    stop.set()
    thread.join()
    sock.close(linger=0)
    ctx.term()


@pytest.fixture
def silent_holder():
    """The port of a side channel that takes calls and never answers."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    yield sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(linger=0)
    ctx.term()
