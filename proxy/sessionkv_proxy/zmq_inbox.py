"""A ZMQ socket's messages received on the event loop through one reader on its
descriptor, kept for the socket's life: the KV-event and handle-channel subscribers'
live sockets, one message or more per request.

pyzmq's asyncio socket adds a reader to the loop for each receive and removes it
once the message is in (two ``epoll_ctl`` calls), with a future, its bookkeeping and
several reads of the socket's ``EVENTS`` around them: about 170-230 us of CPU per
message here against 115-130 us this way (a publisher in another process sending
one message every 3 ms).

Messages stay in ZMQ's queue until received, under the socket's receive high-water
mark, as with pyzmq's socket: the reader only wakes a receive that waits.  ZMQ's
descriptor is edge-triggered: it becomes readable when the socket has commands to
process (a message arrived, a peer connected), and only reading ``EVENTS`` (or
receiving) processes them and clears it.  So the reader reads ``EVENTS`` on every
signal, waiting receive or not (else the loop would call it again at once, for
ever), and a receive reads it before it waits, so that a message whose signal was
consumed by an earlier read is received without one.
"""

from __future__ import annotations

import asyncio

import zmq

__all__ = ["Inbox"]


class Inbox:
    """``recv_multipart`` of a plain (not asyncio) pyzmq socket, awaited; ``close``
    takes the reader off the loop and closes the socket.  Made in the task that
    receives (one receiver at a time)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._waiter: asyncio.Future[None] | None = None
        self._loop.add_reader(self._fd, self._signalled)

    def _signalled(self) -> None:
        ready = self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN   # clears the signal
        waiter = self._waiter
        if ready and waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def recv_multipart(self) -> list[bytes]:
        sock = self._sock
        while True:
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                try:
                    return sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    pass
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        self._sock.close(linger=0)
