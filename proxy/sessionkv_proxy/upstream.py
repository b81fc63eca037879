"""The request hot path's HTTP client: one ``aiohttp.ClientSession`` with keep-alive
connections to every engine.

The proxy sends two kinds of request upstream: a JSON body to an engine of its own
pools, answered either as one JSON body or as a server-sent event stream.
:meth:`UpstreamPool.post` returns once the status and headers are in; the body is then
read whole or relayed chunk by chunk as it arrives (the bytes untouched: no
decompression, no cookies, no redirects).

A connection goes back to the pool only after a complete response; anything else
(error, timeout, a reader that stopped early) closes it, so a half-read response can
never leak into the next request.  Failures are sorted for the caller:
:class:`UpstreamConnectError` when the request never reached the engine (safe to
retry on another worker), ``asyncio.TimeoutError`` when the engine went silent for
``request_timeout_s``, ``ConnectionResetError`` when a body broke off.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp

__all__ = ["UpstreamConnectError", "UpstreamPool", "UpstreamResponse"]

# vLLM's API server (uvicorn) closes a keep-alive connection after 5 s idle; closing
# ours first keeps a request from landing on a connection the engine is closing.
_IDLE_KEEPALIVE_S = 4.0


class UpstreamConnectError(ConnectionError):
    """The request never reached the engine (refused, reset before the response
    started, or connect timeout): safe to retry on another worker."""


class UpstreamResponse:
    """Status and headers at once; the body read whole or streamed, exactly once."""

    __slots__ = ("status", "_resp", "_released")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self._released = False
        self.status = resp.status

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """As the engine sent them: relayed without decoding."""
        return list(self._resp.raw_headers)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as the engine chunked it: one server-sent event per chunk from
        vLLM.  Not ``iter_any``, which hands over all that is buffered at once: a
        stream read late (D ran ahead while the proxy waited for P) then went to the
        client in one write, and a client that had left was not noticed."""
        try:
            async for chunk, _ in self._resp.content.iter_chunks():
                if chunk:
                    yield chunk
        except aiohttp.ClientPayloadError as exc:
            raise ConnectionResetError(f"engine stream broke: {exc!r}") from exc
        except aiohttp.ServerTimeoutError as exc:
            raise asyncio.TimeoutError(str(exc)) from exc
        finally:
            self.release()

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except aiohttp.ClientPayloadError as exc:
            raise ConnectionResetError(f"engine answer broke: {exc!r}") from exc
        except aiohttp.ServerTimeoutError as exc:
            raise asyncio.TimeoutError(str(exc)) from exc
        finally:
            self.release()

    def release(self) -> None:
        """Return the connection to the pool if the response was read to its end,
        close it otherwise."""
        if self._released:
            return
        self._released = True
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class UpstreamPool:
    """Keep-alive connections to the engines, created on demand."""

    def __init__(self, connect_timeout_s: float = 5.0, request_timeout_s: float = 600.0
                 ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._checked: set[str] = set()

    def _client(self) -> aiohttp.ClientSession:
        # Built on first use, inside the running loop that serves the proxy.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_IDLE_KEEPALIVE_S,
                                               ttl_dns_cache=300),
                # sock_read: the longest an engine may go without sending a byte.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                              connect=self.connect_timeout_s,
                                              sock_read=self.request_timeout_s),
                auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return self._session

    def check_url(self, base_url: str) -> None:
        """Engines are addressed as ``http://host:port``; anything else is a config
        error, raised as ``ValueError``."""
        if base_url in self._checked:
            return
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream URL must be http://host:port, got {base_url!r}")
        self._checked.add(base_url)

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: dict[str, str] | None = None) -> UpstreamResponse:
        """POST ``body`` (JSON) and wait for the status line and headers."""
        self.check_url(base_url)
        sent = {"Content-Type": "application/json", **(headers or {})}
        # A keep-alive connection the engine closed meanwhile fails before any answer
        # (ServerDisconnectedError): that request never ran, so it is sent once more.
        for last_try in (False, True):
            try:
                resp = await self._client().post(base_url + path, data=body, headers=sent,
                                                 allow_redirects=False)
            except aiohttp.ServerDisconnectedError as exc:
                if last_try:
                    raise UpstreamConnectError(f"{base_url}{path}: {exc!r}") from exc
                continue
            except aiohttp.ServerTimeoutError as exc:
                if isinstance(exc, aiohttp.ConnectionTimeoutError):
                    raise UpstreamConnectError(f"{base_url}{path}: {exc!r}") from exc
                raise asyncio.TimeoutError(str(exc)) from exc
            except (aiohttp.ClientConnectionError, OSError) as exc:
                raise UpstreamConnectError(f"{base_url}{path}: {exc!r}") from exc
            return UpstreamResponse(resp)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
