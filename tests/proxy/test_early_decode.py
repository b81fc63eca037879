"""Early decode through the real proxy: D's request goes out while P prefills.

P and D are small aiohttp engines; D holds an early-decode request on the engine
side's real ``EarlyDecodeInbox`` until the proxy pushes P's parameters over ZMQ,
as the connector's scheduler does.  The happy path on real vLLM engines is in
``tests/e2e/test_pd_foundation.py``; here are the orderings and failures that real
engines cannot be made to produce on demand.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from sessionkv_proxy.app import create_app
from sessionkv_proxy.config import load_config
from vllm_sessionkv.early_decode import EarlyDecodeInbox, Outcome
from vllm_sessionkv.wire.early_decode import EarlyDecodeSender
from vllm_sessionkv.wire.protocol import PROTOCOL_VERSION

P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [[1, 2]], "remote_engine_id": "p0",
            "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "r"}


class _Engines:
    """One P and one D on their own ports; D takes pushes on ``early_port``."""

    def __init__(self, early_port: int | None, p_status: int = 200,
                 p_pushes: bool = False, p_resets: bool = False,
                 p_answer_delay_s: float = 0.0) -> None:
        self.p_status = p_status
        # P answers the proxy this long after it pushed its parameters to D.
        self.p_answer_delay_s = p_answer_delay_s
        self.p_answered_at: float | None = None      # loop time of P's answer
        self.client_first_at: float | None = None    # when the client had its first bytes
        self.p_resets = p_resets          # P resets the connection instead of answering
        self.p_pushes = p_pushes          # P pushes its parameters to D itself
        self.p_push_requests: list[dict] = []
        self.p_sessionkv: list[dict] = []    # what each P request carried for us
        self.d_bodies: list[dict] = []
        self.d_got_params: list[dict | None] = []
        self.d_cancelled = 0
        self.d_in_flight = 0                 # D handlers not yet ended (or cancelled)
        self.d_arrived = asyncio.Event()
        self.inbox = (EarlyDecodeInbox(f"tcp://127.0.0.1:{early_port}", timeout_s=10.0)
                      if early_port else None)

    async def prefill(self, request):
        body = await request.json()
        ours = (body.get("kv_transfer_params") or {}).get("sessionkv") or {}
        self.p_sessionkv.append(ours)
        push = ours.get("early_decode_push")
        if push:
            self.p_push_requests.append(push)
        # With early decode, D has the request before P answers.
        try:
            await asyncio.wait_for(self.d_arrived.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
        if self.p_resets:
            request.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            request.transport.abort()
            return web.Response()
        if self.p_status != 200:
            return web.json_response({"error": {"message": "P broke"}},
                                     status=self.p_status)
        params = dict(P_PARAMS)
        if self.p_pushes and push:
            # As P's connector does at the end of the request (its first send to a
            # new D may find the connection still coming up: then the proxy pushes).
            sender = EarlyDecodeSender([push["endpoint"]])
            try:
                deadline = asyncio.get_running_loop().time() + 2
                while not sender.send(push["endpoint"], push["id"], P_PARAMS):
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.01)
            finally:
                sender.close()
            params["sessionkv"] = {"early_decode_pushed": True}
        await asyncio.sleep(self.p_answer_delay_s)
        self.p_answered_at = asyncio.get_running_loop().time()
        return web.json_response({"id": "p", "choices": [{"text": "x"}],
                                  "kv_transfer_params": params})

    async def decode(self, request):
        self.d_in_flight += 1
        try:
            return await self._decode(request)
        finally:
            self.d_in_flight -= 1

    async def _decode(self, request):
        body = await request.json()
        self.d_bodies.append(body)
        self.d_arrived.set()
        params = body.get("kv_transfer_params") or {}
        early_id = (params.get("sessionkv") or {}).get("early_decode_id")
        stream = None
        if body.get("stream"):
            # Like vLLM: a stream's head goes out at once, before any token.
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
        try:
            if early_id and self.inbox is None:
                await asyncio.sleep(60)   # held for a push that cannot come
            elif early_id:
                while True:
                    outcome, params, _ = self.inbox.poll(early_id)
                    if outcome is not Outcome.WAITING:
                        break
                    await asyncio.sleep(0.002)
        except asyncio.CancelledError:
            self.d_cancelled += 1
            raise
        self.d_got_params.append(params)
        if stream is not None:
            await stream.write(b'data: {"choices": [{"text": " ok"}]}\n\ndata: [DONE]\n\n')
            await stream.write_eof()
            return stream
        return web.json_response({"id": "d", "object": "text_completion", "model": "stub",
                                  "choices": [{"index": 0, "text": " ok",
                                               "finish_reason": "length"}]})

    async def models(self, _request):
        return web.json_response({"object": "list", "data": [{"id": "stub"}]})

    async def metrics(self, _request):
        return web.Response(text="")

    def app(self, role: str) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions",
                            self.prefill if role == "prefill" else self.decode)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        return app


async def _run(free_port, engines: _Engines, early_endpoint: str | None,
               stream: bool = False, **config_overrides):
    """Start P, D and the proxy; send one completion; return (status, body or stream
    text, headers, metrics)."""
    runners = []
    ports = {}
    for role in ("prefill", "decode"):
        # Like vLLM, a handler ends when its client (the proxy) drops the request.
        runner = web.AppRunner(engines.app(role), handle_signals=False,
                               handler_cancellation=True)
        await runner.setup()
        ports[role] = free_port()
        await web.TCPSite(runner, "127.0.0.1", ports[role]).start()
        runners.append(runner)
    decode = {"url": f"http://127.0.0.1:{ports['decode']}", "role": "decode"}
    if early_endpoint:
        decode["early_decode"] = early_endpoint
    proxy_port = free_port()
    config = load_config(None, {
        "engines": [{"url": f"http://127.0.0.1:{ports['prefill']}", "role": "prefill"},
                    decode],
        "host": "127.0.0.1", "port": proxy_port, "tokenizer": "none",
        "routing": {"params": {"decode_only_max_uncached_tokens": -1}},
        **config_overrides})
    proxy = create_app(config)
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{proxy_port}"
            async with http.post(base + "/v1/completions",
                                 json={"model": "stub", "prompt": "hello " * 50,
                                       "max_tokens": 8, "stream": stream}) as resp:
                status, headers = resp.status, resp.headers
                if stream:
                    head = await resp.content.readany()
                    engines.client_first_at = asyncio.get_running_loop().time()
                    body = head.decode() + (await resp.read()).decode()
                else:
                    body = await resp.json()
            deadline = asyncio.get_running_loop().time() + 5
            while engines.d_in_flight:   # a cancelled D handler finishes its unwinding
                assert asyncio.get_running_loop().time() < deadline, "D handler never ended"
                await asyncio.sleep(0.005)
            async with http.get(base + "/metrics") as resp:
                text = await resp.text()
        if engines.inbox is not None:
            engines.inbox.poll("-")   # drain: a second push for one id would show here
            engines.leftover = dict(engines.inbox._arrived)
    finally:
        await proxy.stop(1.0)
        for runner in runners:
            await runner.cleanup()
        if engines.inbox is not None:
            engines.inbox.close()
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    return status, body, headers, metrics


async def test_d_gets_the_request_while_p_prefills_and_p_params_after(free_port):
    early_port = free_port()
    engines = _Engines(early_port)
    status, body, headers, _ = await _run(free_port, engines,
                                          f"tcp://127.0.0.1:{early_port}")
    assert status == 200, body
    assert headers["x-sessionkv-route"] == "disaggregated"
    assert headers["x-sessionkv-prefill-engine"].startswith("http://127.0.0.1:")
    assert float(headers["x-sessionkv-prefill-ms"]) > 0
    # One D request, sent with an id and no P parameters, then given P's exactly.
    assert len(engines.d_bodies) == 1
    sent = engines.d_bodies[0]["kv_transfer_params"]
    assert set(sent) == {"sessionkv"} and sent["sessionkv"]["early_decode_id"]
    assert engines.d_got_params == [P_PARAMS]
    assert engines.d_cancelled == 0
    # P was asked to push to that D under that id; it did not, so the proxy did.
    assert engines.p_push_requests == [{"endpoint": f"tcp://127.0.0.1:{early_port}",
                                        "id": sent["sessionkv"]["early_decode_id"]}]
    assert engines.leftover == {}


async def test_when_p_pushed_its_params_the_proxy_does_not(free_port):
    early_port = free_port()
    engines = _Engines(early_port, p_pushes=True)
    status, body, _, _ = await _run(free_port, engines, f"tcp://127.0.0.1:{early_port}")
    assert status == 200, body
    assert engines.d_got_params == [P_PARAMS]
    assert engines.leftover == {}, "the proxy pushed a second copy"


async def test_a_stream_starts_after_p_with_p_headers(free_port):
    early_port = free_port()
    engines = _Engines(early_port)
    status, text, headers, _ = await _run(free_port, engines,
                                          f"tcp://127.0.0.1:{early_port}", stream=True)
    assert status == 200 and text.endswith("data: [DONE]\n\n"), text
    assert headers["x-sessionkv-prefill-engine"].startswith("http://127.0.0.1:")
    assert set(engines.d_bodies[0]["kv_transfer_params"]) == {"sessionkv"}
    assert engines.d_got_params == [P_PARAMS]


async def test_a_stream_starts_when_d_answers_before_p_answers_the_proxy(free_port):
    """P's connector pushed its parameters to D, which streams at once; P's own answer
    reaches the proxy a second later.  The client has D's first chunk before P's answer
    (the proxy used to hold D's stream for that answer's headers, then send it whole),
    and the stream goes without P's headers."""
    early_port = free_port()
    engines = _Engines(early_port, p_pushes=True, p_answer_delay_s=1.0)
    status, text, headers, _ = await _run(free_port, engines,
                                          f"tcp://127.0.0.1:{early_port}", stream=True)
    assert status == 200 and text.endswith("data: [DONE]\n\n"), text
    assert engines.client_first_at < engines.p_answered_at
    assert headers["x-sessionkv-route"] == "disaggregated"
    assert "x-sessionkv-prefill-ms" not in headers
    assert engines.d_got_params == [P_PARAMS]
    assert engines.leftover == {}, "the proxy pushed a second copy"


