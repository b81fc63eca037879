"""The hot-path HTTP client (aiohttp) against a real aiohttp server: bodies whole and streamed,
keep-alive reuse, engines that drop idle connections, refused and slow engines."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

import pytest
from aiohttp import web

from sessionkv_proxy.upstream import UpstreamConnectError, UpstreamPool


class Engine:
    """A stand-in engine that records what it was sent."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes, str | None]] = []
        self.client_ports: list[int] = []   # the proxy's side of each request's connection

    async def start(self, port: int, keepalive_timeout: float = 75.0) -> str:
        async def echo(request: web.Request):
            body = await request.read()
            self.seen.append((request.path, body, request.headers.get("X-Request-Id")))
            self.client_ports.append(request.transport.get_extra_info("peername")[1])
            return web.Response(body=b'{"echo":' + body + b"}", content_type="application/json",
                                headers={"X-Engine": "stub"})

        async def stream(request: web.Request):
            await request.read()
            self.client_ports.append(request.transport.get_extra_info("peername")[1])
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(5):
                await resp.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        async def slow(request: web.Request):
            self.client_ports.append(request.transport.get_extra_info("peername")[1])
            await asyncio.sleep(2.0)
            return web.Response(text="late")

        async def error(request: web.Request):
            return web.Response(status=400, body=b'{"error":"bad"}',
                                content_type="application/json")

        app = web.Application()
        app.router.add_post("/echo", echo)
        app.router.add_post("/stream", stream)
        app.router.add_post("/slow", slow)
        app.router.add_post("/error", error)

        self.runner = web.AppRunner(app, keepalive_timeout=keepalive_timeout)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        await self.runner.cleanup()


def _run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def _engine_and_pool(port: int, keepalive_timeout: float = 75.0, **pool_kw):
    engine = Engine()
    url = await engine.start(port, keepalive_timeout)
    pool = UpstreamPool(**pool_kw)
    try:
        yield engine, url, pool
    finally:
        await pool.close()
        await engine.stop()


def test_json_body_keep_alive_and_headers(free_port):
    async def main():
        async with _engine_and_pool(free_port()) as (engine, url, pool):
            for i in range(3):
                resp = await pool.post(url, "/echo", b'{"i":%d}' % i, {"X-Request-Id": f"r{i}"})
                assert resp.status == 200
                assert resp.headers.get("x-engine") == "stub"
                assert await resp.read() == b'{"echo":{"i":%d}}' % i
            # One connection served all three.
            assert len(set(engine.client_ports)) == 1, engine.client_ports
            assert [s[2] for s in engine.seen] == ["r0", "r1", "r2"]

    _run(main())


def test_stream_arrives_in_pieces_and_connection_is_reused(free_port):
    async def main():
        async with _engine_and_pool(free_port()) as (engine, url, pool):
            resp = await pool.post(url, "/stream", b"{}")
            pieces = [chunk async for chunk in resp.iter_chunks()]
            assert b"".join(pieces) == b"".join(f"data: {i}\n\n".encode() for i in range(5)) \
                + b"data: [DONE]\n\n"
            assert len(pieces) > 1  # relayed as it came, not buffered to the end
            resp = await pool.post(url, "/echo", b"1")
            assert await resp.read() == b'{"echo":1}'
            # The stream's connection, read to its end, served the next request.
            assert len(set(engine.client_ports)) == 1, engine.client_ports

    _run(main())


def test_abandoned_stream_closes_its_connection(free_port):
    async def main():
        async with _engine_and_pool(free_port()) as (engine, url, pool):
            resp = await pool.post(url, "/stream", b"{}")
            agen = resp.iter_chunks()
            await agen.__anext__()
            await agen.aclose()  # a client that went away mid-stream
            resp = await pool.post(url, "/echo", b"2")
            assert await resp.read() == b'{"echo":2}'
            # The half-read stream's connection was closed, not reused.
            assert len(set(engine.client_ports)) == 2, engine.client_ports

    _run(main())


def test_error_status_is_returned_not_raised(free_port):
    async def main():
        async with _engine_and_pool(free_port()) as (engine, url, pool):
            resp = await pool.post(url, "/error", b"{}")
            return resp.status, await resp.read()

    assert _run(main()) == (400, b'{"error":"bad"}')


