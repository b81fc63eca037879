#!/usr/bin/env python3
"""A zero-work OpenAI-shaped backend: every endpoint answers at once.

``router_bench.py`` puts each router in front of this stub, so whatever latency a
router adds over talking to the stub directly is the router's own cost (parsing,
policy, the extra HTTP hop), not the engine's.  It answers what the routers ask of a
vLLM server:

* ``POST /v1/completions``, ``POST /v1/chat/completions``: a fixed small completion
  with ``usage`` (prompt tokens counted as ``--prompt-tokens``, not tokenized);
* ``GET /v1/models``: one model, ``--model``;
* ``GET /metrics``: the three vLLM load gauges our proxy scrapes, all zero;
* ``POST /tokenize``: ``--prompt-tokens`` token ids, one per word of the prompt
  (a CRC of the word), repeated or cut to that fixed length: distinct prompts get
  distinct ids, so a router's index or tree grows as it would with real ids;
* ``POST /v1/completions/render``, ``POST /v1/chat/completions/render``: the same ids
  in vLLM's render shape (``GenerateRequest``); vllm-router's cache_aware policy asks
  for it before every request, as our proxy asks ``/tokenize``;
* ``GET /health``: 200.

Anything else is answered 404 and logged, so a router that needs an endpoint the
stub lacks shows up in the stub's log instead of as a silent slowdown.

    python benchmarks/zero_stub.py --port 30100 [--model stub] [--prompt-tokens 500]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import zlib

from aiohttp import web

logger = logging.getLogger("zero_stub")


def _responses(model: str, prompt_tokens: int) -> dict[str, bytes]:
    # Encoded once: the stub's own per-request work must stay negligible.
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
             "total_tokens": prompt_tokens + 1}
    completion = {"id": "cmpl-stub", "object": "text_completion", "created": 0,
                  "model": model, "usage": usage,
                  "choices": [{"index": 0, "text": " ok", "logprobs": None,
                               "finish_reason": "length", "stop_reason": None}]}
    chat = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0,
            "model": model, "usage": usage,
            "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                         "message": {"role": "assistant", "content": "ok"}}]}
    models = {"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                          "owned_by": "zero_stub", "root": model,
                                          "max_model_len": 4096}]}
    metrics = ("# TYPE vllm:num_requests_running gauge\n"
               f'vllm:num_requests_running{{model_name="{model}"}} 0.0\n'
               "# TYPE vllm:num_requests_waiting gauge\n"
               f'vllm:num_requests_waiting{{model_name="{model}"}} 0.0\n'
               "# TYPE vllm:kv_cache_usage_perc gauge\n"
               f'vllm:kv_cache_usage_perc{{model_name="{model}"}} 0.0\n')
    return {"completion": json.dumps(completion).encode(), "chat": json.dumps(chat).encode(),
            "models": json.dumps(models).encode(), "metrics": metrics.encode()}


def _token_ids(body: dict, n_tokens: int) -> list[int]:
    """Fixed-length ids that depend on the prompt's words (not a real tokenizer)."""
    text = body.get("prompt")
    if not isinstance(text, str):
        messages = body.get("messages") or []
        text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    ids = [20 + zlib.crc32(w.encode()) % 1000 for w in text.split()] or [20]
    return (ids * (n_tokens // len(ids) + 1))[:n_tokens]


def create_app(model: str, prompt_tokens: int) -> web.Application:
    bodies = _responses(model, prompt_tokens)

    def fixed(key: str, content_type: str = "application/json", read_body: bool = False):
        body = bodies[key]

        async def handler(request: web.Request) -> web.Response:
            if read_body:
                # Drain the request like a real server; a router is measured on
                # sending its whole body, not on the stub hanging up early.
                await request.read()
            return web.Response(body=body, content_type=content_type)
        return handler

    def tokens(shape: str):
        async def handler(request: web.Request) -> web.Response:
            body = json.loads(await request.read())
            ids = _token_ids(body, prompt_tokens)
            if shape == "tokenize":
                out = {"count": len(ids), "max_model_len": 4096, "tokens": ids}
            else:
                out = {"request_id": "cmpl-stub", "token_ids": ids, "model": model,
                       "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
                if shape == "render":
                    out = [out]        # /v1/completions/render: one per prompt
            return web.Response(body=json.dumps(out).encode(),
                                content_type="application/json")
        return handler

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def unknown(request: web.Request) -> web.Response:
        logger.warning("unhandled %s %s", request.method, request.path)
        return web.Response(status=404, text="zero_stub: no such endpoint")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/completions", fixed("completion", read_body=True))
    app.router.add_post("/v1/chat/completions", fixed("chat", read_body=True))
    app.router.add_post("/tokenize", tokens("tokenize"))
    app.router.add_post("/v1/completions/render", tokens("render"))
    app.router.add_post("/v1/chat/completions/render", tokens("chat_render"))
    app.router.add_get("/v1/models", fixed("models"))
    app.router.add_get("/metrics", fixed("metrics", content_type="text/plain"))
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", unknown)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="stub", help="model id served by /v1/models")
    p.add_argument("--prompt-tokens", type=int, default=500,
                   help="length of the /tokenize and render answers and of "
                        "usage.prompt_tokens")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(create_app(args.model, args.prompt_tokens), host=args.host, port=args.port,
                access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
