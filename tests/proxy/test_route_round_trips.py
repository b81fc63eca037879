"""One Redis round trip per routing decision (issue 24, must-show 4), on one Redis and
(the Router tests) on a Redis Cluster, where the routing script's keys share one slot.

The session record, the engines' published handle (taken atomically when a P request
could use it) and the index matches come back from one script; the writes the
decision implies go out behind the request.  Counted two ways on a real
redis-server: with ``MONITOR`` (what the server received before the stub P was
called, through the whole proxy), and with the client's own command count at the
moment ``Router.plan`` returns.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from test_admin import StubEngine as AdminStub

from vllm_sessionkv.wire.protocol import encode_handle, handle_from_params, session_store_key
from vllm_sessionkv.wire.redis_keys import RedisKeys

from sessionkv_proxy.app import create_app
from sessionkv_proxy.config import load_config
from sessionkv_proxy.engines import EnginePool
from sessionkv_proxy.index.base import TIER_DEVICE
from sessionkv_proxy.index.fallback import FallbackIndex
from sessionkv_proxy.index.memory import MemoryIndex
from sessionkv_proxy.index.redis import RedisIndex
from sessionkv_proxy.redis_link import RedisLink, make_redis_client
from sessionkv_proxy.router import Router
from sessionkv_proxy.upstream import UpstreamPool

BS = 16
PROMPT = list(range(1000, 1064))   # 4 blocks of token ids: no /tokenize needed


def _handle(engine_url: str) -> bytes:
    return encode_handle(handle_from_params({
        "do_remote_decode": True, "remote_engine_id": "d1", "remote_block_ids": [[1]],
        "sessionkv": {"engine_url": engine_url, "expires_at_unix_s": time.time() + 120,
                      "hash_chain": ""}}))


class Monitor:
    """Every command redis-server receives, in order, from a ``MONITOR`` connection;
    ``mark`` sends an ``ECHO`` and returns once the monitor has seen it, so the
    commands before a mark are all in ``seen``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[dict] = []
        self._client = aioredis.Redis.from_url(url)
        self._marker = aioredis.Redis.from_url(url)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        ready = asyncio.Event()

        async def listen() -> None:
            async with self._client.monitor() as m:
                ready.set()
                while True:
                    self.seen.append(await m.next_command())

        self._task = asyncio.create_task(listen())
        await asyncio.wait_for(ready.wait(), 5)
        await self.mark("monitor-up")

    async def mark(self, name: str) -> int:
        """Index in ``seen`` of the marker ``name`` once it arrived."""
        token = f"mark-{name}-{uuid.uuid4().hex}"
        await self._marker.echo(token)
        deadline = time.monotonic() + 5
        while True:
            for i in range(len(self.seen) - 1, -1, -1):
                if token in self.seen[i]["command"]:
                    return i
            assert time.monotonic() < deadline, f"monitor never saw {name}"
            await asyncio.sleep(0.005)

    def client_commands(self, start: int, end: int) -> list[str]:
        """Commands clients sent between two marks (not those a script ran, not the
        upkeep's periodic INFO/PING, which belong to no request, and not a new
        connection's handshake: redis-py opens one when its others are busy, as with
        the upkeep's or an earlier request's call still in flight on a loaded machine,
        where a run here saw ``HELLO 3`` before the routing script)."""
        out = []
        for cmd in self.seen[start + 1:end]:
            name = cmd["command"].split(" ", 1)[0].upper()
            if cmd["client_type"] == "lua" or name in ("INFO", "PING", "ECHO", "HELLO",
                                                       "CLIENT"):
                continue
            out.append(cmd["command"])
        return out

    def script_commands(self, start: int, end: int) -> list[str]:
        return [c["command"].split(" ", 1)[0].upper() for c in self.seen[start + 1:end]
                if c["client_type"] == "lua"]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()
        await self._marker.aclose()


