"""A lean HTTP/1.1 server for the proxy's front door, parsed with ``httptools``.

aiohttp's server spent more CPU per proxied request than the routing itself: a
request object, a payload stream, a case-insensitive multidict, a response object
and a writer per request, each written for generality the proxy does not use.
This server does what the OpenAI front needs and no more:

* requests are read whole (bodies are JSON, bounded by ``max_body_bytes``; chunked
  request bodies are decoded by the parser; ``Expect: 100-continue`` is answered);
* a handler answers with one :class:`Response` (one ``write`` with the head), or
  streams: :meth:`Request.start_stream` then :meth:`Request.write` per chunk
  (chunked transfer encoding, the bytes themselves untouched; writes wait while
  the client's socket buffer is full);
* keep-alive and pipelining, requests on one connection answered in order; idle
  connections are closed after ``keepalive_timeout_s`` by one sweep, not a timer
  per request;
* a client that goes away mid-answer makes the next ``write`` raise
  ``ConnectionResetError``, so the handler stops reading its upstream (which then
  closes that connection, and vLLM aborts the request);
* shutdown stops accepting, lets in-flight requests finish up to a deadline, then
  closes what is left.

Errors the server itself finds (malformed HTTP, oversized body, unknown path or
method, a handler that raised) are answered through ``error_response`` so they
have the same body shape as the application's own.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus

import httptools

__all__ = ["HttpServer", "Request", "Response"]

logger = logging.getLogger("sessionkv_proxy.server")


class Response:
    """A whole answer: status, body bytes and headers (``Content-Length`` is added)."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, status: int = 200, body: bytes = b"",
                 headers: list[tuple[str, str]] | None = None,
                 content_type: str | None = "application/json") -> None:
        self.status = status
        self.body = body
        self.headers = headers if headers is not None else []   # (str | bytes) pairs
        if content_type is not None:
            self.headers.append(("Content-Type", content_type))


Handler = Callable[["Request"], Awaitable[Response | None]]
ErrorResponder = Callable[[int, str], Response]

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_date_cache: list = [0, b""]


def _date_header() -> bytes:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date_cache[1]


def _head(status: int, headers: list[tuple[str, str]], version: bytes) -> list[bytes]:
    parts = [version, b" ", str(status).encode(), b" ", _REASONS.get(status, b"Unknown"),
             b"\r\n", _date_header()]
    for name, value in headers:
        # Headers relayed from an engine stay bytes; the proxy's own are str.
        parts += [name if name.__class__ is bytes else name.encode("latin-1"), b": ",
                  value if value.__class__ is bytes else value.encode("latin-1"), b"\r\n"]
    return parts


def _whole_answer(response: Response, version: bytes, keep_alive: bool) -> bytes:
    parts = _head(response.status, response.headers, version)
    parts += [b"Content-Length: ", str(len(response.body)).encode(), b"\r\n"]
    if not keep_alive:
        parts.append(b"Connection: close\r\n")
    parts += [b"\r\n", response.body]
    return b"".join(parts)