def test_engine_closing_idle_connections_is_retried_on_a_new_one(free_port):
    async def main():
        async with _engine_and_pool(free_port(), keepalive_timeout=0.2) as (_, url, pool):
            assert await (await pool.post(url, "/echo", b"1")).read() == b'{"echo":1}'
            await asyncio.sleep(0.6)  # the engine closes the idle keep-alive connection
            assert await (await pool.post(url, "/echo", b"2")).read() == b'{"echo":2}'

    _run(main())


def test_refused_connection_raises_connect_error(free_port):
    async def main():
        pool = UpstreamPool(connect_timeout_s=1.0)
        try:
            with pytest.raises(UpstreamConnectError):
                await pool.post(f"http://127.0.0.1:{free_port()}", "/echo", b"{}")
        finally:
            await pool.close()

    _run(main())


def test_slow_engine_times_out_and_its_connection_is_dropped(free_port):
    async def main():
        async with _engine_and_pool(free_port(), request_timeout_s=0.3) as (engine, url, pool):
            with pytest.raises(asyncio.TimeoutError):
                await pool.post(url, "/slow", b"{}")
            assert await (await pool.post(url, "/echo", b"3")).read() == b'{"echo":3}'
            # The timed-out connection was dropped: the next request came on another.
            assert len(set(engine.client_ports)) == 2, engine.client_ports

    _run(main())


def test_only_plain_http_urls():
    with pytest.raises(ValueError, match="http://host:port"):
        UpstreamPool().check_url("https://example.com")


@contextlib.asynccontextmanager
async def _raw_engine(port: int, answer, **pool_kw):
    """An engine written on raw sockets, and a pool to it: ``answer(request_bytes,
    writer)`` decides what it sends back on each connection (malformed heads, early
    closes, broken bodies)."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        connections.append(writer.get_extra_info("peername")[1])
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                if not await answer(head, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    pool = UpstreamPool(**{"connect_timeout_s": 1.0, **pool_kw})
    try:
        yield f"http://127.0.0.1:{port}", connections, pool
    finally:
        await pool.close()
        server.close()
        await server.wait_closed()


def test_malformed_answer_is_a_connect_error_and_the_next_request_is_served(free_port):
    calls = []

    async def answer(head, writer):
        calls.append(head)
        if len(calls) == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nBad Header Line\r\n\r\nok")
            return False
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    async def main():
        async with _raw_engine(free_port(), answer) as (url, connections, pool):
            with pytest.raises(UpstreamConnectError):
                await pool.post(url, "/x", b"{}")
            assert await (await pool.post(url, "/x", b"{}")).read() == b"ok"
            assert len(connections) == 2

    _run(main())


def test_a_new_connection_closed_without_an_answer_is_not_retried(free_port):
    calls = []

    async def answer(head, writer):
        calls.append(head)
        return False   # read the request, close without a word

    async def main():
        async with _raw_engine(free_port(), answer) as (url, _, pool):
            with pytest.raises(UpstreamConnectError):
                await pool.post(url, "/x", b"{}")
        # Sent once: only a kept-alive connection's silent close is retried (that
        # request may have never reached the engine; this one did).
        assert len(calls) == 1

    _run(main())


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the peer sees ECONNRESET, not a clean close."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
    writer.transport.abort()


def test_a_kept_alive_connection_reset_is_sent_again_once_on_a_new_one(free_port):
    """What an engine back from a stall does to the connections that were idle when
    it stopped (uvicorn's overdue keep-alive timers close them with the request
    unread): the request never ran, so it goes out again on a new connection; a
    second reset, there, is the engine's answer."""
    calls = []

    async def answer(head, writer):
        calls.append(head.split(b" ", 2)[1])
        if len(calls) == 1 or b"/ok" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            return True
        _reset(writer)
        return False

    async def main():
        async with _raw_engine(free_port(), answer) as (url, connections, pool):
            assert await (await pool.post(url, "/first", b"{}")).read() == b"ok"
            # Kept alive, then reset: sent again on a new connection, reset there too.
            with pytest.raises(UpstreamConnectError, match="reset"):
                await pool.post(url, "/again", b"{}")
            assert calls == [b"/first", b"/again", b"/again"] and len(connections) == 2
            assert await (await pool.post(url, "/ok", b"{}")).read() == b"ok"

    _run(main())


