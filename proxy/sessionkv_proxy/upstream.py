"""The request hot path's HTTP client: aiohttp's client connection protocol
(``aiohttp.client_proto.ResponseHandler``: its llhttp response parser, read timeout and
payload streams) over keep-alive connections to every engine.

Not ``aiohttp.ClientSession``: the proxy sends one kind of request, a JSON POST to an
engine of its own pools, and the session's per-request machinery (request and response
objects, URL handling, cookies, traces, timers, redirects) cost about as much CPU as
the whole relay does without it.  Measured with one stub engine, a relay on
``ClientSession`` spent 350 / 181 / 206 us of CPU per request at c=1 / 16 / 64, the
same relay on this protocol 250 / 119 / 103 us, and vllm-router 200 / 94 / 91 us
(``docs/measurements.md``).  What is kept from aiohttp is what a client must get right:
parsing the engine's answer (status line, headers, chunked and length-delimited
bodies, limits), flow control on the body stream, and the read timeout.

:meth:`UpstreamPool.post` returns once the status and headers are in; the body is then
read whole or relayed chunk by chunk as it arrives (the bytes untouched: no
decompression, no cookies, no redirects).  A connection goes back to the pool only
after a complete response that leaves it open; anything else (error, timeout, a reader
that stopped early, ``Connection: close``) closes it, so a half-read response can never
leak into the next request.  Failures are sorted for the caller:
:class:`UpstreamConnectError` when the request never reached the engine (safe to retry
on another worker), ``asyncio.TimeoutError`` when the engine went silent for
``request_timeout_s``, ``ConnectionResetError`` when a body broke off.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import RawResponseMessage
from aiohttp.streams import StreamReader
from multidict import CIMultiDictProxy

from ._aiohttp import check_installed as check_aiohttp_internals

__all__ = ["UpstreamConnectError", "UpstreamPool", "UpstreamResponse"]

# vLLM's API server (uvicorn) closes a keep-alive connection after 5 s idle; dropping
# ours first keeps a request from landing on a connection the engine is closing.
_IDLE_KEEPALIVE_S = 4.0


class UpstreamConnectError(ConnectionError):
    """The request never reached the engine (refused, reset before the response
    started, or connect timeout): safe to retry on another worker."""


def _body_error(exc: Exception, what: str) -> Exception:
    """aiohttp's error reading a body as the relay handles it: a read timeout is a
    timeout, a broken body a reset connection."""
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return asyncio.TimeoutError(str(exc))
    return ConnectionResetError(f"engine {what} broke: {exc!r}")


class _Connection(ResponseHandler):
    """aiohttp's ``ResponseHandler`` less two costs it pays on every read of a body,
    which a streamed answer pays per token (one read per server-sent event):

    * the read timeout: aiohttp cancels its timer and starts a new one on every
      ``data_received``.  Here each read only moves the deadline, and the one timer
      running checks it when it fires (started again for the time left): the same
      timeout, ``request_timeout_s`` after the last byte.
    * ``resume_reading``: ``StreamReader`` calls it after every read it hands out,
      paused or not, and aiohttp then feeds the parser an empty read and resumes the
      transport.  With nothing paused (neither flag set: every pause sets one) both
      are no-ops: the parser holds no bytes back for a body that is not decompressed
      (``auto_decompress=False``, set at connect).
    """

    _read_deadline = 0.0

    def _reschedule_timeout(self) -> None:
        timeout = self._read_timeout
        if not timeout:
            self._drop_timeout()
            return
        loop = self._loop
        self._read_deadline = loop.time() + timeout
        if self._read_timeout_handle is None:
            self._read_timeout_handle = loop.call_at(self._read_deadline,
                                                     self._read_timeout_due)

    def _read_timeout_due(self) -> None:
        self._read_timeout_handle = None
        if self._loop.time() < self._read_deadline:   # bytes came since it was set
            self._read_timeout_handle = self._loop.call_at(self._read_deadline,
                                                           self._read_timeout_due)
        else:
            self._on_read_timeout()

    def resume_reading(self, resume_parser: bool = True) -> None:
        if self._reading_paused or self._buffer_paused:
            super().resume_reading(resume_parser)


class UpstreamResponse:
    """Status and headers at once; the body read whole or streamed, exactly once."""

    __slots__ = ("status", "_message", "_payload", "_protocol", "_home", "_released")

    def __init__(self, message: RawResponseMessage, payload: StreamReader,
                 protocol: ResponseHandler, home: _Endpoint) -> None:
        self.status = message.code
        self._message = message
        self._payload = payload
        self._protocol = protocol
        self._home = home
        self._released = False

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """As the engine sent them, parsed by aiohttp."""
        return self._message.headers

    async def next_chunk(self) -> bytes:
        """The body's next chunk as the engine chunked it (one server-sent event per
        chunk from vLLM), b"" at its end.  Not ``iter_any``, which hands over all
        that is buffered at once: a stream read late (D ran ahead while the proxy
        waited for P) then went to the client in one write, and a client that had
        left was not noticed.  The connection is released at the end, and on any
        error."""
        payload = self._payload
        try:
            while True:
                chunk, end_of_chunk = await payload.readchunk()
                if chunk:
                    return chunk
                if not end_of_chunk:   # aiohttp's end of the body
                    self.release()
                    return b""
        except (aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError) as exc:
            self.release()
            raise _body_error(exc, "stream") from exc
        except BaseException:
            self.release()
            raise

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The chunks of :meth:`next_chunk`; closing the iterator early releases
        the connection."""
        try:
            while chunk := await self.next_chunk():
                yield chunk
        finally:
            self.release()

    async def read(self) -> bytes:
        try:
            return await self._payload.read()
        except (aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError) as exc:
            raise _body_error(exc, "answer") from exc
        finally:
            self.release()

    def release(self) -> None:
        """Return the connection to the pool if the response was read to its end and
        the engine keeps it open, close it otherwise."""
        if self._released:
            return
        self._released = True
        if self._payload.at_eof() and not self._protocol.should_close:
            self._home.put(self._protocol)
        else:
            self._protocol.close()


