"""``POST /admin/reset``: every engine's reset is judged by its JSON body, not only by
its HTTP status (vLLM answers 200 with ``{"success": false}`` while blocks are in use).

The engines are small aiohttp stubs: an engine that keeps refusing, answers 404 or a
body without ``success`` is a fault real vLLM does not produce on demand.  The real
engines' side is tested end to end in ``tests/e2e/test_pd_foundation.py``.
"""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from vllm_sessionkv.wire.protocol import session_store_key
from vllm_sessionkv.wire.redis_keys import RedisKeys

from sessionkv_proxy.admin import RESET_PATH, authorize
from sessionkv_proxy.app import create_app
from sessionkv_proxy.config import load_config
from sessionkv_proxy.errors import ApiError


class StubEngine:
    """Answers ``/reset_prefix_cache`` from a script: one entry per call, the last
    repeated.  An entry is ``(status, body)``."""

    def __init__(self, *answers: tuple[int, object]):
        self.answers = list(answers)
        self.calls: list[str] = []

    async def reset(self, request: web.Request) -> web.Response:
        self.calls.append(request.path_qs)
        status, body = self.answers[min(len(self.calls), len(self.answers)) - 1]
        text = body if isinstance(body, str) else json.dumps(body)
        return web.Response(status=status, text=text, content_type="application/json")

    async def models(self, _request):
        return web.json_response({"object": "list", "data": [{"id": "stub"}]})

    async def metrics(self, _request):
        return web.Response(text="")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/reset_prefix_cache", self.reset)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        return app