def test_a_reset_kept_alive_connection_is_replaced_and_the_request_served(free_port):
    seen: dict[int, int] = {}

    async def answer(head, writer):
        port = writer.get_extra_info("peername")[1]
        seen[port] = seen.get(port, 0) + 1
        if seen[port] > 1:   # every kept-alive connection is reset on its second request
            _reset(writer)
            return False
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    async def main():
        async with _raw_engine(free_port(), answer) as (url, connections, pool):
            for _ in range(3):
                assert await (await pool.post(url, "/x", b"{}")).read() == b"ok"
            assert len(connections) == 3   # the second and third on new connections

    _run(main())


def test_connection_close_answer_and_idle_connections_are_not_reused(free_port, monkeypatch):
    from sessionkv_proxy import upstream as upstream_mod

    async def answer(head, writer):
        # "Connection: close", yet the socket stays open: only the client's reading
        # of the header keeps it from sending the next request there.
        close = b"/close" in head
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
                     + (b"Connection: close\r\n" if close else b"") + b"\r\nok")
        return True

    async def main():
        async with _raw_engine(free_port(), answer) as (url, connections, pool):
            for path in ("/close", "/a", "/b"):
                assert await (await pool.post(url, path, b"{}")).read() == b"ok"
            assert len(connections) == 2   # /a and /b shared one
            monkeypatch.setattr(upstream_mod, "_IDLE_KEEPALIVE_S", 0.05)
            await asyncio.sleep(0.2)
            assert await (await pool.post(url, "/c", b"{}")).read() == b"ok"
            assert len(connections) == 3   # idle past the keep-alive: a new one

    _run(main())


def test_a_body_cut_off_mid_stream_raises_connection_reset(free_port):
    async def answer(head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"9\r\ndata: 0\n\n\r\n")
        await writer.drain()
        writer.transport.abort()
        return False

    async def main():
        async with _raw_engine(free_port(), answer) as (url, _, pool):
            resp = await pool.post(url, "/x", b"{}")
            got = []
            with pytest.raises(ConnectionResetError):
                async for chunk in resp.iter_chunks():
                    got.append(chunk)
            assert got == [b"data: 0\n\n"]

    _run(main())


def _chunked(gaps_s: list[float], stall_s: float = 0.0):
    """An answer streaming one chunk after each gap, then stalling, then ending."""
    async def answer(head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i, gap_s in enumerate(gaps_s):
            await asyncio.sleep(gap_s)
            writer.write(b"9\r\ndata: %d\n\n\r\n" % i)
            await writer.drain()
        await asyncio.sleep(stall_s)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True
    return answer


def test_the_read_timeout_runs_from_the_last_byte_not_the_request(free_port):
    # Each gap under request_timeout_s, the whole stream well over it.
    async def main():
        async with _raw_engine(free_port(), _chunked([0.12] * 8), request_timeout_s=0.35
                               ) as (url, _, pool):
            resp = await pool.post(url, "/x", b"{}")
            got = [chunk async for chunk in resp.iter_chunks()]
            assert got == [b"data: %d\n\n" % i for i in range(8)]

    _run(main())


def test_a_stream_that_stalls_times_out_a_timeout_after_its_last_byte(free_port):
    async def main():
        async with _raw_engine(free_port(), _chunked([0.0, 0.2], stall_s=3.0),
                               request_timeout_s=0.4) as (url, _, pool):
            chunks = (await pool.post(url, "/x", b"{}")).iter_chunks()
            loop = asyncio.get_running_loop()
            assert await anext(chunks) == b"data: 0\n\n"
            assert await anext(chunks) == b"data: 1\n\n"
            last_byte = loop.time()
            with pytest.raises(asyncio.TimeoutError):
                await anext(chunks)
            assert 0.35 <= loop.time() - last_byte < 1.5

    _run(main())


def test_header_values_with_line_breaks_are_refused(free_port):
    async def main():
        pool = UpstreamPool()
        try:
            with pytest.raises(ValueError, match="line break"):
                await pool.post(f"http://127.0.0.1:{free_port()}", "/x", b"{}",
                                 {"X-Request-Id": "a\r\nX-Evil: 1"})
        finally:
            await pool.close()

    _run(main())
