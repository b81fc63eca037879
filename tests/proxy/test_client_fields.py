"""Client fields the proxy reads before routing (the tenant, the session id) are
checked where it parses the request: a value of the wrong type is a 400 that names
the field, never a 500, and never reaches an engine.

A ``cache_salt`` that is not a string (an int, say) used to reach the session store
key and the router's keys, which hash it as text: a 500.  vLLM 0.32 refuses such a
salt itself (a non-empty string, at most 128 characters, no ``@``, ``/``, ``\\`` or
NUL); the proxy refuses the same values (pinned against vLLM's request models in
``tests/engine/test_cache_salt_matches_vllm.py``).  A real proxy over stub engines.
"""

from __future__ import annotations

import contextlib

import aiohttp
import pytest
from aiohttp import web
from test_route_round_trips import PROMPT, StubEngine

from sessionkv_proxy.app import create_app
from sessionkv_proxy.config import load_config

BAD_SALTS = [5, 0, 5.5, True, [], ["tenant"], {"t": 1}, "", "a/b", "a@b", "a\\b", "a\x00b",
             "x" * 129]


class CountingStub(StubEngine):
    """The round-trip test's P or D, counting the generation requests it gets."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.generations = 0

    async def completions(self, request: web.Request) -> web.Response:
        self.generations += 1
        return await super().completions(request)

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/v1/chat/completions", self.completions)
        return app


@contextlib.asynccontextmanager
async def _proxy(free_port, tokenizer: str, stub=None, **config):
    """A proxy over a stub P and D (``stub``'s class, ``CountingStub`` by default);
    yields its URL and the stubs.  ``config``: more proxy config keys."""
    stubs = [(stub or CountingStub)("prefill"), (stub or CountingStub)("decode")]
    runners, engines = [], []
    try:
        for s in stubs:
            port = free_port()
            runner = web.AppRunner(s.app(), handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            engines.append({"url": f"http://127.0.0.1:{port}", "role": s.role})
        port = free_port()
        proxy = create_app(load_config(None, {
            "engines": engines, "host": "127.0.0.1", "port": port, "tokenizer": tokenizer,
            "block_size": 16,
            # Always P then D: the session's store key and the router's keys are made.
            "routing": {"params": {"decode_only_max_uncached_tokens": -1}}, **config}))
        await proxy.start()
        try:
            async with aiohttp.ClientSession() as http:
                yield f"http://127.0.0.1:{port}", http, stubs
        finally:
            await proxy.stop(1.0)
    finally:
        for runner in runners:
            await runner.cleanup()


def _body(is_chat: bool, **extra) -> dict:
    if is_chat:
        return {"model": "stub", "messages": [{"role": "user", "content": "hi " * 40}],
                "max_tokens": 4, **extra}
    return {"model": "stub", "prompt": PROMPT, "max_tokens": 4, **extra}


@pytest.mark.parametrize("tokenizer", ["none", "text"])
@pytest.mark.parametrize("session", [None, "s1"])
async def test_a_cache_salt_vllm_refuses_is_a_400_naming_it(free_port, tokenizer, session):
    async with _proxy(free_port, tokenizer) as (url, http, stubs):
        headers = {"X-Session-ID": session} if session else {}
        for is_chat in (False, True):
            path = "/v1/chat/completions" if is_chat else "/v1/completions"
            for salt in BAD_SALTS:
                async with http.post(url + path, json=_body(is_chat, cache_salt=salt),
                                     headers=headers) as resp:
                    out = await resp.json()
                    assert resp.status == 400, (path, salt, resp.status, out)
                assert out["error"]["param"] == "cache_salt", out
                assert out["error"]["type"] == "invalid_request_error", out
                assert "cache_salt" in out["error"]["message"], out
        assert [s.generations for s in stubs] == [0, 0]   # nothing reached an engine
        # A salt vLLM takes is served, under the session, through P then D.
        async with http.post(url + "/v1/completions", headers=headers,
                             json=_body(False, cache_salt="tenant-a")) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-sessionkv-route"] == "disaggregated"
        assert [s.generations for s in stubs] == [1, 1]


@pytest.mark.parametrize("field, value", [
    ("prompt_cache_key", 5), ("prompt_cache_key", ["s"]), ("prompt_cache_key", ""),
    ("session_id", 5), ("session_id", {"id": "s"}), ("session_id", True)])
async def test_a_session_id_of_another_type_is_a_400_naming_it(free_port, field, value):
    async with _proxy(free_port, "none") as (url, http, stubs):
        async with http.post(url + "/v1/completions",
                             json=_body(False, **{field: value})) as resp:
            out = await resp.json()
            assert resp.status == 400, out
        assert out["error"]["param"] == field, out
        assert [s.generations for s in stubs] == [0, 0]


async def test_fields_the_proxy_does_not_read_are_the_engines_to_judge(free_port):
    """``user`` (a string in OpenAI's API) is relayed as sent: vLLM decides."""
    async with _proxy(free_port, "none") as (url, http, stubs):
        async with http.post(url + "/v1/completions", headers={"X-Session-ID": "s2"},
                             json=_body(False, user=5)) as resp:
            assert resp.status == 200, await resp.text()
        assert [s.generations for s in stubs] == [1, 1]


class RecordingStub(CountingStub):
    """A stub that keeps the kv_transfer_params of each generation request."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.params: list[dict | None] = []

    async def completions(self, request: web.Request) -> web.Response:
        self.params.append((await request.json()).get("kv_transfer_params"))
        return await super().completions(request)


@pytest.mark.parametrize("routing, route", [
    ({"decode_only_max_uncached_tokens": -1}, "disaggregated"),
    ({"decode_only_max_uncached_tokens": 100_000}, "decode_only")])
async def test_the_hold_hint_header_reaches_decode_clamped(free_port, routing, route):
    """X-Session-Hold-S goes to D (not P) inside kv_transfer_params' sessionkv payload,
    clamped to max_session_hold_s; without a session it is not forwarded."""
    async with _proxy(free_port, "none", RecordingStub, routing={"params": routing},
                      max_session_hold_s=900.0) as (url, http, stubs):
        prefill, decode = stubs
        for sent, forwarded in (("300", 300.0), (" 12.5 ", 12.5), ("1e9", 900.0),
                                ("0", 0.0)):
            async with http.post(url + "/v1/completions", json=_body(False),
                                 headers={"X-Session-ID": "s-hint",
                                          "X-Session-Hold-S": sent}) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-sessionkv-route"] == route
            assert decode.params[-1]["sessionkv"]["hold_hint_s"] == forwarded, sent
            if route == "disaggregated":
                assert "hold_hint_s" not in (prefill.params[-1] or {}).get("sessionkv", {})
        # No header: no hint.
        async with http.post(url + "/v1/completions", json=_body(False),
                             headers={"X-Session-ID": "s-hint"}) as resp:
            assert resp.status == 200
        assert "hold_hint_s" not in decode.params[-1].get("sessionkv", {})
        # No session: nothing to hold, nothing forwarded.
        async with http.post(url + "/v1/completions", json=_body(False),
                             headers={"X-Session-Hold-S": "60"}) as resp:
            assert resp.status == 200
        assert "hold_hint_s" not in str(decode.params[-1])


@pytest.mark.parametrize("value", ["soon", "", "-1", "nan", "inf", "1s", "0x10"])
async def test_a_bad_hold_hint_is_a_400_naming_the_header(free_port, value):
    async with _proxy(free_port, "none", RecordingStub) as (url, http, stubs):
        async with http.post(url + "/v1/completions", json=_body(False),
                             headers={"X-Session-ID": "s", "X-Session-Hold-S": value}) as resp:
            out = await resp.json()
            assert resp.status == 400, out
        assert out["error"]["param"] == "X-Session-Hold-S", out
        assert "X-Session-Hold-S" in out["error"]["message"], out
        assert [s.generations for s in stubs] == [0, 0]
