"""The proxy's front door: aiohttp's low-level HTTP server, with explicit limits.

Every client touches this, so it runs a well-kept parser (aiohttp's llhttp-based one)
and states its limits instead of inheriting them:

* the request line (URL included) and each header field at most
  :class:`FrontLimits` ``max_line_bytes`` / ``max_field_bytes`` (aiohttp's ``max_line_size``
  and ``max_field_size``), at most ``max_headers`` header lines: past them, a 400
  and a closed connection;
* a request's head must arrive within ``header_timeout_s`` of its first byte (aiohttp
  has no such deadline; :class:`_Protocol` adds it), and an idle keep-alive
  connection is closed after ``keepalive_timeout_s``;
* a body at most the config's ``max_body_bytes``, declared or chunked: a 413, the rest read and
  dropped for at most ``lingering_s`` (so a client still sending reads the answer),
  then a closed connection; ``Expect: 100-continue`` is answered.

Handlers see a small :class:`Request` (method, path, query, headers, the whole body)
and answer with one :class:`Response`, or stream:
:meth:`Request.start_stream` then :meth:`Request.write` per chunk (chunked encoding;
a write waits while the client's socket buffer is full) and :meth:`Request.end_stream`.
A client that leaves mid-answer makes the next write raise ``ConnectionResetError``,
so the handler stops reading its upstream.  Errors the server finds itself
(malformed HTTP, limits, unknown path or method, a handler that raised) are answered
through ``error_response``, so they have the same body shape as the application's.
Stopping stops accepting, lets in-flight requests finish up to a deadline, then
closes what is left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
import msgspec
from aiohttp import web, web_protocol
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from multidict import CIMultiDict, CIMultiDictProxy

from ._aiohttp import check_installed as check_aiohttp_internals

__all__ = ["FrontLimits", "HttpServer", "Request", "Response"]

logger = logging.getLogger("sessionkv_proxy.server")


class Response:
    """A whole answer: status, body bytes and headers (``Content-Length`` is added)."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, status: int = 200, body: bytes = b"",
                 headers: list[tuple[str, str]] | None = None,
                 content_type: str | None = "application/json") -> None:
        self.status = status
        self.body = body
        self.headers = headers if headers is not None else []
        if content_type is not None:
            self.headers.append(("Content-Type", content_type))


Handler = Callable[["Request"], Awaitable[Response | None]]
ErrorResponder = Callable[[int, str], Response]


class FrontLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one client may send the proxy (``front`` in the proxy's config; the body
    limit is its ``max_body_bytes``).  aiohttp's own defaults are 8190 bytes per line
    and field and 128 headers; stated here so that a change is ours."""

    max_line_bytes: int = 8190
    max_field_bytes: int = 8190
    max_headers: int = 100
    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 75.0
    # After refusing a body (413), how long the rest of it is read and dropped before
    # the connection closes, so that a client still sending can read the answer.
    lingering_s: float = 2.0

    def __post_init__(self):
        for name in ("max_line_bytes", "max_field_bytes", "max_headers"):
            if getattr(self, name) < 1:
                raise ValueError(f"front.{name} must be >= 1")
        for name in ("header_timeout_s", "keepalive_timeout_s", "lingering_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"front.{name} must be within (0, 3600]")


def _web_response(response: Response) -> web.Response:
    # One multidict built from the pairs, not an ``add`` per header.
    return web.Response(status=response.status, body=response.body,
                        headers=CIMultiDict(response.headers))


class _RequestTooLarge(Exception):
    pass


class Request:
    """One request read whole, and the means to answer it by streaming."""

    __slots__ = ("method", "path", "query", "headers", "body", "stream_done", "_raw",
                 "_stream", "_writer", "_ended")

    def __init__(self, raw: web.BaseRequest, body: bytes) -> None:
        self._raw = raw
        self.method = raw.method
        self.path = raw.raw_path.partition("?")[0]
        self.query = raw.query_string
        # aiohttp's parsed headers: any case of a name finds it, and ``get`` gives a
        # repeated header's first value.
        self.headers: CIMultiDictProxy[str] = raw.headers
        self.body = body
        self._stream: web.StreamResponse | None = None
        self._writer: AbstractStreamWriter | None = None   # the stream's body writer
        self._ended = False
        # The handler relayed its whole stream (set by the handler): a client that
        # closes after the last chunk has its answer, not a broken one.
        self.stream_done = False

    @property
    def peer_host(self) -> str | None:
        """The client's address (None when the transport has none)."""
        return self._raw.remote

    @property
    def client_gone(self) -> bool:
        """The client closed its connection (a stream to it can stop)."""
        transport = self._raw.transport
        return transport is None or transport.is_closing()

    async def start_stream(self, status: int, headers: list[tuple[str, str]]) -> None:
        """Send the head of a streamed answer; the body follows in :meth:`write`."""
        stream = web.StreamResponse(status=status, headers=CIMultiDict(headers))
        if self._raw.version >= (1, 1):
            stream.enable_chunked_encoding()
        else:
            stream.force_close()   # an HTTP/1.0 client reads to the close
        self._stream = stream
        self._writer = await stream.prepare(self._raw)

    async def write(self, chunk: bytes) -> None:
        # To the body writer ``prepare`` returned, not through ``StreamResponse.write``
        # (a frame less per token of a stream), with its check of the stream's end.
        if chunk:
            if self._ended:
                raise RuntimeError("Cannot call write() after end_stream()")
            await self._writer.write(chunk)

    async def end_stream(self) -> None:
        """End a streamed answer (the server does it after the handler if not yet)."""
        if self._ended or self._stream is None:
            return
        self._ended = True
        await self._stream.write_eof()