async def test_a_failed_prefill_drops_the_held_d_request_and_returns_p_error(free_port):
    early_port = free_port()
    engines = _Engines(early_port, p_status=503)
    status, body, _, _ = await _run(free_port, engines, f"tcp://127.0.0.1:{early_port}")
    assert status == 503 and body["error"]["message"] == "P broke"
    assert len(engines.d_bodies) == 1 and engines.d_cancelled == 1
    assert engines.d_got_params == []


async def test_a_p_that_cannot_be_reached_leaves_the_request_to_d_alone(free_port):
    """The pool's only P resets the connection (no P to try after it): the held D
    request is dropped and D is sent the request alone, with nothing of P's."""
    early_port = free_port()
    engines = _Engines(early_port, p_resets=True)
    status, body, headers, metrics = await _run(free_port, engines,
                                                f"tcp://127.0.0.1:{early_port}")
    assert status == 200, body
    assert headers["x-sessionkv-route"] == "decode_only"
    assert "x-sessionkv-prefill-engine" not in headers
    assert len(engines.d_bodies) == 2 and engines.d_cancelled == 1
    assert "kv_transfer_params" not in engines.d_bodies[1]
    assert metrics[("sessionkv_proxy_errors_total", (("kind", "prefill_unreachable"),))] == 1
    assert engines.leftover == {}