class StubEngine(AdminStub):
    """P or D answering ``/v1/completions`` (and, as the admin test's stub, the
    models and metrics the proxy asks for); P runs ``on_prefill`` first."""

    def __init__(self, role: str, on_prefill=None) -> None:
        super().__init__((200, {"success": True}))
        self.role = role
        self.on_prefill = on_prefill

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.role == "prefill" and self.on_prefill is not None:
            await self.on_prefill(body)
        out = {"id": "x", "object": "text_completion", "model": "stub",
               "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
               "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 1,
                         "total_tokens": len(PROMPT) + 1}}
        if self.role == "prefill":
            out["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                         "remote_engine_id": "p", "remote_block_ids": [[1]],
                                         "remote_host": "127.0.0.1", "remote_port": 1}
        return web.json_response(out)

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/v1/completions", self.completions)
        return app


async def test_a_routed_request_costs_one_redis_round_trip_before_p_is_called(
        free_port, redis_server):
    monitor = Monitor(redis_server)
    await monitor.start()
    before_p: list[int] = []

    async def on_prefill(body: dict) -> None:
        before_p.append(await monitor.mark("p-called"))

    prefill, decode = StubEngine("prefill", on_prefill), StubEngine("decode")
    runners, engines = [], []
    for role, stub in (("prefill", prefill), ("decode", decode)):
        port = free_port()
        runner = web.AppRunner(stub.app(), handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        engines.append({"url": f"http://127.0.0.1:{port}", "role": role})
    d_url = engines[1]["url"]
    proxy_port = free_port()
    redis_keys = RedisKeys(f"t{uuid.uuid4().hex}")
    proxy = create_app(load_config(None, {
        "engines": engines, "host": "127.0.0.1", "port": proxy_port, "tokenizer": "none",
        "block_size": BS,
        # Always P then D, so the session's handle is used.
        "routing": {"params": {"decode_only_max_uncached_tokens": -1}},
        "index": {"backend": "redis", "redis_url": redis_server,
                  "redis_namespace": redis_keys.namespace}}))
    await proxy.start()
    client = aioredis.Redis.from_url(redis_server)
    session = aiohttp.ClientSession()
    url = f"http://127.0.0.1:{proxy_port}/v1/completions"
    try:
        async def send(session_id: str | None) -> aiohttp.ClientResponse:
            body = {"model": "stub", "prompt": PROMPT, "max_tokens": 4}
            if session_id:
                body["session_id"] = session_id
            async with session.post(url, json=body) as resp:
                await resp.read()
                assert resp.status == 200, await resp.text()
                return resp

        # The script's first use loads it into Redis (NOSCRIPT, SCRIPT LOAD): once.
        await send(None)
        handle_key = redis_keys.handle(session_store_key("s1", None))   # as D publishes
        await client.set(handle_key, _handle(d_url), px=120_000)
        before_p.clear()
        start = await monitor.mark("request")
        resp = await send("s1")
        assert resp.headers["x-sessionkv-route"] == "disaggregated"
        assert resp.headers["x-sessionkv-handle"] == "attached"
        assert len(before_p) == 1
        sent = monitor.client_commands(start, before_p[0])
        # One round trip: one command, the routing script.
        assert len(sent) == 1 and sent[0].upper().startswith("EVALSHA"), sent
        ran = monitor.script_commands(start, before_p[0])
        assert ran.count("GET") == 2 and "DEL" in ran and "HKEYS" in ran, ran
        # The handle was taken in that round trip (single use), and the session
        # record is written after the answer, behind it.
        assert await client.get(handle_key) is None
        await proxy.services.router.sessions.flush()
        end = await monitor.mark("written")
        after = monitor.client_commands(before_p[0], end)
        assert any(c.upper().startswith("SET") and "sess:" in c for c in after), after
    finally:
        await client.delete(redis_keys.handle(session_store_key("s1", None)))
        await session.close()
        await proxy.stop(1.0)
        for runner in runners:
            await runner.cleanup()
        await client.aclose()
        await monitor.close()


class CountingClient:
    """The client's own count of the commands it sends (each one round trip: the
    proxy pipelines nothing)."""

    def __init__(self, client) -> None:
        self.sent: list[str] = []
        inner = client.execute_command

        async def execute_command(*args, **kwargs):
            self.sent.append(str(args[0]).upper())
            return await inner(*args, **kwargs)

        client.execute_command = execute_command


@pytest.fixture
async def routed(any_redis):
    """A Router over the Redis backend with its fallback (as the proxy runs it), on one
    Redis and on a Redis Cluster: one P, one D, a session whose D holds the whole
    prompt."""
    link = RedisLink(make_redis_client(any_redis, max_connections=8, timeout_s=1.0),
                     timeout_s=1.0)
    remote = RedisIndex(link.client, namespace=f"t{uuid.uuid4().hex}")
    index = FallbackIndex(remote, MemoryIndex(), link)
    p_url, d_url = "http://127.0.0.1:9", "http://127.0.0.1:10"
    config = load_config(None, {"engines": [{"url": p_url, "role": "prefill"},
                                            {"url": d_url, "role": "decode"}],
                                "block_size": BS, "tokenizer": "none",
                                # decode-only whenever D holds the prompt
                                "routing": {"params": {
                                    "decode_only_max_uncached_tokens": 1 << 20}}})
    upstream = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=1.0)
    router = Router(config, EnginePool.from_configs(config.engines), index, upstream)
    counter = CountingClient(link.client)
    yield router, index, counter, d_url
    await router.sessions.flush()
    # The admin test counts the published handles on the shared server.
    await link.client.delete(*(remote.keys.handle(session_store_key(s, None))
                               for s in ("s2", "s3", "s4")))
    await upstream.close()
    await index.close()
    await link.aclose()


