#!/usr/bin/env python3
"""A conversation-keyed P/D proxy for stock bidirectional NixlConnector engines.

The design of vLLM's multi-turn P/D example: the proxy keeps, per conversation id
(``X-Session-ID``), the ``kv_transfer_params`` D returned at the end of the previous
turn, and hands them to P with the next turn, so P pulls the conversation's KV from
D instead of recomputing it.  Nothing checks that the new prompt still matches the
tokens D's blocks hold (vLLM #43094); the agent benchmark counts what that costs.

Per request: P with ``max_tokens=1``, ``stream=false`` and either fresh prefill
parameters or the conversation's stored D handle; then D, non-streaming, because
vLLM 0.32.0 returns D's handle only on non-streaming responses.  A streaming client
gets D's whole answer as one SSE chunk (so its TTFT is the request's whole latency),
then a usage chunk and ``[DONE]``.  Round robin over P and over D.

    python benchmarks/conversation_proxy.py --port 31080 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import itertools
import json

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

SESSION_HEADER = "X-Session-ID"
FRESH = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}

HTTP = web.AppKey("http", ClientSession)
HANDLES = web.AppKey("handles", dict)
COUNTS = web.AppKey("counts", dict)


def create_app(prefill: list[str], decode: list[str]) -> web.Application:
    app = web.Application()
    app[HANDLES] = {}
    app[COUNTS] = {"requests": 0, "handles_sent": 0, "handles_stored": 0}
    p_rr, d_rr = itertools.cycle(prefill), itertools.cycle(decode)

    async def http_ctx(app: web.Application):
        app[HTTP] = ClientSession(connector=TCPConnector(limit=0),
                                  timeout=ClientTimeout(total=900))
        yield
        await app[HTTP].close()

    app.cleanup_ctx.append(http_ctx)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sid = request.headers.get(SESSION_HEADER)
        http = request.app[HTTP]
        counts = request.app[COUNTS]
        counts["requests"] += 1
        handle = request.app[HANDLES].pop(sid, None) if sid else None
        p_body = dict(body, stream=False, max_tokens=1)
        p_body.pop("stream_options", None)
        p_body["kv_transfer_params"] = dict(handle) if handle else dict(FRESH)
        if handle:
            counts["handles_sent"] += 1
            p_body["kv_transfer_params"]["do_remote_decode"] = True
        async with http.post(next(p_rr) + "/v1/completions", json=p_body) as resp:
            if resp.status != 200:
                return web.Response(status=resp.status, body=await resp.read())
            p_out = await resp.json()
        stream = bool(body.get("stream"))
        d_body = dict(body, stream=False)
        d_body.pop("stream_options", None)
        d_body["kv_transfer_params"] = p_out.get("kv_transfer_params") or {}
        async with http.post(next(d_rr) + "/v1/completions", json=d_body) as resp:
            if resp.status != 200:
                return web.Response(status=resp.status, body=await resp.read())
            d_out = await resp.json()
        params = d_out.get("kv_transfer_params")
        if sid and params and params.get("remote_block_ids"):
            request.app[HANDLES][sid] = params
            counts["handles_stored"] += 1
        d_out.pop("kv_transfer_params", None)
        if not stream:
            return web.json_response(d_out)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        usage = d_out.pop("usage", None)
        await out.write(b"data: " + json.dumps(d_out).encode() + b"\n\n")
        if usage is not None:
            await out.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                            + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(request.app[COUNTS])

    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", action="append", required=True, metavar="URL")
    p.add_argument("--decode", action="append", required=True, metavar="URL")
    args = p.parse_args(argv)
    web.run_app(create_app(args.prefill, args.decode), host=args.host, port=args.port,
                print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
