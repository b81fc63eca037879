"""The front door's API key and the engines' key (issue 49 item 5, must-show 4's
front-door half).

The proxy is the real one on a real socket; the engines are aiohttp stubs that, unlike
vLLM (whose ``--api-key`` guards ``/v1/*`` only), refuse *every* path without the
engines' key, so a call the proxy makes without it shows.  Real vLLM engines started
with ``--api-key`` behind the proxy: ``tests/e2e/test_api_key_engines.py``.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from test_route_round_trips import StubEngine

from sessionkv_proxy.app import create_app
from sessionkv_proxy.auth import bearer_matches
from sessionkv_proxy.config import ConfigError, load_config

CLIENT_KEY = "client-key-0123456789"
ENGINE_KEY = "engine-key-9876543210"


class KeyedEngine(StubEngine):
    """A stub P or D that answers only calls carrying the engines' key, and records
    the path and Authorization of every call."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.seen: list[tuple[str, str | None]] = []

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        tokens = [ord(c) for c in body["prompt"]]
        return web.json_response({"tokens": tokens, "count": len(tokens)})

    def app(self) -> web.Application:
        @web.middleware
        async def keyed(request: web.Request, handler):
            sent = request.headers.get("Authorization")
            self.seen.append((request.path, sent))
            if sent != f"Bearer {ENGINE_KEY}":
                return web.json_response({"error": "no key"}, status=401)
            return await handler(request)

        app = super().app()
        app.middlewares.append(keyed)
        app.router.add_post("/tokenize", self.tokenize)
        return app


async def _proxy(free_port, **keys):
    stubs, runners, engines = [], [], []
    for role in ("prefill", "decode"):
        stub, port = KeyedEngine(role), free_port()
        runner = web.AppRunner(stub.app(), handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        stubs.append(stub)
        runners.append(runner)
        engines.append({"url": f"http://127.0.0.1:{port}", "role": role})
    port = free_port()
    proxy = create_app(load_config(None, {
        "engines": engines, "host": "127.0.0.1", "port": port, "tokenizer": "engine",
        "metrics_scrape_interval_s": 0.05,
        "routing": {"params": {"decode_only_max_uncached_tokens": -1}}, **keys}))
    await proxy.start()
    return proxy, f"http://127.0.0.1:{port}", stubs, runners


async def _stop(proxy, runners) -> None:
    await proxy.stop(1.0)
    for runner in runners:
        await runner.cleanup()


BODY = {"model": "stub", "prompt": "a prompt the engine tokenizes", "max_tokens": 2}


async def test_without_the_key_401_with_it_200_and_the_engines_get_theirs(free_port):
    """Must-show 4: a request without the key (or with another) gets a 401 in
    OpenAI's error shape, counted; with it, a 200 through P and D.  Every call the
    proxy made to an engine (scrapes, models, tokenize, completions, reset) carried the
    engines' key.  /health answers without a key."""
    proxy, url, stubs, runners = await _proxy(free_port, api_key=CLIENT_KEY,
                                              engine_api_key=ENGINE_KEY)
    good = {"Authorization": f"Bearer {CLIENT_KEY}"}
    try:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong-key"},
                            {"Authorization": CLIENT_KEY},          # no scheme
                            {"Authorization": f"Basic {CLIENT_KEY}"}):
                async with http.post(f"{url}/v1/completions", json=BODY,
                                     headers=headers) as resp:
                    assert resp.status == 401, headers
                    assert resp.headers["WWW-Authenticate"] == "Bearer"
                    error = (await resp.json())["error"]
                    assert error["code"] == "invalid_api_key"
                    assert error["type"] == "invalid_request_error"
            for path, method in (("/metrics", "GET"), ("/v1/models", "GET"),
                                 ("/tokenize", "POST"), ("/v1/chat/completions", "POST")):
                async with http.request(method, url + path, json={}) as resp:
                    assert resp.status == 401, path
            async with http.get(f"{url}/health") as resp:
                assert resp.status == 200
            async with http.post(f"{url}/v1/completions", json=BODY,
                                 headers={"authorization": f"bearer {CLIENT_KEY}"}) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-sessionkv-route"] == "disaggregated"
            async with http.get(f"{url}/v1/models", headers=good) as resp:
                assert resp.status == 200
            async with http.post(f"{url}/admin/reset", headers=good) as resp:
                assert resp.status == 200, await resp.text()   # loopback
            async with http.get(f"{url}/metrics", headers=good) as resp:
                text = await resp.text()
        assert ('sessionkv_proxy_unauthorized_requests_total{endpoint="/v1/completions"} '
                '4.0') in text
        assert 'sessionkv_proxy_unauthorized_requests_total{endpoint="/metrics"} 1.0' in text
        for stub in stubs:
            paths = {path for path, _ in stub.seen}
            assert {"/metrics", "/v1/completions", "/reset_prefix_cache"} <= paths, paths
            assert all(sent == f"Bearer {ENGINE_KEY}" for _, sent in stub.seen), stub.seen
        assert "/tokenize" in {p for s in stubs for p, _ in s.seen}
        assert "/v1/models" in {p for s in stubs for p, _ in s.seen}
    finally:
        await _stop(proxy, runners)