async def test_an_unreachable_early_socket_falls_back_to_d_after_p(free_port):
    engines = _Engines(early_port=None)   # D has no early-decode socket
    status, body, headers, metrics = await _run(
        free_port, engines, f"tcp://127.0.0.1:{free_port()}")
    assert status == 200, body
    # The held request was dropped and D was sent the request again, with P's params.
    assert len(engines.d_bodies) == 2 and engines.d_cancelled == 1
    assert engines.d_bodies[1]["kv_transfer_params"] == P_PARAMS
    assert engines.d_got_params == [P_PARAMS]
    assert metrics[("sessionkv_proxy_errors_total", (("kind", "early_decode_push"),))] == 1


async def test_without_early_decode_d_is_sent_the_request_after_p(free_port):
    engines = _Engines(early_port=None)
    status, body, _, _ = await _run(free_port, engines, None)
    assert status == 200, body
    assert len(engines.d_bodies) == 1
    assert engines.d_bodies[0]["kv_transfer_params"] == P_PARAMS


async def test_p_is_asked_to_keep_its_token_only_when_the_handoff_is_off(free_port):
    early_port = free_port()
    on, off = _Engines(early_port), _Engines(None)
    status, body, _, _ = await _run(free_port, on, f"tcp://127.0.0.1:{early_port}")
    assert status == 200, body
    assert "first_token" not in on.p_sessionkv[0]
    status, body, _, _ = await _run(free_port, off, None, first_token_handoff=False)
    assert status == 200, body
    # Every payload the router writes names its protocol version.
    assert off.p_sessionkv == [{"first_token": False, "version": PROTOCOL_VERSION}]