class Request:
    """One parsed request, and the means to answer it by streaming."""

    __slots__ = ("method", "path", "query", "headers", "body", "_conn", "_keep_alive",
                 "_version", "_streaming", "_chunked", "_ended", "stream_done")

    def __init__(self, conn: _Connection, method: str, url: bytes,
                 headers: dict[str, str], body: bytes, keep_alive: bool,
                 version: str) -> None:
        self._conn = conn
        self.method = method
        path, _, query = url.partition(b"?")
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
        self.headers = headers          # lower-case names
        self.body = body
        self._keep_alive = keep_alive
        self._version = b"HTTP/1.1" if version == "1.1" else b"HTTP/1.0"
        self._streaming = False
        self._chunked = False
        self._ended = False
        # The handler relayed its whole stream (set by the handler): a client that
        # closes after the last chunk has its answer, not a broken one.
        self.stream_done = False

    @property
    def peer_host(self) -> str | None:
        """The client's address (None when the transport has none)."""
        transport = self._conn.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        return peer[0] if isinstance(peer, tuple) and peer else None

    @property
    def client_gone(self) -> bool:
        """The client closed its connection (a stream to it can stop)."""
        return self._conn.closed

    # -- whole answers (the server calls this with the handler's Response)
    def _send(self, response: Response) -> None:
        self._conn.write(_whole_answer(response, self._version, self._keep_alive))

    # -- streamed answers
    async def start_stream(self, status: int, headers: list[tuple[str, str]]) -> None:
        """Send the head of a streamed answer; the body follows in :meth:`write`."""
        self._streaming = True
        parts = _head(status, headers, self._version)
        # An HTTP/1.0 client cannot read chunked encoding: it reads to the close.
        self._chunked = self._version == b"HTTP/1.1"
        if self._chunked:
            parts.append(b"Transfer-Encoding: chunked\r\n")
        else:
            self._keep_alive = False
        if not self._keep_alive:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        self._conn.write(b"".join(parts))
        await self._conn.drain()

    async def write(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self._chunked:
            chunk = b"%x\r\n%b\r\n" % (len(chunk), chunk)
        self._conn.write(chunk)
        await self._conn.drain()

    def end_stream(self) -> None:
        """End a streamed answer (the server does it after the handler if not yet)."""
        if self._ended:
            return
        self._ended = True
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")


class _Connection(asyncio.Protocol):
    """One client connection: parse, queue, answer in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        # Cached: on Python <= 3.11 every get_running_loop() is a getpid() syscall.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.last_active = time.monotonic()
        self.pending: collections.deque[Request] = collections.deque()
        self.task: asyncio.Task | None = None
        self._write_paused = False
        self._drain: asyncio.Future | None = None
        self._reset_message()

    def _reset_message(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body_parts: list[bytes] = []
        self.body_bytes = 0
        self.rejected: int = 0       # a status already answered for this message

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._reject(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server._connections.discard(self)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("client closed the connection"))
            self._drain.exception()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self._reset_message()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        length = self.headers.get("content-length")
        limit = self.server.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            self._refuse_body(length)
        elif self.headers.get("expect", "").lower() == "100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.rejected:
            return
        self.body_bytes += len(body)
        if self.body_bytes > self.server.max_body_bytes:
            self._refuse_body(None)
            return
        self.body_parts.append(body)

    def on_message_complete(self) -> None:
        if self.rejected:
            self._close_after_writes()
            return
        parts = self.body_parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        request = Request(self, self.parser.get_method().decode("latin-1"), self.url,
                          self.headers, body, self.parser.should_keep_alive(),
                          self.parser.get_http_version())
        self.pending.append(request)
        if self.task is None:
            self.task = self.loop.create_task(self._serve())
        if len(self.pending) > 16:
            self.transport.pause_reading()   # a client pipelining without reading

    # -- answering
    async def _serve(self) -> None:
        server = self.server
        try:
            while self.pending and not self.closed:
                request = self.pending.popleft()
                if len(self.pending) == 16:
                    self.transport.resume_reading()
                server._in_flight += 1
                try:
                    await self._answer(request)
                finally:
                    server._in_flight -= 1
                    self.last_active = time.monotonic()
                if not request._keep_alive:
                    self._close_after_writes()
                    return
        finally:
            self.task = None
            if server._in_flight == 0 and server._idle_waiter is not None \
                    and not server._idle_waiter.done():
                server._idle_waiter.set_result(None)

    async def _answer(self, request: Request) -> None:
        server = self.server
        handler = server.routes.get(request.path)
        if handler is None:
            response = server.error_response(404, f"no route for {request.path}")
        else:
            handle = handler.get(request.method)
            if handle is None:
                response = server.error_response(
                    405, f"method {request.method} not allowed on {request.path}")
            else:
                try:
                    response = await handle(request)
                except (ConnectionResetError, BrokenPipeError):
                    self._abort()   # the client left mid-answer
                    return
                except Exception:
                    logger.exception("handler for %s %s failed", request.method,
                                     request.path)
                    if request._streaming:
                        self._abort()   # a stream cut short must not look complete
                        return
                    response = server.error_response(500, "internal proxy error")
        if request._streaming:
            request.end_stream()
            if not request._keep_alive:
                self._close_after_writes()
        elif not self.closed:
            if response is None:
                logger.error("handler for %s %s returned no answer", request.method,
                             request.path)
                response = server.error_response(500, "internal proxy error")
            request._send(response)

    def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("client closed the connection")
        if self._write_paused:
            self._drain = self.loop.create_future()
            await self._drain

    def _refuse_body(self, declared: str | None) -> None:
        """Answer 413 at once, read and drop the rest of the body, then close."""
        size = f"{declared} bytes" if declared else "more than that"
        self._respond_now(413, f"request body too large ({size}; limit "
                          f"{self.server.max_body_bytes} bytes)")
        self.body_parts = []

    def _reject(self, status: int, message: str) -> None:
        if not self.rejected:
            self._respond_now(status, message)
        self._close_after_writes()

    def _respond_now(self, status: int, message: str) -> None:
        self.rejected = status
        if self.closed:
            return
        self.transport.write(_whole_answer(self.server.error_response(status, message),
                                           b"HTTP/1.1", keep_alive=False))

    def _close_after_writes(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.close()   # flushes what is buffered, then closes
        self.closed = True

    def _abort(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.abort()
        self.closed = True


class HttpServer:
    """Routes ``{path: {method: handler}}`` served on one listening socket."""

    def __init__(self, routes: dict[str, dict[str, Handler]], error_response: ErrorResponder,
                 max_body_bytes: int, keepalive_timeout_s: float = 75.0) -> None:
        self.routes = routes
        self.error_response = error_response
        self.max_body_bytes = max_body_bytes
        self.keepalive_timeout_s = keepalive_timeout_s
        self._connections: set[_Connection] = set()
        self._in_flight = 0
        self._idle_waiter: asyncio.Future | None = None
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port,
                                                reuse_address=True)
        self._sweeper = loop.create_task(self._sweep_idle(), name="http-idle-sweep")

    async def _sweep_idle(self) -> None:
        interval = max(0.5, min(10.0, self.keepalive_timeout_s / 4))
        while True:
            await asyncio.sleep(interval)
            cutoff = time.monotonic() - self.keepalive_timeout_s
            for conn in list(self._connections):
                if conn.task is None and not conn.pending and conn.last_active < cutoff:
                    conn._close_after_writes()

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; wait up to ``grace_s`` for in-flight requests; close all."""
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self._connections):
            if conn.task is None and not conn.pending:
                conn._close_after_writes()
        if self._in_flight:
            self._idle_waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._idle_waiter, grace_s)
            except asyncio.TimeoutError:
                logger.warning("shutdown: %d requests still in flight after %.0f s; "
                               "closing their connections", self._in_flight, grace_s)
        for conn in list(self._connections):
            conn._close_after_writes()
