"""The proxy process's front door against hostile HTTP: an oversized request line,
oversized and too many headers, oversized bodies (declared and chunked), a head sent
too slowly, and a request that declares both ``Content-Length`` and
``Transfer-Encoding``.  Each gets a 4xx or a closed connection, the proxy's memory
stays bounded, and the next request is served.

The proxy runs as its own process (``python -m sessionkv_proxy``) with one decode
engine that does not exist: none of these requests may reach an engine, and
``/v1/models`` shows that a well-formed request still gets routed (502: no engine).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import psutil
import pytest

HEADER_TIMEOUT_S = 1.0
MAX_BODY = 1024 * 1024


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, free_port):
    port, dead_engine = free_port(), free_port()
    config = tmp_path_factory.mktemp("front") / "proxy.json"
    config.write_text(json.dumps({
        "engines": [{"url": f"http://127.0.0.1:{dead_engine}", "role": "decode"}],
        "max_body_bytes": MAX_BODY,
        "front": {"header_timeout_s": HEADER_TIMEOUT_S},
        "metrics_scrape_interval_s": 60.0}))
    # Its log to a file: a pipe nobody reads fills and blocks the proxy's event loop.
    log = config.with_name("proxy.log")
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sessionkv_proxy", "--port", str(port),
                                 "--config", str(config), "--tokenizer", "none"],
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "proxy did not listen"
            time.sleep(0.1)
    yield port, psutil.Process(proc.pid)
    proc.terminate()
    proc.wait(timeout=10)


def _exchange(port: int, data: bytes, read_timeout: float = 10.0) -> bytes:
    """Send ``data`` (stopping quietly if the proxy closes first), then read until
    the proxy closes or ``read_timeout`` passes; return what came back."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(read_timeout)
    try:
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view[:1 << 20])
            except (BrokenPipeError, ConnectionResetError):
                break
            view = view[sent:]
        out = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        sock.close()


def _status(raw: bytes) -> int | None:
    """The first status code in ``raw``, or None for a connection closed unanswered."""
    if not raw.startswith(b"HTTP/1."):
        return None
    return int(raw.split(b" ", 2)[1])


def _served(port: int) -> None:
    """A well-formed request still gets through the front door to routing."""
    raw = _exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    # Routed: the only engine does not exist (503 while known down, 502 on trying).
    assert _status(raw) in (502, 503), raw[:300]


def _refused(raw: bytes, *statuses: int) -> None:
    status = _status(raw)
    assert status is None or status in statuses, raw[:300]


def test_an_oversized_request_line_is_refused(proxy):
    port, _ = proxy
    raw = _exchange(port, b"GET /v1/models?" + b"a" * (1 << 20) + b" HTTP/1.1\r\n\r\n")
    _refused(raw, 400, 414)
    _served(port)


def test_an_oversized_header_field_is_refused(proxy):
    port, _ = proxy
    raw = _exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: "
                    + b"b" * (64 * 1024) + b"\r\n\r\n")
    _refused(raw, 400, 431)
    _served(port)


def test_too_many_headers_are_refused(proxy):
    port, _ = proxy
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(20_000))
    raw = _exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    _refused(raw, 400, 431)
    _served(port)


def test_an_oversized_declared_body_gets_413(proxy):
    port, _ = proxy
    body = b"x" * (MAX_BODY + 1)
    raw = _exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert _status(raw) == 413, raw[:300]
    _served(port)


def test_an_oversized_chunked_body_gets_413(proxy):
    port, _ = proxy
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"z" * 64 * 1024)
    raw = _exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n" + chunk * 20 + b"0\r\n\r\n")
    assert _status(raw) == 413, raw[:300]
    _served(port)


def test_a_head_sent_too_slowly_is_cut_off(proxy):
    port, _ = proxy
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(HEADER_TIMEOUT_S * 10)
    started = time.monotonic()
    try:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        closed_at = None
        for i in range(100):   # one header line every 0.2 s: never a complete head
            try:
                sock.sendall(b"X-Slow-%d: v\r\n" % i)
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(65536) == b"":
                    closed_at = time.monotonic()
                    break
            except socket.timeout:
                pass
            except ConnectionResetError:
                closed_at = time.monotonic()
                break
    finally:
        sock.close()
    assert closed_at is not None, "the proxy kept a 20 s trickle of headers open"
    assert closed_at - started < HEADER_TIMEOUT_S * 5
    _served(port)


def test_content_length_with_transfer_encoding_is_refused(proxy):
    port, _ = proxy
    raw = _exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    _refused(raw, 400)
    _served(port)


def test_memory_stays_bounded_under_oversized_requests(proxy):
    """A 64 MiB request line and 20,000 header lines, ten times each: the proxy
    refuses them at the parser's limits instead of holding them."""
    port, process = proxy
    before = process.memory_info().rss
    for _ in range(10):
        _exchange(port, b"GET /?" + b"a" * (64 << 20) + b" HTTP/1.1\r\n\r\n")
        headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 4000) for i in range(20_000))
        _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    grown = process.memory_info().rss - before
    assert grown < 32 << 20, f"the proxy grew by {grown / 2**20:.0f} MiB"
    _served(port)
