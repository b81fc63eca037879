#!/usr/bin/env python3
"""The "toy proxy" baseline: what vLLM's own disaggregation examples ship.

Behaviour follows vLLM's ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
(FastAPI + one ``httpx.AsyncClient`` per backend, plain round robin, no load or cache
awareness), so the benchmarks' arms (``sessionkv_bench.arms``: 1-rr, 3-nixl-rr) can compare
against the router most P/D demos use:

* **P/D mode** (``--prefill`` given): send the request to the next P with
  ``max_tokens=1``, ``stream=false``, no ``stream_options``, no ``min_tokens`` and
  ``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false,
  "remote_engine_id": null, ...}``; then send the original request to the next D with
  the ``kv_transfer_params`` P returned, and stream D's bytes back.
* **Co-located mode** (only ``--decode``): round robin over the servers, stream the
  answer back; the same code path minus the P step.

Differences from the upstream file, none of which change the request path: backends
are given as URLs (``--prefill URL --decode URL``, repeatable) instead of host and
port lists; the app is built by a factory instead of from module-level globals;
``/health`` answers besides ``/healthcheck``; no per-request debug log line.

It runs under ``benchmarks/.venv-router`` (fastapi, uvicorn, httpx live there):

    benchmarks/.venv-router/bin/python benchmarks/toy_proxy.py --port 30200 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import itertools
import os
import uuid
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

# What the upstream toy proxy puts on the request to P: "prefill here, a remote D
# will pull the KV".
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                     "remote_engine_id": None, "remote_block_ids": None,
                     "remote_host": None, "remote_port": None}


def _client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=None, base_url=url.rstrip("/") + "/v1",
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=None))


def _headers(request_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}",
            "X-Request-Id": request_id}


def create_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.prefill = [_client(u) for u in prefill_urls]
        app.state.decode = [_client(u) for u in decode_urls]
        app.state.prefill_rr = itertools.cycle(range(len(prefill_urls) or 1))
        app.state.decode_rr = itertools.cycle(range(len(decode_urls)))
        yield
        for client in app.state.prefill + app.state.decode:
            await client.aclose()

    app = FastAPI(lifespan=lifespan)

    async def prefill(client: httpx.AsyncClient, endpoint: str, req_data: dict,
                      request_id: str) -> dict:
        p_data = dict(req_data, kv_transfer_params=dict(PREFILL_KV_PARAMS), stream=False,
                      max_tokens=1)
        if "max_completion_tokens" in p_data:
            p_data["max_completion_tokens"] = 1
        # P answers one token, unstreamed; min tokens are not supported on P (upstream
        # drops them for P and keeps them for D).
        for key in ("stream_options", "min_tokens", "min_completion_tokens"):
            p_data.pop(key, None)
        # post() reads the whole answer (upstream's aread() and aclose() are no-ops here).
        response = await client.post(endpoint, json=p_data, headers=_headers(request_id))
        response.raise_for_status()
        return response.json()

    async def stream_from(client: httpx.AsyncClient, endpoint: str, req_data: dict,
                          request_id: str):
        async with client.stream("POST", endpoint, json=req_data,
                                 headers=_headers(request_id)) as response:
            response.raise_for_status()
            async for chunk in response.aiter_bytes():
                yield chunk

    async def handle(endpoint: str, request: Request) -> StreamingResponse:
        req_data = await request.json()
        request_id = str(uuid.uuid4())
        state = request.app.state
        if state.prefill:
            p_client = state.prefill[next(state.prefill_rr)]
            p_out = await prefill(p_client, endpoint, req_data, request_id)
            kv_transfer_params = p_out.get("kv_transfer_params", {})
            if kv_transfer_params:
                req_data["kv_transfer_params"] = kv_transfer_params
        d_client = state.decode[next(state.decode_rr)]
        # A streamed answer as text/event-stream, as vLLM sends it (upstream's toy proxy
        # says application/json, which SSE clients such as aiperf refuse to parse).
        return StreamingResponse(stream_from(d_client, endpoint, req_data, request_id),
                                 media_type="text/event-stream" if req_data.get("stream")
                                 else "application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle("/chat/completions", request)

    @app.get("/healthcheck")
    @app.get("/health")
    async def healthcheck():
        return {"status": "ok", "prefill_instances": len(prefill_urls),
                "decode_instances": len(decode_urls)}

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="prefill server (repeatable); none = co-located round robin")
    p.add_argument("--decode", action="append", default=[], metavar="URL", required=True,
                   help="decode (or co-located) server, repeatable")
    args = p.parse_args(argv)
    import uvicorn

    # uvicorn's defaults, as upstream runs it (access log on; with uvicorn[standard],
    # which vLLM's fastapi[standard] pulls in, that means uvloop and httptools).
    uvicorn.run(create_app(args.prefill, args.decode), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