async def _admin_reset(free_port, prefill: StubEngine | None, decode: StubEngine,
                       query: str = "", redis_url: str | None = None, before=None
                       ) -> tuple[int, dict, dict[str, StubEngine]]:
    """``before(proxy)`` runs once the proxy is up, before the reset is sent."""
    runners, engines, by_url = [], [], {}
    for role, stub in (("prefill", prefill), ("decode", decode)):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        engines.append({"url": url, "role": role})
        if stub is None:      # nothing listens there
            continue
        runner = web.AppRunner(stub.app(), handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        by_url[url] = stub
    proxy_port = free_port()
    overrides = {"engines": engines, "host": "127.0.0.1", "port": proxy_port,
                 "tokenizer": "none"}
    if redis_url:
        overrides["index"] = {"backend": "redis", "redis_url": redis_url,
                              "redis_namespace": f"t{uuid.uuid4().hex}"}
    proxy = create_app(load_config(None, overrides))
    await proxy.start()
    try:
        if before is not None:
            await before(proxy)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{proxy_port}/admin/reset{query}") as resp:
                status, body = resp.status, await resp.json()
    finally:
        await proxy.stop(1.0)
        for runner in runners:
            await runner.cleanup()
    return status, body, by_url


async def test_reset_succeeds_once_every_engine_says_so_in_its_body(free_port):
    ok = {"success": True}
    # D drops its holds on the first call (still false), frees them a step later.
    decode = StubEngine((200, {"success": False}), (200, {"success": False}), (200, ok))
    prefill = StubEngine((200, ok))
    status, body, stubs = await _admin_reset(free_port, prefill, decode)
    assert status == 200, body
    assert body["success"] is True and body["failed"] == []
    by_stub = {id(stubs[url]): result for url, result in body["engines"].items()}
    assert by_stub[id(decode)]["attempts"] == 3 and by_stub[id(prefill)]["attempts"] == 1
    # Each engine was asked to reset its connector too (that drops session holds).
    assert decode.calls == [RESET_PATH] * 3 and prefill.calls == [RESET_PATH]


async def test_an_engine_that_keeps_answering_false_fails_the_reset_with_502(free_port):
    decode = StubEngine((200, {"success": False}))
    status, body, stubs = await _admin_reset(free_port, StubEngine((200, {"success": True})),
                                             decode, "?timeout_s=0.3")
    assert status == 502, body
    [failed] = body["failed"]
    assert stubs[failed] is decode
    assert "still in use" in body["engines"][failed]["error"]
    assert body["engines"][failed]["attempts"] >= 2
    assert [r["success"] for u, r in body["engines"].items() if u != failed] == [True]


async def test_http_200_without_a_success_field_is_a_failure(free_port):
    status, body, _ = await _admin_reset(free_port, StubEngine((200, {"success": True})),
                                         StubEngine((200, "{}")))
    assert status == 502 and len(body["failed"]) == 1
    assert "no boolean 'success'" in body["engines"][body["failed"][0]]["error"]


async def test_missing_endpoint_and_unreachable_engine_are_named(free_port):
    status, body, stubs = await _admin_reset(free_port, None, StubEngine((404, "{}")))
    assert status == 502 and len(body["failed"]) == 2
    errors = {("stub" if url in stubs else "down"): body["engines"][url]["error"]
              for url in body["failed"]}
    assert "VLLM_SERVER_DEV_MODE" in errors["stub"] and "unreachable" in errors["down"]


async def test_bad_timeout_is_refused_before_any_engine_is_called(free_port):
    decode = StubEngine((200, {"success": True}))
    status, body, _ = await _admin_reset(free_port, None, decode, "?timeout_s=-1")
    assert status == 400 and body["error"]["param"] == "timeout_s"
    assert decode.calls == []


async def test_sessions_and_published_handles_are_withdrawn_before_the_engines_reset(
        free_port, redis_server):
    """A handle left behind would name blocks the reset frees."""
    session_key = session_store_key("s1", None)
    handle_keys = []

    async def before(proxy):
        state = proxy.services
        # As an engine publishes it, in the deployment's namespace.
        handle_keys.append(RedisKeys(state.config.index.redis_namespace).handle(session_key))
        await state.index.put_session(session_key, b"record", 60)
        await state.redis.client.set(handle_keys[0], b"handle", px=60_000)

    ok = {"success": True}
    status, body, _ = await _admin_reset(free_port, StubEngine((200, ok)),
                                         StubEngine((200, ok)), redis_url=redis_server,
                                         before=before)
    assert status == 200, body
    assert body["dropped"] == {"session_records": 1, "published_handles": 1}
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server)
    try:
        assert await client.get(handle_keys[0]) is None
    finally:
        await client.aclose()


async def test_the_reset_forgets_the_routes_the_proxy_remembers(free_port):
    """The recent-routes credit names prefixes on engines; after the reset they hold
    none, and a prompt sent again must not be routed as a cache hit."""
    recent = []

    async def before(proxy):
        router = proxy.services.router
        router.recent.record([1, 2, 3], ["http://d"], time.time())
        recent.append(router.recent)
        assert router.recent.overlaps([1, 2, 3], time.time()) == {"http://d": 3}

    ok = {"success": True}
    status, body, _ = await _admin_reset(free_port, StubEngine((200, ok)),
                                         StubEngine((200, ok)), before=before)
    assert status == 200, body
    assert recent[0].overlaps([1, 2, 3], time.time()) == {} and len(recent[0]) == 0


@pytest.mark.parametrize("peer, token, header, allowed", [
    ("127.0.0.1", None, None, True),
    ("::1", None, None, True),
    ("10.1.2.3", None, None, False),
    ("10.1.2.3", "s3cret", "Bearer s3cret", True),
    ("10.1.2.3", "s3cret", "Bearer wrong", False),
    ("10.1.2.3", "s3cret", None, False),
    (None, None, None, False),
])
def test_admin_answers_loopback_or_the_token(peer, token, header, allowed):
    request = SimpleNamespace(peer_host=peer,
                              headers={"authorization": header} if header else {})
    if allowed:
        authorize(token, request)
    else:
        with pytest.raises(ApiError) as refused:
            authorize(token, request)
        assert refused.value.status == 403

