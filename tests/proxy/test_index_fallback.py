"""The shared index contract against the Redis index with its in-process fallback
(what the proxy runs with ``--redis-url``), on a real redis-server."""

from __future__ import annotations

import uuid

import pytest
from index_contract import IndexContract

from sessionkv_proxy.index.fallback import FallbackIndex
from sessionkv_proxy.index.memory import MemoryIndex
from sessionkv_proxy.index.redis import RedisIndex
from sessionkv_proxy.redis_link import RedisLink, make_redis_client


@pytest.fixture
async def index_factory(any_redis):
    made: list[tuple[FallbackIndex, RedisLink]] = []

    async def make(max_blocks_per_slot: int | None = None) -> FallbackIndex:
        link = RedisLink(make_redis_client(any_redis, max_connections=16, timeout_s=1.0),
                         timeout_s=1.0)
        remote = RedisIndex(link.client, namespace=f"t{uuid.uuid4().hex}",
                            max_blocks_per_slot=max_blocks_per_slot)
        index = FallbackIndex(remote, MemoryIndex(max_blocks_per_slot=max_blocks_per_slot),
                              link)
        made.append((index, link))
        return index

    yield make
    for index, link in made:
        await index.close()
        await link.aclose()


class TestFallbackIndex(IndexContract):
    @pytest.fixture
    def publish_handle(self):
        async def publish(index: FallbackIndex, session_key: str, raw: bytes,
                          ttl_ms: int) -> None:
            await index.link.client.set(index.remote.keys.handle(session_key), raw,
                                        px=ttl_ms)
        return publish


async def test_a_channel_handle_serves_where_redis_holds_none_and_goes_with_redis_one(
        index_factory):
    """Handles from the engines' handle channel live in this replica's copy: used when
    Redis holds none for the session (an engine without redis_url), and dropped when
    Redis hands out its own copy of the turn (one handle, used once)."""
    index = await index_factory()
    index.put_handle("-:s1", b"from-channel", 60_000)
    read = await index.route_read("-:s1", [], take_handle=True)
    assert read.handle == b"from-channel" and read.handle_taken
    assert (await index.route_read("-:s1", [], take_handle=True)).handle is None
    # Given back while Redis answers: to Redis, where every replica finds it.
    await index.return_handle("-:s1", read.handle, read.handle_ttl_ms)
    assert (await index.route_read("-:s1", [])).handle == b"from-channel"

    index.put_handle("-:s2", b"channel-copy", 60_000)
    await index.link.client.set(index.remote.keys.handle("-:s2"), b"redis-copy", px=60_000)
    read = await index.route_read("-:s2", [], take_handle=True)
    assert read.handle == b"redis-copy" and read.handle_taken
    assert index.local.take_handle("-:s2")[0] is None