class _Protocol(web_protocol.RequestHandler):
    """aiohttp's connection handler plus a deadline for a request's head: from the
    first byte of a request until its handler starts (aiohttp bounds only the idle
    time between requests, and that only while no byte has come)."""

    def __init__(self, *args, header_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.head_deadline: asyncio.TimerHandle | None = None
        self.in_request = False

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        messages = self._messages
        if not messages:
            # A head still incomplete: its deadline runs from here.  (A head that came
            # whole, the usual case, is queued for its handler and needs none.)
            if not self.in_request and self.head_deadline is None \
                    and self.transport is not None:
                self.head_deadline = asyncio.get_running_loop().call_later(
                    self.header_timeout_s, self._head_overdue)
        elif not isinstance(messages[-1][0], RawRequestMessage) \
                and self.transport is not None:
            # A request aiohttp could not parse (a limit, garbage) is queued as an
            # error to answer, but aiohttp keeps reading: each later chunk of a 64 MiB
            # request line queued another error whose traceback held that chunk, about
            # 15 MiB of cyclic garbage per such request.  The connection is done: read
            # no more.
            self.transport.pause_reading()

    def _head_overdue(self) -> None:
        self.head_deadline = None
        if not self.in_request:
            logger.info("closing a connection whose request head took over %.0f s",
                        self.header_timeout_s)
            self.force_close()
            if self.transport is not None:
                self.transport.close()

    def request_started(self) -> None:
        self.in_request = True
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def request_ended(self) -> None:
        self.in_request = False

    def connection_lost(self, exc) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None
        super().connection_lost(exc)

    def handle_error(self, request, status=500, exc=None, message=None):
        # aiohttp's own errors (malformed HTTP, a limit) in the application's body shape.
        super().handle_error(request, status, exc, message)   # logs; raises if sent
        answer = _web_response(self._manager.error_response(
            status, f"malformed or oversized HTTP request: {message or status}"))
        answer.force_close()
        return answer


class _Server(web.Server):
    def __init__(self, handler, error_response: ErrorResponder, header_timeout_s: float,
                 **kwargs) -> None:
        super().__init__(handler, **kwargs)
        self.error_response = error_response
        self.header_timeout_s = header_timeout_s

    def __call__(self) -> _Protocol:
        return _Protocol(self, loop=self._loop, header_timeout_s=self.header_timeout_s,
                         **self._kwargs)


class HttpServer:
    """Routes ``{path: {method: handler}}`` served on one listening socket."""

    def __init__(self, routes: dict[str, dict[str, Handler]], error_response: ErrorResponder,
                 max_body_bytes: int, limits: FrontLimits | None = None,
                 keepalive_timeout_s: float | None = None) -> None:
        limits = limits or FrontLimits()
        if keepalive_timeout_s is not None:
            limits = msgspec.structs.replace(limits, keepalive_timeout_s=keepalive_timeout_s)
        self.routes = routes
        self.error_response = error_response
        self.max_body_bytes = max_body_bytes
        self.limits = limits
        self._server: _Server | None = None
        self._listener: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int, ssl=None) -> None:
        """Listen on ``host:port``; HTTPS when ``ssl`` (an ``ssl.SSLContext``) is given."""
        check_aiohttp_internals()  # the subclasses below rely on them
        limits = self.limits
        self._server = _Server(
            self._handle, self.error_response, limits.header_timeout_s,
            keepalive_timeout=limits.keepalive_timeout_s,
            max_line_size=limits.max_line_bytes, max_field_size=limits.max_field_bytes,
            max_headers=limits.max_headers, lingering_time=limits.lingering_s,
            access_log=None)
        self._listener = await asyncio.get_running_loop().create_server(
            self._server, host, port, reuse_address=True, ssl=ssl)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; wait up to ``grace_s`` for in-flight requests; close all."""
        if self._listener is not None:
            self._listener.close()
        if self._server is not None:
            await self._server.shutdown(grace_s)

    def _error(self, status: int, message: str, close: bool = False) -> web.Response:
        answer = _web_response(self.error_response(status, message))
        if close:
            answer.force_close()
        return answer

    async def _read_body(self, raw: web.BaseRequest) -> bytes:
        limit = self.max_body_bytes
        if raw.content_length is not None and raw.content_length > limit:
            raise _RequestTooLarge(f"{raw.content_length} bytes")
        if raw.headers.get("Expect", "").lower() == "100-continue":
            await raw.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        content = raw.content
        if content.is_eof():
            # The whole body came with the head (the usual small request): take it
            # without the read loop.
            body = content.read_nowait()
            if len(body) > limit:
                raise _RequestTooLarge("more than that")
            return body
        parts, size = [], 0
        async for chunk in content.iter_any():
            size += len(chunk)
            if size > limit:
                raise _RequestTooLarge("more than that")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _handle(self, raw: web.BaseRequest) -> web.StreamResponse:
        protocol = raw.protocol
        if isinstance(protocol, _Protocol):
            protocol.request_started()
        try:
            return await self._answer(raw)
        finally:
            if isinstance(protocol, _Protocol):
                protocol.request_ended()

    async def _answer(self, raw: web.BaseRequest) -> web.StreamResponse:
        path = raw.raw_path.partition("?")[0]
        methods = self.routes.get(path)
        if methods is None:
            return self._error(404, f"no route for {path}")
        handle = methods.get(raw.method)
        if handle is None:
            return self._error(405, f"method {raw.method} not allowed on {path}")
        try:
            body = await self._read_body(raw)
        except _RequestTooLarge as exc:
            return self._error(413, f"request body too large ({exc}; limit "
                                    f"{self.max_body_bytes} bytes)", close=True)
        request = Request(raw, body)
        try:
            response = await handle(request)
        except (ConnectionResetError, BrokenPipeError):
            self._abort(raw)   # the client left mid-answer
            return request._stream or self._error(499, "client closed the connection", True)
        except Exception:
            logger.exception("handler for %s %s failed", raw.method, path)
            if request._stream is not None:
                self._abort(raw)   # a stream cut short must not look complete
                return request._stream
            return self._error(500, "internal proxy error")
        if request._stream is not None:
            try:
                await request.end_stream()
            except ConnectionResetError:
                pass
            return request._stream
        if response is None:
            logger.error("handler for %s %s returned no answer", raw.method, path)
            return self._error(500, "internal proxy error")
        return _web_response(response)

    @staticmethod
    def _abort(raw: web.BaseRequest) -> None:
        transport = raw.transport
        if transport is not None:
            transport.abort()
