"""A P that stalls and comes back, or cannot be reached at all, costs speed, never a
request (issue 37, item 6).

Seen on real engines: a P stopped (SIGSTOP) for 20 s right after six turns were sent
to it; 5 of the 9 requests sent to it meanwhile got a 502 ``no prefill engine
reachable`` as it resumed.  uvicorn, back from the stop, runs its overdue keep-alive
timers before it reads the requests that arrived meanwhile: each connection that was
idle when it stopped is closed with a request unread, which resets it (ECONNRESET).
The proxy had re-sent only a kept-alive connection's clean close (FIN) on a new
connection, so a reset was a connection failure, and with the pool's only P there
was no other P to try: 502.

The stub P below does what uvicorn does there, deterministically: ``stall()`` stops
it answering (requests wait, as in a stopped process's sockets); ``resume()`` resets
every connection that was idle at the stall and has a request waiting, and answers
the rest.  A real stopped vLLM engine is ``tests/e2e/test_proxy_faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import struct

import aiohttp
from aiohttp import web
from test_route_round_trips import PROMPT, StubEngine

from sessionkv_proxy.app import create_app
from sessionkv_proxy.config import load_config

P_ANSWER = json.dumps({
    "id": "p", "object": "text_completion", "model": "stub",
    "choices": [{"index": 0, "text": "o", "finish_reason": "length"}],
    "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 1,
              "total_tokens": len(PROMPT) + 1},
    "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                           "remote_engine_id": "p", "remote_block_ids": [[1]],
                           "remote_host": "127.0.0.1", "remote_port": 1}}).encode()


class StallingPrefill:
    """A P engine on raw sockets (HTTP/1.1 keep-alive) that can be stopped and
    resumed as uvicorn behaves under SIGSTOP and SIGCONT."""

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.running.set()
        self.idle: set[asyncio.StreamWriter] = set()      # between requests
        self.idle_at_stall: set[asyncio.StreamWriter] = set()
        self.waiting = 0      # requests that arrived while stopped
        self.reset_prefills = False   # reset each prefill's connection, unanswered
        self.prefills = 0
        self.resets = 0

    def stall(self) -> None:
        self.idle_at_stall = set(self.idle)
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    def _reset(self, writer: asyncio.StreamWriter) -> None:
        self.resets += 1
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                   struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def handle(self, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        self.idle.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not self.running.is_set():
                    self.waiting += 1
                    await self.running.wait()
                    if writer in self.idle_at_stall:
                        # Its keep-alive timer is overdue and runs first: the socket
                        # is closed with the request unread, a reset.
                        self._reset(writer)
                        return
                self.idle.discard(writer)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                path = head.split(b" ", 2)[1]
                if path == b"/v1/completions" and self.reset_prefills:
                    self._reset(writer)
                    return
                if path == b"/v1/completions":
                    self.prefills += 1
                    body, ctype = P_ANSWER, b"application/json"
                elif path == b"/v1/models":
                    body, ctype = b'{"object":"list","data":[{"id":"stub"}]}', b"application/json"
                else:   # /metrics
                    body, ctype = b"", b"text/plain"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype
                             + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                self.idle.add(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.idle.discard(writer)
            writer.close()


@contextlib.asynccontextmanager
async def _cluster(free_port):
    """A proxy over the stalling P and a stub D; yields the proxy's URL, a client, P
    and the proxy."""
    p, d = StallingPrefill(), StubEngine("decode")
    p_port, d_port = free_port(), free_port()
    server = await asyncio.start_server(p.handle, "127.0.0.1", p_port)
    d_runner = web.AppRunner(d.app(), handle_signals=False)
    await d_runner.setup()
    await web.TCPSite(d_runner, "127.0.0.1", d_port).start()
    port = free_port()
    proxy = create_app(load_config(None, {
        "engines": [{"url": f"http://127.0.0.1:{p_port}", "role": "prefill"},
                    {"url": f"http://127.0.0.1:{d_port}", "role": "decode"}],
        "host": "127.0.0.1", "port": port, "tokenizer": "none", "block_size": 16,
        # P then D for every request; no scrape during the test (one at start-up).
        "metrics_scrape_interval_s": 60.0,
        "routing": {"params": {"decode_only_max_uncached_tokens": -1}}}))
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as http:
            yield f"http://127.0.0.1:{port}", http, p, proxy
    finally:
        await proxy.stop(1.0)
        await d_runner.cleanup()
        server.close()
        await server.wait_closed()


async def _turn(http: aiohttp.ClientSession, url: str, i: int, max_tokens: int = 4
                ) -> tuple[int, str, str]:
    body = {"model": "stub", "prompt": PROMPT, "max_tokens": max_tokens}
    async with http.post(f"{url}/v1/completions", json=body,
                         headers={"X-Session-ID": f"agent-{i}"}) as resp:
        return resp.status, resp.headers.get("x-sessionkv-route", ""), await resp.text()


async def _wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def test_the_only_p_back_from_a_stall_that_resets_its_idle_connections(free_port):
    async with _cluster(free_port) as (url, http, p, proxy):
        six = await asyncio.gather(*(_turn(http, url, i) for i in range(6)))
        assert all(status == 200 for status, _, _ in six), six
        p.stall()   # right after six turns: their connections idle in the proxy's pool
        assert p.idle_at_stall
        nine = [asyncio.ensure_future(_turn(http, url, i)) for i in range(9)]
        await _wait_for(lambda: p.waiting == 9, "nine requests to reach the stopped P")
        p.resume()
        answers = await asyncio.gather(*nine)
        # Each request on a reset connection was sent again on a new one: P served
        # all nine (none fell back to D alone), and P is still a healthy engine.
        assert p.resets >= 1
        assert [(status, route) for status, route, _ in answers] == \
            [(200, "disaggregated")] * 9, answers
        assert p.prefills == 6 + 9
        engine = proxy.services.pool.engines[0]   # P, the first configured
        assert engine.healthy and engine.consecutive_failures == 0


async def test_a_p_that_cannot_be_reached_leaves_the_request_to_d_alone(free_port):
    """The pool's only P resets every prefill on a new connection (no other P to
    try): the request is served by D alone, never answered 502; a one-token request
    (P alone would have answered it) too.  Two such failures take P out of routing,
    and the policy sends the next request to D alone itself."""
    async with _cluster(free_port) as (url, http, p, proxy):
        engine = proxy.services.pool.engines[0]
        await _wait_for(lambda: engine.last_scrape_s > 0, "the start-up scrape")
        p.reset_prefills = True
        for i, max_tokens in enumerate((1, 4, 4)):
            status, route, text = await _turn(http, url, i, max_tokens)
            assert (status, route) == (200, "decode_only"), text
        assert p.resets == 2 and not engine.healthy
        metrics = await (await http.get(f"{url}/metrics")).text()
        planned = sorted(re.findall(r'^sessionkv_proxy_routing_decisions_total\{mode="(\w+)"',
                                    metrics, re.M))
        assert planned == ["decode_only", "disaggregated", "prefill_only"], planned
        assert 'sessionkv_proxy_errors_total{kind="prefill_unreachable"} 2.0' in metrics
