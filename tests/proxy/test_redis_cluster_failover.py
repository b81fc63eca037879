"""A Redis Cluster master dies under a running proxy (issue 27).

The proxy runs as its own process (``python -m sessionkv_proxy``) on a local Redis
Cluster of 3 masters with a replica each, in front of a stub P and a stub D.  The
test SIGKILLs the master that serves the deployment's slot (every key of a
deployment shares one, ``redis_keys.py``).  Until the cluster promotes its replica,
the proxy serves every request from its own copy (degraded, as during a single
Redis's outage; ``test_redis_outage.py``), counts the failed Redis calls and the
fallback reads, and says so in ``/health``.  Once the replica serves the slot the
client reads the new slot map, the proxy re-publishes what the new master missed and
``/health`` is ok again.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from redis_cluster import LocalRedisCluster
from test_route_round_trips import PROMPT, StubEngine

from vllm_sessionkv.wire.protocol import session_store_key
from vllm_sessionkv.wire.redis_keys import RedisKeys


@pytest.fixture
def own_cluster(free_port, tmp_path):
    cluster = LocalRedisCluster(free_port, tmp_path / "cluster")
    yield cluster
    cluster.stop()


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def _counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                total += sample.value
    return total


class Proxy:
    """The proxy process and an HTTP client for it."""

    def __init__(self, port: int, http: aiohttp.ClientSession) -> None:
        self.base, self.http = f"http://127.0.0.1:{port}", http

    async def complete(self, session_id: str) -> aiohttp.ClientResponse:
        body = {"model": "stub", "prompt": PROMPT, "max_tokens": 4, "session_id": session_id}
        async with self.http.post(f"{self.base}/v1/completions", json=body) as resp:
            await resp.read()
            return resp

    async def health(self) -> dict:
        async with self.http.get(f"{self.base}/health") as resp:
            assert resp.status == 200, await resp.text()   # a decode engine serves
            return await resp.json()

    async def metrics(self) -> str:
        async with self.http.get(f"{self.base}/metrics") as resp:
            return await resp.text()


async def test_the_proxy_serves_through_a_master_failover_and_recovers(
        own_cluster, free_port, tmp_path):
    keys = RedisKeys(f"t{uuid.uuid4().hex}")
    victim = own_cluster.master_of(keys.engines)
    # The proxy starts from a node that stays up (any node would do while all are).
    entry = next(p for p in own_cluster.ports if p != victim)
    runners, engines = [], []
    for role in ("prefill", "decode"):
        port = free_port()
        runner = web.AppRunner(StubEngine(role).app(), handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        engines.append({"url": f"http://127.0.0.1:{port}", "role": role})
    proxy_port = free_port()
    config = tmp_path / "proxy.json"
    config.write_text(json.dumps({
        "engines": engines, "block_size": 16,
        "routing": {"params": {"decode_only_max_uncached_tokens": -1}},   # P then D
        "index": {"backend": "redis", "redis_url": f"redis+cluster://127.0.0.1:{entry}",
                  "redis_namespace": keys.namespace, "redis_timeout_s": 0.25,
                  "redis_failures_to_open": 2, "redis_retry_interval_s": 0.2}}))
    log = open(tmp_path / "proxy.log", "wb")   # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "sessionkv_proxy", "--host", "127.0.0.1",
                             "--port", str(proxy_port), "--config", str(config),
                             "--tokenizer", "none"], stdout=log, stderr=subprocess.STDOUT)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    redis = aioredis.RedisCluster.from_url(f"redis://127.0.0.1:{entry}")
    proxy = Proxy(proxy_port, http)
    try:
        async def listening() -> bool:
            assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
            try:
                return (await proxy.health())["status"] == "ok"
            except aiohttp.ClientConnectionError:
                return False

        await _until(listening, 30, "the proxy to listen")
        health = await proxy.health()
        assert health["redis"]["state"] == "up" and health["redis"]["mode"] == "cluster"
        resp = await proxy.complete("before")
        assert resp.status == 200 and resp.headers["x-sessionkv-route"] == "disaggregated"
        # The session's record went to the cluster, on the victim's slot.
        record_key = keys.session(session_store_key("before", None))
        await _until(lambda: redis.exists(record_key), 10, "the session record in Redis")
        before = await proxy.metrics()

        own_cluster.kill(victim)
        # Every request is served while the slot has no master.
        served, degraded = 0, False
        while not degraded:
            resp = await proxy.complete(f"during-{served}")
            assert resp.status == 200, await resp.text()
            served += 1
            health = await proxy.health()
            degraded = health["redis"]["state"] == "down"
            assert served < 200, "the proxy never noticed the dead master"
        assert health["status"] == "degraded", health
        assert any(p.startswith("redis down") for p in health["problems"]), health
        for i in range(3):   # served from this proxy's own copy, breaker open
            resp = await proxy.complete(f"during-down-{i}")
            assert resp.status == 200
        during = await proxy.metrics()
        assert _counter(during, "sessionkv_proxy_redis_fallbacks_total") > \
            _counter(before, "sessionkv_proxy_redis_fallbacks_total")
        failed = sum(_counter(during, "sessionkv_proxy_errors_total", kind=k)
                     for k in ("redis_error", "redis_timeout"))
        assert failed > sum(_counter(before, "sessionkv_proxy_errors_total", kind=k)
                            for k in ("redis_error", "redis_timeout"))
        assert _counter(during, "sessionkv_proxy_degraded_requests_total",
                        reason="redis_unavailable") >= 3
        assert _counter(during, "sessionkv_proxy_redis_up") == 0

        # The replica takes over the slot; the proxy finds it and re-publishes.
        await asyncio.to_thread(own_cluster.wait_ok, 60.0)
        assert own_cluster.master_of(keys.engines) != victim

        async def recovered() -> bool:
            return (await proxy.health())["status"] == "ok"

        await _until(recovered, 30, "/health to be ok after the failover")
        after = await proxy.metrics()
        assert _counter(after, "sessionkv_proxy_redis_republishes_total") >= 1
        assert _counter(after, "sessionkv_proxy_redis_up") == 1
        # What the proxy saw during the outage is on the new master.
        assert await redis.exists(keys.session(session_store_key("during-down-0", None)))
        degraded_before = _counter(after, "sessionkv_proxy_degraded_requests_total")
        resp = await proxy.complete("after")
        assert resp.status == 200
        assert _counter(await proxy.metrics(), "sessionkv_proxy_degraded_requests_total") \
            == degraded_before   # routed from Redis again
    finally:
        await http.close()
        proc.terminate()
        # Not blocking the loop: the stub engines answer from it while the proxy stops.
        await asyncio.to_thread(proc.wait, 15)
        log.close()
        await redis.aclose()
        for runner in runners:
            await runner.cleanup()


async def test_the_link_asks_the_node_serving_the_deployments_slot(redis_cluster):
    """The probe and the restart check go to that node (PING and INFO would go to
    every node), from a client that has sent nothing yet."""
    import redis as sync_redis

    from sessionkv_proxy.redis_link import RedisLink, make_redis_client

    keys = RedisKeys(f"t{uuid.uuid4().hex}")
    now_s = [0.0]
    link = RedisLink(make_redis_client(redis_cluster.url, max_connections=4, timeout_s=1.0),
                     timeout_s=1.0, home_key=keys.engines, clock=lambda: now_s[0])
    home = sync_redis.Redis(port=redis_cluster.master_of(keys.engines))
    try:
        assert link.cluster and link.health()["mode"] == "cluster"
        assert await link.server_id() == home.info("server")["run_id"]
        link.open_breaker()
        now_s[0] += link.retry_interval_s   # the probe is due
        assert await link.probe()
    finally:
        home.close()
        await link.aclose()