class _Endpoint:
    """One engine's idle keep-alive connections, the most recently used first out."""

    __slots__ = ("host", "port", "head", "idle")

    def __init__(self, host: str, port: int, extra_head: bytes = b"") -> None:
        self.host = host
        self.port = port
        # The header lines every request to this engine carries, after its request line.
        self.head = (f"Host: {host}:{port}\r\n"
                     "Content-Type: application/json\r\n").encode("latin-1") + extra_head
        self.idle: list[tuple[float, ResponseHandler]] = []

    def take(self) -> ResponseHandler | None:
        oldest = time.monotonic() - _IDLE_KEEPALIVE_S
        while self.idle:
            since, protocol = self.idle.pop()
            if since > oldest and protocol.is_connected() and not protocol.should_close:
                return protocol
            protocol.close()
        return None

    def put(self, protocol: ResponseHandler) -> None:
        self.idle.append((time.monotonic(), protocol))

    def close(self) -> None:
        for _, protocol in self.idle:
            protocol.close()
        self.idle.clear()


class UpstreamPool:
    """Keep-alive connections to the engines, created on demand."""

    def __init__(self, connect_timeout_s: float = 5.0, request_timeout_s: float = 600.0,
                 engine_api_key: str | None = None) -> None:
        check_aiohttp_internals()  # ResponseHandler is driven directly below
        # Every request carries the engines' key (vLLM's --api-key) when there is one.
        self._extra_head = (f"Authorization: Bearer {engine_api_key}\r\n".encode("ascii")
                            if engine_api_key else b"")
        self.connect_timeout_s = connect_timeout_s
        # The longest an engine may go without sending a byte (aiohttp's sock_read).
        self.request_timeout_s = request_timeout_s
        self._endpoints: dict[str, _Endpoint] = {}

    def _endpoint(self, base_url: str) -> _Endpoint:
        """Engines are addressed as ``http://host:port``; anything else is a config
        error, raised as ``ValueError``."""
        endpoint = self._endpoints.get(base_url)
        if endpoint is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError(f"upstream URL must be http://host:port, got {base_url!r}")
            endpoint = self._endpoints[base_url] = _Endpoint(parts.hostname, parts.port or 80,
                                                             self._extra_head)
        return endpoint

    def check_url(self, base_url: str) -> None:
        self._endpoint(base_url)

    async def _connect(self, endpoint: _Endpoint) -> ResponseHandler:
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), endpoint.host,
                                       endpoint.port),
                self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamConnectError(
                f"http://{endpoint.host}:{endpoint.port}: {exc!r}") from exc
        # Once per connection: the response parser it makes reads one response after
        # another (llhttp starts over after each), and a connection goes back to the
        # pool only after a whole response, so each request need not make a new one.
        protocol.set_response_params(read_timeout=self.request_timeout_s,
                                     auto_decompress=False)
        return protocol

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: dict[str, str] | None = None) -> UpstreamResponse:
        """POST ``body`` (JSON) and wait for the status line and headers."""
        endpoint = self._endpoint(base_url)
        head = [b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\n", endpoint.head]
        for name, value in (headers or {}).items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} has a line break")
            # aiohttp's server decodes header bytes as UTF-8 with surrogateescape;
            # this gives a relayed value back its bytes.
            head.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        request = b"".join(head) + body
        # A kept-alive connection can be stale: the engine closed it meanwhile
        # (ServerDisconnectedError), or reset it (ECONNRESET).  The reset is what an
        # engine back from a stall (SIGSTOP, a long pause) does: uvicorn runs its
        # overdue keep-alive timers before it reads the requests that arrived
        # meanwhile, and closing a socket with unread bytes resets it.  Either way no
        # answer began, so the request is sent once more, on a new connection.
        fresh = False
        while True:
            protocol = None if fresh else endpoint.take()
            reused = protocol is not None
            if protocol is None:
                protocol = await self._connect(endpoint)
            try:
                protocol.transport.write(request)
                protocol.start_timeout()
                message, payload = await protocol.read()
            except aiohttp.ServerTimeoutError as exc:
                protocol.close()
                raise asyncio.TimeoutError(str(exc)) from exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    ConnectionError) as exc:
                protocol.close()
                if reused:
                    fresh = True
                    continue
                raise UpstreamConnectError(f"{base_url}{path}: {exc!r}") from exc
            except (aiohttp.ClientConnectionError, OSError, HttpProcessingError) as exc:
                # Refused or reset before an answer began, or an answer aiohttp's parser
                # refused: this engine gave no usable answer.
                protocol.close()
                raise UpstreamConnectError(f"{base_url}{path}: {exc!r}") from exc
            except BaseException:
                protocol.close()   # cancelled mid-request: the connection is spent
                raise
            return UpstreamResponse(message, payload, protocol, endpoint)

    async def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.close()
        self._endpoints.clear()
