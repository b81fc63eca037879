"""The Redis key layout (``vllm_sessionkv/wire/redis_keys.py``), on one Redis and on a Redis
Cluster: an engine's publisher writes the handle where the proxy's one-script routing
read takes it, and every key the index, the session records and the publisher write
is one of the layout's names, in the deployment's one slot."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from vllm_sessionkv.wire.protocol import HandleWithdrawal, session_store_key
from vllm_sessionkv.publisher import HandlePublisher
from vllm_sessionkv.wire.redis_keys import RedisKeys, parse_redis_url

from sessionkv_proxy.index import TIER_DEVICE, TIER_HOST
from sessionkv_proxy.index.redis import RedisIndex

HANDLE_PARAMS = {"do_remote_decode": True, "remote_engine_id": "d1",
                 "remote_block_ids": [[1]],
                 "sessionkv": {"engine_url": "http://d1", "expires_at_unix_s": 0,
                               "hash_chain": ""}}


def _client(url: str):
    target = parse_redis_url(url)
    return (RedisCluster if target.cluster else aioredis.Redis).from_url(target.url)


async def test_a_published_handle_is_taken_by_the_routing_read(any_redis):
    namespace = f"t{uuid.uuid4().hex}"
    index = RedisIndex.from_url(any_redis, namespace=namespace)
    publisher = HandlePublisher(any_redis, namespace)
    try:
        await index.store("d1", TIER_DEVICE, [(1, 100), (2, 101)])
        assert publisher.publish("s1", HANDLE_PARAMS, ttl_s=60)
        session_key = session_store_key("s1", None)
        deadline = time.monotonic() + 10
        while (read := await index.route_read(session_key, [100, 101],
                                              take_handle=True)).handle is None:
            assert time.monotonic() < deadline, "the published handle never arrived"
            await asyncio.sleep(0.05)
        assert read.handle_taken and 0 < read.handle_ttl_ms <= 60_000
        assert read.matches == {"d1": {TIER_DEVICE: 2}}
        assert publisher.take_failures() == 0
    finally:
        publisher.close()
        await index.close()


async def test_a_withdrawal_and_the_engines_epoch_reach_the_routing_read(any_redis):
    """D's publisher withdraws a hold (its token joins the session's withdrawn set)
    and writes its start-up epoch with each handle; the one-script routing read
    returns both, on one Redis and on a cluster.  Control: before the withdrawal the
    set is empty."""
    namespace = f"t{uuid.uuid4().hex}"
    index = RedisIndex.from_url(any_redis, namespace=namespace)
    publisher = HandlePublisher(any_redis, namespace)
    session_key = session_store_key("s1", None)
    try:
        params = {**HANDLE_PARAMS, "sessionkv": {**HANDLE_PARAMS["sessionkv"],
                                                 "hold_token": 9, "engine_epoch": 1234}}
        assert publisher.publish("s1", params, ttl_s=60)
        deadline = time.monotonic() + 10
        while (read := await index.route_read(session_key, [])).handle is None:
            assert time.monotonic() < deadline, "the published handle never arrived"
            await asyncio.sleep(0.05)
        assert read.withdrawn == set() and read.epochs == {"http://d1": 1234}
        assert publisher.withdraw(HandleWithdrawal(session_id="s1", hold_token=9,
                                                   reason="kv_pressure", ttl_s=60))
        while not (read := await index.route_read(session_key, [])).withdrawn:
            assert time.monotonic() < deadline, "the withdrawal never arrived"
            await asyncio.sleep(0.05)
        assert read.withdrawn == {9} and read.epochs == {"http://d1": 1234}
        assert publisher.take_failures() == 0
    finally:
        publisher.close()
        await index.close()


async def test_every_key_written_is_a_named_key_in_the_deployments_one_slot(any_redis):
    keys = RedisKeys(f"t{uuid.uuid4().hex}")
    index = RedisIndex.from_url(any_redis, namespace=keys.namespace, entry_ttl_s=600)
    publisher = HandlePublisher(any_redis, keys.namespace)
    client = _client(any_redis)
    try:
        await index.store("e1", TIER_DEVICE, [(1, 0xA0), (2, 0xA1)])
        await index.store("e1", TIER_HOST, [(3, 0xA0)])
        await index.put_session(session_store_key("s1", "tenant"), b"rec", ttl_s=60)
        assert publisher.publish("s1", {**HANDLE_PARAMS, "sessionkv": {
            **HANDLE_PARAMS["sessionkv"], "tenant": "tenant", "engine_epoch": 5}},
            ttl_s=60)
        assert publisher.withdraw(HandleWithdrawal(session_id="s1", tenant="tenant",
                                                   hold_token=9, ttl_s=60))
        handle_key = keys.handle(session_store_key("s1", "tenant"))
        withdrawn_key = keys.withdrawn(session_store_key("s1", "tenant"))
        deadline = time.monotonic() + 10
        while not await client.exists(handle_key, withdrawn_key) == 2:
            assert time.monotonic() < deadline, "the published handle never arrived"
            await asyncio.sleep(0.05)
        written = {k.decode() async for k in client.scan_iter(match=keys.prefix + "*")}
        named = {keys.request_key("a0"), keys.request_key("a1"),
                 keys.engine_hashes(TIER_DEVICE, "e1"), keys.lru(TIER_DEVICE, "e1"),
                 keys.engine_hashes(TIER_HOST, "e1"), keys.lru(TIER_HOST, "e1"),
                 keys.tiers("e1"), keys.engines, keys.tick,
                 keys.session(session_store_key("s1", "tenant")), handle_key,
                 withdrawn_key, keys.epochs}
        assert written == named
        assert {key_slot(k.encode()) for k in written} == {key_slot(keys.engines.encode())}
    finally:
        publisher.close()
        await index.close()
        await client.aclose()
