"""The proxy's HTTP/1.1 server on real sockets: what clients send it (keep-alive,
pipelining, chunked bodies, ``Expect: 100-continue``, HTTP/1.0, garbage, oversized
bodies) and how it answers (whole, streamed with chunked encoding and back-pressure,
errors in the OpenAI body shape), client disconnects, idle timeouts and a graceful
stop that lets in-flight requests finish."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from sessionkv_proxy.errors import ApiError, error_response
from sessionkv_proxy.server import HttpServer, Request, Response

LIMIT = 64 * 1024


class App:
    """Routes that exercise each way of answering, and what they observed."""

    def __init__(self) -> None:
        self.stream_error: BaseException | None = None
        self.stream_done = asyncio.Event()
        self.slow_started = asyncio.Event()
        self.written = 0    # chunks the stream handler's writes have returned from

    async def echo(self, request: Request) -> Response:
        out = {"path": request.path, "query": request.query, "len": len(request.body),
               "body": request.body.decode("latin-1"),
               "session": request.headers.get("x-session-id")}
        return Response(200, json.dumps(out).encode(), [("X-Seen", "yes")])

    async def stream(self, request: Request) -> None:
        n = int(request.query.split("=")[1]) if request.query else 5
        size = int(request.headers.get("x-chunk-bytes", "10"))
        await request.start_stream(200, [("Content-Type", "text/event-stream")])
        try:
            for i in range(n):
                await request.write(f"data: {i:06d} ".encode() + b"x" * size + b"\n\n")
                self.written += 1
                await asyncio.sleep(0)
        except ConnectionResetError as exc:
            self.stream_error = exc
            raise
        finally:
            self.stream_done.set()
        await request.end_stream()

    async def slow(self, request: Request) -> Response:
        self.slow_started.set()
        await asyncio.sleep(1.0)
        return Response(200, b'{"late":true}')

    async def boom(self, request: Request) -> Response:
        raise RuntimeError("handler bug")

    async def refuse(self, request: Request) -> Response:
        return error_response(ApiError(400, "bad thing", param="x"))


def _error(status: int, message: str) -> Response:
    return error_response(ApiError(status, message))


@pytest.fixture
async def served(free_port):
    app = App()
    server = HttpServer({"/echo": {"POST": app.echo, "GET": app.echo},
                         "/stream": {"POST": app.stream, "GET": app.stream},
                         "/slow": {"GET": app.slow},
                         "/boom": {"GET": app.boom},
                         "/refuse": {"GET": app.refuse}},
                        error_response=_error, max_body_bytes=LIMIT,
                        keepalive_timeout_s=1.0)
    port = free_port()
    await server.start("127.0.0.1", port)
    yield server, app, port
    await server.stop(1.0)


async def _raw(port: int, data: bytes, read_until_close: bool = True,
               timeout: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        if read_until_close:
            return await asyncio.wait_for(reader.read(), timeout)
        return await asyncio.wait_for(reader.read(65536), timeout)
    finally:
        writer.close()


def _assert_error_body(body: bytes, status_line: bytes, raw: bytes) -> dict:
    assert raw.startswith(status_line), raw[:200]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def _split(raw: bytes) -> tuple[bytes, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, body


# --------------------------------------------------------------------------- requests
async def test_keep_alive_reuses_one_connection_for_many_requests(served):
    _, _, port = served
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(20):
            async with session.post(f"http://127.0.0.1:{port}/echo?i={i}",
                                    data=b"x" * i, headers={"X-Session-ID": "s1"}) as resp:
                assert resp.status == 200
                assert resp.headers["X-Seen"] == "yes"
                assert resp.headers["Content-Type"] == "application/json"
                out = await resp.json()
                assert out == {"path": "/echo", "query": f"i={i}", "len": i,
                               "body": "x" * i, "session": "s1"}
        assert len(connector._conns) == 1   # every request went over the one connection


async def test_pipelined_requests_are_answered_in_order(served):
    _, _, port = served
    reqs = b"".join(b"POST /echo?n=%d HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                    % (i, i, b"y" * i) for i in range(1, 6))
    reqs += b"GET /echo?n=last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    raw = await _raw(port, reqs)
    queries = [json.loads(part.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1")[0])["query"]
               for part in raw.split(b"HTTP/1.1 200 OK")[1:]]
    assert queries == [f"n={i}" for i in range(1, 6)] + ["n=last"]


async def test_chunked_request_body_is_decoded(served):
    _, _, port = served
    raw = await _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                           b"Connection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    head, body = _split(raw)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(body)["body"] == "hello world"


async def test_expect_100_continue_is_answered_before_the_body(served):
    _, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                 b"Expect: 100-continue\r\n\r\n")
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"abcd")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200"), head
    writer.close()


async def test_http_1_0_request_gets_an_answer_and_a_close(served):
    _, _, port = served
    raw = await _raw(port, b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi")
    head, body = _split(raw)
    assert head.startswith(b"HTTP/1.0 200"), head
    # _raw read to the end: the server closed (HTTP/1.0 closes unless kept alive).
    assert b"keep-alive" not in head.lower()
    assert json.loads(body)["body"] == "hi"


# --------------------------------------------------------------------------- refusals
async def test_declared_oversized_body_gets_413_without_reading_it(served):
    _, _, port = served
    raw = await _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                     % (LIMIT + 1))
    head, body = _split(raw)
    err = _assert_error_body(body, b"HTTP/1.1 413", raw)
    assert str(LIMIT) in err["message"]
    assert b"Connection: close" in head


async def test_chunked_body_growing_past_the_limit_gets_413(served):
    _, _, port = served
    chunk = b"%x\r\n%s\r\n" % (16 * 1024, b"z" * 16 * 1024)
    raw = await _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                           b"\r\n" + chunk * 5 + b"0\r\n\r\n")
    _, body = _split(raw)
    _assert_error_body(body, b"HTTP/1.1 413", raw)


async def test_chunked_body_over_the_limit_that_arrives_whole_gets_413(served):
    """Sent in one write, the whole body is buffered before the handler starts: the
    server takes it without its read loop, and must still count it."""
    _, _, port = served
    chunk = b"%x\r\n%s\r\n" % (LIMIT // 2 + 1, b"z" * (LIMIT // 2 + 1))
    raw = await _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                           b"\r\n" + chunk * 2 + b"0\r\n\r\n")
    _, body = _split(raw)
    _assert_error_body(body, b"HTTP/1.1 413", raw)


async def test_oversized_body_from_a_real_client_reads_413(served):
    """The client is still sending when the 413 goes out; it must still read it."""
    _, _, port = served
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/echo",
                                data=b"q" * (LIMIT * 4)) as resp:
            assert resp.status == 413
            assert "error" in await resp.json()


async def test_malformed_request_gets_400_and_a_close(served):
    _, _, port = served
    raw = await _raw(port, b"NOT-HTTP garbage\r\n\r\n")
    _, body = _split(raw)
    # No version could be read, so the answer is in HTTP/1.0; _raw read to the close.
    _assert_error_body(body, b"HTTP/1.0 400", raw)


async def test_unknown_path_and_method_get_404_and_405(served):
    _, _, port = served
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/nope") as resp:
            assert resp.status == 404
            assert "/nope" in (await resp.json())["error"]["message"]
        async with session.delete(f"http://127.0.0.1:{port}/echo") as resp:
            assert resp.status == 405
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
        # The connection stays usable after both.
        async with session.get(f"http://127.0.0.1:{port}/refuse") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "x"


async def test_handler_exception_gets_500_and_the_server_keeps_serving(served):
    _, _, port = served
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/boom") as resp:
            assert resp.status == 500
            assert (await resp.json())["error"]["type"] == "server_error"
        async with session.get(f"http://127.0.0.1:{port}/echo") as resp:
            assert resp.status == 200


# --------------------------------------------------------------------------- streaming
async def test_stream_arrives_whole_and_in_order_with_chunked_encoding(served):
    _, _, port = served
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/stream?n=200") as resp:
            assert resp.status == 200
            assert resp.headers["Transfer-Encoding"] == "chunked"
            assert resp.headers["Content-Type"] == "text/event-stream"
            data = await resp.read()
        # The connection is reusable after the terminating chunk.
        async with session.get(f"http://127.0.0.1:{port}/echo") as resp:
            assert resp.status == 200
    events = [e for e in data.split(b"\n\n") if e]
    assert [int(e.split()[1]) for e in events] == list(range(200))


async def test_stream_to_http_1_0_client_is_unchunked_and_closed(served):
    _, _, port = served
    raw = await _raw(port, b"GET /stream?n=3 HTTP/1.0\r\n\r\n")
    head, body = _split(raw)
    # Unchunked, and ended by the close _raw read to.
    assert b"Transfer-Encoding" not in head and b"keep-alive" not in head.lower()
    assert body.count(b"data: ") == 3


async def test_slow_reader_applies_back_pressure_and_loses_nothing(served):
    """~16 MB streamed to a reader that pauses: the handler waits in write() instead
    of buffering without bound, and every byte arrives in order."""
    _, app, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2 ** 20)
    writer.write(b"GET /stream?n=2000 HTTP/1.1\r\nHost: x\r\nX-Chunk-Bytes: 8000\r\n"
                 b"Connection: close\r\n\r\n")
    # The server fills the socket buffers and must wait: its count of chunks past
    # write() starts, then stops growing (waited for, not slept: a loaded machine).
    deadline = asyncio.get_running_loop().time() + 30
    last = -1
    while app.written == 0 or app.written != last:
        assert asyncio.get_running_loop().time() < deadline, app.written
        last = app.written
        await asyncio.sleep(0.3)
    # Not read: what the handler got past write() is what the socket buffers hold,
    # a few MB at most, not the 16 MB it has to send.
    assert 0 < app.written < 1000, app.written
    data = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    _, body = _split(data)
    numbers, rest = [], body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        numbers.append(int(rest[:size].split()[1]))
        rest = rest[size + 2:]
    assert numbers == list(range(2000))


async def test_client_leaving_mid_stream_stops_the_handler(served):
    _, app, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /stream?n=100000 HTTP/1.1\r\nHost: x\r\nX-Chunk-Bytes: 1000\r\n\r\n")
    await reader.readuntil(b"data: ")
    writer.transport.abort()
    await asyncio.wait_for(app.stream_done.wait(), 10)
    assert isinstance(app.stream_error, ConnectionResetError)


# --------------------------------------------------------------------------- lifecycle
async def test_idle_keep_alive_connection_is_closed_after_the_timeout(served):
    _, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    # keepalive_timeout_s is 1 s; the sweep runs every 0.5 s.
    rest = await asyncio.wait_for(reader.read(), 5)
    assert rest.startswith(b'{"path"'), rest
    assert reader.at_eof()
    writer.close()


async def test_stop_lets_in_flight_requests_finish_and_refuses_new_ones(served):
    server, app, port = served
    async with aiohttp.ClientSession() as session:
        pending = asyncio.ensure_future(session.get(f"http://127.0.0.1:{port}/slow"))
        await asyncio.wait_for(app.slow_started.wait(), 5)
        stopping = asyncio.ensure_future(server.stop(10.0))
        deadline = time.monotonic() + 5
        while True:   # until the listening socket is closed
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                break
            writer.close()
            assert time.monotonic() < deadline, "the server kept accepting connections"
            await asyncio.sleep(0.01)
        resp = await asyncio.wait_for(pending, 10)
        assert resp.status == 200 and await resp.json() == {"late": True}
        await asyncio.wait_for(stopping, 10)