async def test_an_unused_handle_is_given_back_after_the_decision(routed):
    router, index, counter, d_url = routed
    from vllm_sessionkv.wire.hashing import request_keys

    keys = request_keys(PROMPT, BS)
    await index.store(d_url, TIER_DEVICE, [(i, k) for i, k in enumerate(keys)])
    handle_key = index.remote.keys.handle(session_store_key("s2", None))
    raw = _handle(d_url)
    await index.link.client.set(handle_key, raw, px=120_000)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    await router.plan(body, False, None)          # loads the script once
    counter.sent.clear()
    plan = await router.plan(body, False, "s2")
    # When plan returns (P would be called next): one command sent, the script.
    assert counter.sent == ["EVALSHA"], counter.sent
    assert plan.mode == "decode_only" and plan.handle_outcome == "unused_decode_only"
    # Taken by the read, given back behind the request with the rest of its time.
    await router.sessions.flush()
    assert counter.sent == ["EVALSHA", "SET"], counter.sent
    assert await index.link.client.get(handle_key) == raw
    assert 0 < await index.link.client.pttl(handle_key) <= 120_000


async def test_a_record_held_handle_is_cleared_behind_the_request_and_at_once_here(routed):
    """The record's handle leaves this replica's view when the decision uses it, so a
    second request here cannot use it again while the write is on its way."""
    from vllm_sessionkv.wire.protocol import decode_handle

    from sessionkv_proxy.sessions import SessionRecord

    router, index, counter, d_url = routed
    router.params = msgspec.structs.replace(router.params,   # always P then D
                                            decode_only_max_uncached_tokens=-1)
    await router.sessions.save(SessionRecord(session_id="s3", last_decode=d_url,
                                            handle=decode_handle(_handle(d_url))))
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    await router.plan(body, False, None)
    counter.sent.clear()
    first = await router.plan(body, False, "s3")
    assert counter.sent == ["EVALSHA"], counter.sent
    second = await router.plan(body, False, "s3")
    assert (first.handle_outcome, second.handle_outcome) == ("attached", "none")
    assert first.prefill_params["remote_engine_id"] == "d1"
    assert second.prefill_params["remote_engine_id"] is None
    await router.sessions.flush()
    stored = await router.sessions.load("s3", None)
    assert stored is not None and stored.handle is None


async def test_a_taken_handle_goes_back_when_no_worker_can_take_the_request(routed):
    from sessionkv_proxy.errors import ApiError

    router, index, counter, d_url = routed
    handle_key = index.remote.keys.handle(session_store_key("s4", None))
    raw = _handle(d_url)
    await index.link.client.set(handle_key, raw, px=120_000)
    router.pool.get(d_url).healthy = False
    with pytest.raises(ApiError) as err:
        await router.plan({"model": "m", "prompt": PROMPT, "max_tokens": 4}, False, "s4")
    assert err.value.status == 503
    await router.sessions.flush()
    assert await index.link.client.get(handle_key) == raw
