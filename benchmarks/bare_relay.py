#!/usr/bin/env python3
"""The floor for a Python relay on this machine: bytes in, bytes to one backend, bytes
back, and nothing else.

``router_bench.py`` runs it beside the routers as the "bare relay" arm, so the CPU a
router spends per request can be read against what any Python proxy on the same
event loop (uvloop), parser (httptools) and pooled upstream client pays just to relay
a request over two sockets.  It does no validation, no routing, no metrics; it is not
a router and is never a candidate for one.

    python benchmarks/bare_relay.py --port 30200 --backend http://127.0.0.1:30100
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import uvloop

from sessionkv_proxy.upstream import UpstreamPool


class _Relay(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool, backend: str) -> None:
        self.pool, self.backend = pool, backend
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.url, self.body = b"", []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.loop.create_task(self._relay(self.url.decode(), b"".join(self.body)))

    async def _relay(self, path: str, body: bytes) -> None:
        if path == "/health":
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            return
        resp = await self.pool.post(self.backend, path, body)
        data = await resp.read()
        self.transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%b" % (resp.status, len(data), data))


async def _serve(port: int, backend: str) -> None:
    pool = UpstreamPool()
    server = await asyncio.get_running_loop().create_server(
        lambda: _Relay(pool, backend), "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", required=True, help="http://host:port")
    args = p.parse_args()
    uvloop.run(_serve(args.port, args.backend))


if __name__ == "__main__":
    main()
