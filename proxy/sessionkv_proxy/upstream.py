"""A lean HTTP/1.1 client for the request hot path: pooled keep-alive connections to
each engine, parsed with ``httptools`` (llhttp, the parser uvicorn uses).

``aiohttp.ClientSession`` spends most of a proxied request's CPU on generality this
path does not need (cookies, redirects, auth, compression, tracing, per-request
timer objects).  The proxy sends two kinds of request upstream: a JSON body to an
engine of its own pools, answered either as one JSON body or as a server-sent event
stream.  This client does exactly that: it writes one pre-built request, reads the
status and headers, then hands the body over whole or chunk by chunk as it arrives
(chunked transfer decoded, the SSE bytes themselves untouched).

A connection goes back to its engine's pool only after a complete response with
keep-alive; anything else (error, timeout, a reader that stopped early) closes it,
so a half-read response can never leak into the next request.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

__all__ = ["UpstreamConnectError", "UpstreamPool", "UpstreamResponse"]


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


async def _wait(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, timeout_s: float):
    # One timer handle instead of wait_for's task and shield per await.
    timer = loop.call_later(timeout_s, _expire, fut)
    try:
        return await fut
    finally:
        timer.cancel()


class UpstreamConnectError(ConnectionError):
    """The request never reached the engine (refused, reset before the response
    started, or connect timeout): safe to retry on another worker."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        # Cached: on Python <= 3.11 every get_running_loop() is a getpid() syscall.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done: asyncio.Future[None] = self.loop.create_future()
        self.chunks: collections.deque[bytes] = collections.deque()
        self.wakeup: asyncio.Future[None] | None = None
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.got_bytes = False

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def eof_received(self):
        # An engine closing after a body without Content-Length ends that body.
        if self.headers_done.done() and not self.complete:
            try:
                self.parser.feed_data(b"")
            except httptools.HttpParserError:
                pass
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        if not self.complete:
            self._fail(exc or ConnectionResetError("connection closed by engine"))

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- helpers
    def _wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if not self.headers_done.done():
            self.headers_done.set_exception(exc)
            self.headers_done.exception()  # retrieved here; the caller re-raises
        self._wake()
        if self.transport is not None and not self.closed:
            self.transport.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class UpstreamResponse:
    """Status and headers at once; the body read whole or streamed, exactly once."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int], conn: _Conn,
                 timeout_s: float) -> None:
        self._pool = pool
        self._key = key
        self._conn = conn
        self._timeout_s = timeout_s
        self._released = False
        self.status = conn.status

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """As the engine sent them: relayed without decoding."""
        return self._conn.headers

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        loop = conn.loop
        try:
            while True:
                while conn.chunks:
                    yield conn.chunks.popleft()
                if conn.complete:
                    return
                if conn.error is not None:
                    raise ConnectionResetError(f"engine stream broke: {conn.error!r}")
                conn.wakeup = loop.create_future()
                await _wait(loop, conn.wakeup, self._timeout_s)
        finally:
            self.release()

    async def read(self) -> bytes:
        conn = self._conn
        if conn.complete:   # the usual case for a short answer: it came with the head
            chunks = conn.chunks
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self.release()
            return data
        parts = [chunk async for chunk in self.iter_chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Return the connection to the pool if the response was read to its end."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None:
            self._pool._put(self._key, conn)
        else:
            conn.close()


class UpstreamPool:
    """Keep-alive connections per (host, port), created on demand, kept up to
    ``max_idle_per_host``."""

    def __init__(self, connect_timeout_s: float = 5.0, request_timeout_s: float = 600.0,
                 max_idle_per_host: int = 64) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}

    def _target(self, base_url: str) -> tuple[tuple[str, int], bytes]:
        cached = self._targets.get(base_url)
        if cached is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"upstream URL must be http://host:port, got {base_url!r}")
            port = parts.port or 80
            host_header = f"{parts.hostname}:{port}".encode()
            cached = ((parts.hostname, port), host_header)
            self._targets[base_url] = cached
        return cached

    def _put(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self.max_idle_per_host:
            conn.close()
        else:
            idle.append(conn)

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Conn, key[0], key[1]), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc!r}"
                                       ) from exc
        return conn

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: dict[str, str] | None = None) -> UpstreamResponse:
        """POST ``body`` (JSON) and wait for the status line and headers."""
        key, host_header = self._target(base_url)
        head = [b"POST ", path.encode(), b" HTTP/1.1\r\nHost: ", host_header,
                b"\r\nContent-Type: application/json\r\nContent-Length: ",
                str(len(body)).encode(), b"\r\n"]
        for name, value in (headers or {}).items():
            head += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
        head += (b"\r\n", body)
        request = b"".join(head)
        idle = self._idle.get(key)
        # An idle connection may have been closed by the engine meanwhile; a request
        # that got no byte back on a reused connection is retried once on a new one.
        for reused in (True, False):
            conn = None
            while reused and idle:
                candidate = idle.pop()
                if not candidate.closed:
                    conn = candidate
                    break
            if conn is None:
                reused = False
                conn = await self._connect(key)
            conn._reset()
            conn.transport.write(request)
            try:
                await _wait(conn.loop, conn.headers_done, self.request_timeout_s)
            except asyncio.TimeoutError:
                conn.close()
                raise
            except (OSError, httptools.HttpParserError) as exc:
                conn.close()
                if reused and not conn.got_bytes:
                    continue
                raise UpstreamConnectError(f"{base_url}{path}: {exc!r}") from exc
            except asyncio.CancelledError:
                conn.close()
                raise
            return UpstreamResponse(self, key, conn, self.request_timeout_s)
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