async def test_control_without_the_engines_key_the_engines_refuse(free_port):
    """The control: no engine_api_key, and the same keyed engines refuse the proxy
    (so the test above would see a call that went without it); no api_key, and the
    front door asks none."""
    proxy, url, stubs, runners = await _proxy(free_port)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions", json=BODY) as resp:
                assert resp.status != 200 and "no key" in await resp.text()
            async with http.get(f"{url}/metrics") as resp:
                assert resp.status == 200
        assert any(sent is None for stub in stubs for _, sent in stub.seen)
    finally:
        await _stop(proxy, runners)


def test_bearer_compare():
    assert bearer_matches(f"Bearer {CLIENT_KEY}", CLIENT_KEY)
    assert bearer_matches(f"bearer {CLIENT_KEY}", CLIENT_KEY)
    assert not bearer_matches(f"Bearer {CLIENT_KEY}x", CLIENT_KEY)
    assert not bearer_matches(f"Token {CLIENT_KEY}", CLIENT_KEY)
    assert not bearer_matches("", CLIENT_KEY)


def test_keys_are_validated_and_read_from_the_environment(monkeypatch):
    engines = [{"url": "http://127.0.0.1:1", "role": "decode"}]
    for key, bad in (("api_key", "has space"), ("api_key", ""),
                     ("engine_api_key", "line\nbreak"), ("side_port_secret", "short"),
                     ("tls_cert_file", "/nonexistent.pem")):
        with pytest.raises(ConfigError, match=key.split("_file")[0]):
            load_config(None, {"engines": engines, key: bad})
    with pytest.raises(ConfigError, match="tls_cert_file"):
        load_config(None, {"engines": engines, "tls_cert_file": "/a", "tls_key_file": "/b"})
    monkeypatch.setenv("SESSIONKV_PROXY_API_KEY", CLIENT_KEY)
    monkeypatch.setenv("SESSIONKV_ENGINE_API_KEY", ENGINE_KEY)
    monkeypatch.setenv("SESSIONKV_SIDE_PORT_SECRET", "x" * 16)
    config = load_config(None, {"engines": engines})
    assert (config.api_key, config.engine_api_key, config.side_port_secret) == \
        (CLIENT_KEY, ENGINE_KEY, "x" * 16)
    # The config's own value wins over the environment.
    assert load_config(None, {"engines": engines, "api_key": "mine"}).api_key == "mine"


async def test_tls_front_door(free_port, tmp_path):
    """tls_cert_file/tls_key_file: the proxy answers HTTPS with that certificate (a
    client trusting it gets /health), and a plain-HTTP client gets no answer."""
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                    "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True,
                   capture_output=True)
    port = free_port()
    proxy = create_app(load_config(None, {
        "engines": [{"url": f"http://127.0.0.1:{free_port()}", "role": "decode"}],
        "host": "127.0.0.1", "port": port, "tokenizer": "none",
        "tls_cert_file": str(cert), "tls_key_file": str(key)}))
    await proxy.start()
    try:
        trust = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession() as http:
            async with http.get(f"https://127.0.0.1:{port}/health", ssl=trust) as resp:
                assert resp.status in (200, 503)   # no engine runs: 503, but answered
                assert "engines" in await resp.json()
            with pytest.raises(aiohttp.ClientError):
                async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                    await resp.read()
    finally:
        await proxy.stop(1.0)
