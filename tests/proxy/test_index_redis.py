"""The shared index contract against the Redis backend (a real redis-server)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from index_contract import IndexContract

from sessionkv_proxy.index import TIER_DEVICE, TIER_HOST
from sessionkv_proxy.index.redis import RedisIndex


@pytest.fixture
async def index_factory(any_redis):
    made: list[RedisIndex] = []

    async def make(max_blocks_per_slot: int | None = None, **kwargs) -> RedisIndex:
        # A namespace per test keeps tests apart on the shared server.
        namespace = kwargs.pop("namespace", None) or f"t{uuid.uuid4().hex}"
        index = RedisIndex.from_url(any_redis, namespace=namespace,
                                    max_blocks_per_slot=max_blocks_per_slot, **kwargs)
        made.append(index)
        return index

    yield make
    for index in made:
        await index.close()


class TestRedisIndex(IndexContract):
    @pytest.fixture
    def publish_handle(self):
        async def publish(index: RedisIndex, session_key: str, raw: bytes,
                          ttl_ms: int) -> None:
            await index._client.set(index.keys.handle(session_key), raw, px=ttl_ms)
        return publish


async def test_replicas_sharing_a_namespace_see_each_others_writes(index_factory):
    writer = await index_factory(namespace="shared-replicas")
    reader = await index_factory(namespace="shared-replicas")
    other = await index_factory(namespace="someone-else")
    await writer.store("a", TIER_DEVICE, [(1, 100), (2, 101)])
    await writer.put_session("s", b"handle", ttl_s=30)
    assert await reader.lookup([100, 101]) == {"a": {TIER_DEVICE: 2}}
    assert await reader.get_session("s") == b"handle"
    assert await other.lookup([100, 101]) == {}
    await reader.clear("a")
    assert await writer.size() == 0


async def test_entry_ttl_expires_blocks_that_are_not_restored(index_factory):
    index = await index_factory(entry_ttl_s=1)
    await index.store("a", TIER_HOST, [(1, 100), (2, 101)])
    assert await index.lookup([100, 101]) == {"a": {TIER_HOST: 2}}
    deadline = time.monotonic() + 10
    while await index.lookup([100, 101]) != {}:   # until the 1 s ttl has run out
        assert time.monotonic() < deadline, "blocks outlived their entry ttl"
        await asyncio.sleep(0.05)
    assert await index.size() == 0
    # Storing again after expiry brings the blocks back.
    await index.store("a", TIER_HOST, [(1, 100)])
    assert await index.lookup([100, 101]) == {"a": {TIER_HOST: 1}}


async def test_bad_configuration_is_refused(redis_server):
    with pytest.raises(ValueError):
        RedisIndex.from_url(redis_server, namespace="{bad}")
    with pytest.raises(ValueError):
        RedisIndex.from_url(redis_server, max_blocks_per_slot=0)
