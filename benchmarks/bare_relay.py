#!/usr/bin/env python3
"""The floor for a relay built the way the proxy is: bytes in, bytes to one backend,
bytes back, and nothing else.

``router_bench.py`` runs it beside the routers as the "bare relay" arm, so the CPU a
router spends per request can be read against what any proxy on the same parts pays
just to relay a request over two sockets: uvloop, aiohttp's low-level server (its
llhttp parser) and the proxy's upstream pool (aiohttp's client protocol).  It does
no validation, no routing, no metrics; it is not a router and is never a candidate
for one.

    python benchmarks/bare_relay.py --port 30200 --backend http://127.0.0.1:30100
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop
from aiohttp import web, web_server

from sessionkv_proxy.upstream import UpstreamPool

async def _serve(port: int, backend: str) -> None:
    pool = UpstreamPool()

    async def relay(request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response(body=b"ok")
        resp = await pool.post(backend, request.path, await request.read())
        return web.Response(status=resp.status, body=await resp.read(),
                            content_type="application/json")

    server = await asyncio.get_running_loop().create_server(
        web_server.Server(relay), "127.0.0.1", port)
    try:
        await server.serve_forever()
    finally:
        await pool.close()

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", required=True, help="http://host:port")
    args = p.parse_args()
    uvloop.run(_serve(args.port, args.backend))

if __name__ == "__main__":
    main()
