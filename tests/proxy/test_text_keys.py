"""``tokenizer: text``: routing on blocks of the prompt's text, with no token ids.

For pools whose engines publish no KV events, the router's only memory of what an
engine holds is its own recent routes; keyed by text they need no ``/tokenize``
round trip.  Checked here on ``Router.plan`` (prefix and conversation affinity,
tenants apart) and through the whole proxy on two stub engines that count what they
are asked (no ``/tokenize`` call; ``tokenizer: engine`` beside it as the control).
"""

from __future__ import annotations

import random

import aiohttp
import pytest
from aiohttp import web

from sessionkv_proxy.config import ConfigError, load_config
from sessionkv_proxy.engines import EnginePool
from sessionkv_proxy.index.memory import MemoryIndex
from sessionkv_proxy.keys import text_keys
from sessionkv_proxy.prompt_keys import CHARS_PER_TOKEN, prompt_text
from sessionkv_proxy.router import Router
from sessionkv_proxy.upstream import UpstreamPool

D1, D2 = "http://127.0.0.1:10", "http://127.0.0.1:11"
BS = 16
_WORDS = ["ka", "to", "ri", "mu", "sen", "lo", "va", "qu", "zi", "pe", "dra", "mon"]


def _text(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(chars))[:chars]


def _router(tokenizer: str = "text") -> tuple[Router, UpstreamPool]:
    config = load_config(None, {"engines": [{"url": D1, "role": "decode"},
                                            {"url": D2, "role": "decode"}],
                                "block_size": BS, "tokenizer": tokenizer})
    # Nothing listens behind these URLs: a /tokenize call would find no engine.
    upstream = UpstreamPool(connect_timeout_s=0.2, request_timeout_s=0.2)
    return Router(config, EnginePool.from_configs(config.engines), MemoryIndex(),
                  upstream), upstream


async def test_completions_text_keys_give_prefix_affinity() -> None:
    router, upstream = _router()
    try:
        shared = _text(1, 40 * BS * CHARS_PER_TOKEN)        # 40 key blocks
        first = await router.plan({"prompt": shared + " ka", "max_tokens": 4}, False, None)
        assert first.prompt_keys == text_keys(shared.encode(), BS * CHARS_PER_TOKEN)
        assert first.prompt_tokens == len(shared + " ka") // CHARS_PER_TOKEN
        # The group's next request follows its prefix; a new prompt is placed apart.
        second = await router.plan({"prompt": shared + " to ri", "max_tokens": 4},
                                   False, None)
        assert second.decode is first.decode
        assert second.terms["detail"].startswith("prefix affinity")
        other = await router.plan({"prompt": _text(2, 40 * BS * CHARS_PER_TOKEN),
                                   "max_tokens": 4}, False, None)
        assert other.decode is not first.decode
        # Another tenant's same text shares no key with it.
        salted = await router.plan({"prompt": shared, "max_tokens": 4,
                                    "cache_salt": "b"}, False, None)
        assert not set(salted.prompt_keys) & set(first.prompt_keys)
        # Token ids the client sent are keyed as ids: they are the engine's own.
        ids = await router.plan({"prompt": list(range(100, 164)), "max_tokens": 4},
                                False, None)
        assert ids.prompt_tokens == 64 and len(ids.prompt_keys) == 4
        # A batch of prompts has no one prefix: no keys, routed on load.
        batch = await router.plan({"prompt": [shared, "ka to"], "max_tokens": 4},
                                  False, None)
        assert batch.prompt_keys == [] and batch.reason == "several_engine_requests"
    finally:
        await upstream.close()


async def test_a_conversations_next_turn_extends_its_text_keys() -> None:
    router, upstream = _router()
    turn1 = [{"role": "system", "content": _text(3, 3000)},
             {"role": "user", "content": "sen lo va?"}]
    turn2 = turn1 + [{"role": "assistant", "content": "qu zi pe."},
                     {"role": "user", "content": "dra mon?"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    try:
        first = await router.plan({"messages": turn1}, True, None)
        second = await router.plan({"messages": turn2}, True, None)
        n = len(first.prompt_keys)
        assert n >= 20 and second.prompt_keys[:n - 1] == first.prompt_keys[:n - 1]
        assert second.decode is first.decode
        # Tools come first in the keyed text: a different tool set, other keys.
        with_tools = prompt_text({"messages": turn1, "tools": tools}, True)
        assert with_tools.endswith(prompt_text({"messages": turn1}, True))
        assert text_keys(with_tools, 48)[0] != first.prompt_keys[0]
    finally:
        await upstream.close()


def test_text_keys_refuse_engines_that_publish_kv_events() -> None:
    with pytest.raises(ConfigError, match="tokenizer"):
        load_config(None, {"engines": [{"url": D1, "role": "decode",
                                        "kv_events": "tcp://127.0.0.1:5557"}],
                           "tokenizer": "text"})


class CountingEngine:
    """A stub vLLM server that counts the requests of each path it is sent."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    async def handle(self, request: web.Request) -> web.Response:
        self.calls[request.path] = self.calls.get(request.path, 0) + 1
        body = await request.json() if request.method == "POST" else {}
        if request.path == "/tokenize":
            text = str(body.get("prompt") or body.get("messages"))
            return web.json_response({"count": len(text), "max_model_len": 4096,
                                      "tokens": [ord(c) % 500 for c in text]})
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "stub"}]})
        if request.path == "/metrics":
            return web.Response(text="")
        return web.json_response({"id": "x", "object": "text_completion", "model": "stub",
                                  "choices": [{"index": 0, "text": "ok",
                                               "finish_reason": "length"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


@pytest.mark.parametrize("tokenizer", ["text", "engine"])
async def test_through_the_proxy_text_keys_need_no_tokenize(free_port, tokenizer) -> None:
    """Two prefix groups through the proxy: with ``text`` no engine is asked to
    tokenize, and each group stays on one engine, the groups apart; ``engine`` (the
    control) asks ``/tokenize`` once per request."""
    engines, runners, urls = [CountingEngine(), CountingEngine()], [], []
    for engine in engines:
        runner = web.AppRunner(engine.app(), handle_signals=False)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    from sessionkv_proxy.app import create_app

    proxy_port = free_port()
    proxy = create_app(load_config(None, {
        "engines": [{"url": u, "role": "decode"} for u in urls], "host": "127.0.0.1",
        "port": proxy_port, "block_size": BS, "tokenizer": tokenizer}))
    await proxy.start()
    served: dict[int, set[str]] = {0: set(), 1: set()}
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(8):
                group = i % 2
                prompt = _text(10 + group, 3000) + f" turn {i}"
                async with http.post(f"http://127.0.0.1:{proxy_port}/v1/completions",
                                     json={"model": "stub", "prompt": prompt,
                                           "max_tokens": 4}) as resp:
                    assert resp.status == 200, await resp.text()
                    served[group].add(resp.headers["x-sessionkv-decode-engine"])
            async with http.post(f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
                                 json={"model": "stub", "messages": [
                                     {"role": "user", "content": _text(12, 3000)}]}) as resp:
                assert resp.status == 200, await resp.text()
    finally:
        await proxy.stop(1.0)
        for runner in runners:
            await runner.cleanup()
    tokenize_calls = sum(e.calls.get("/tokenize", 0) for e in engines)
    generation = sum(e.calls.get("/v1/completions", 0)
                     + e.calls.get("/v1/chat/completions", 0) for e in engines)
    assert generation == 9
    if tokenizer == "text":
        assert tokenize_calls == 0
        assert len(served[0]) == len(served[1]) == 1 and served[0] != served[1]
    else:
        assert tokenize_calls == 9
