"""Redis as an accelerator: the link's deadline and breaker, and the index that falls
back to the proxy's own copy, against a real redis-server that each test kills,
stops (SIGSTOP) and restarts on the same port."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from cluster import OwnRedis

from sessionkv_proxy.index import TIER_DEVICE
from sessionkv_proxy.index.fallback import FallbackIndex
from sessionkv_proxy.index.memory import MemoryIndex
from sessionkv_proxy.index.redis import RedisIndex
from sessionkv_proxy.redis_link import LinkState, RedisLink, RedisUnavailable, make_redis_client


@pytest.fixture
def own_redis(free_port, tmp_path):
    server = OwnRedis(free_port(), tmp_path)
    yield server
    server.stop()


async def _until(predicate, timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def fallback(own_redis):
    """(index, link, error kinds) over ``own_redis``, its upkeep running."""
    errors: list[str] = []
    link = RedisLink(make_redis_client(own_redis.url, max_connections=64, timeout_s=0.2),
                     timeout_s=0.2, failures_to_open=2, retry_interval_s=0.1,
                     max_retry_interval_s=0.2, on_error=errors.append)
    remote = RedisIndex(link.client, namespace=f"t{uuid.uuid4().hex}")
    index = FallbackIndex(remote, MemoryIndex(), link, engines=["e1", "e2"])
    upkeep = asyncio.create_task(index.maintain(interval_s=0.05))
    yield index, link, errors
    upkeep.cancel()
    await asyncio.gather(upkeep, return_exceptions=True)
    await index.close()
    await link.aclose()


async def test_a_stopped_redis_costs_one_deadline_then_reads_come_from_the_own_copy(
        own_redis, fallback):
    index, link, errors = fallback
    await index.store("e1", TIER_DEVICE, [(1, 100), (2, 101)])
    await index.put_session("s", b"rec", ttl_s=60)
    assert await index.remote.lookup([100, 101]) == {"e1": {TIER_DEVICE: 2}}
    own_redis.pause()
    started = time.monotonic()
    # Answers come from the proxy's copy, each within the link's deadline.
    assert await index.lookup([100, 101]) == {"e1": {TIER_DEVICE: 2}}
    assert await index.get_session("s") == b"rec"
    assert time.monotonic() - started < 2.0
    assert link.state is LinkState.DOWN and index.degraded
    assert "redis_timeout" in errors
    # While down nothing is sent: calls fail at once.
    started = time.monotonic()
    for _ in range(50):
        assert await index.lookup([100]) == {"e1": {TIER_DEVICE: 1}}
    assert time.monotonic() - started < 0.5
    await index.store("e2", TIER_DEVICE, [(3, 200)])   # written while down
    own_redis.resume()
    await _until(lambda: _up(link), what="the link to close again")
    assert await index.remote.lookup([200]) == {"e2": {TIER_DEVICE: 1}}
    assert index.republishes == 1 and not index.degraded


async def _up(link: RedisLink) -> bool:
    return link.state is LinkState.UP


async def test_a_killed_and_restarted_redis_gets_the_index_and_sessions_back(
        own_redis, fallback):
    index, link, _ = fallback
    await index.store("e1", TIER_DEVICE, [(1, 100), (2, 101)])
    await index.put_session("s", b"rec", ttl_s=60)
    await _until(lambda: _run_id_known(index), what="the run id")
    own_redis.kill()
    # Reads keep answering from the proxy's copy.
    for _ in range(5):
        assert await index.lookup([100, 101]) == {"e1": {TIER_DEVICE: 2}}
    await index.remove("e1", TIER_DEVICE, [2])        # missed by Redis
    await index.put_session("s2", b"rec2", ttl_s=60)   # missed by Redis
    own_redis.start()                                  # empty, same port
    await _until(lambda: _republished(index), what="the re-publish")
    assert link.state is LinkState.UP
    assert await index.remote.lookup([100, 101]) == {"e1": {TIER_DEVICE: 1}}
    assert await index.remote.get_session("s") == b"rec"
    assert await index.remote.get_session("s2") == b"rec2"


async def _run_id_known(index: FallbackIndex) -> bool:
    return index.run_id is not None


async def _republished(index: FallbackIndex) -> bool:
    return index.republishes >= 1 and index.link.state is LinkState.UP


async def test_a_quick_restart_that_no_call_noticed_is_caught_by_its_run_id(
        own_redis, fallback):
    index, link, _ = fallback
    await index.store("e1", TIER_DEVICE, [(1, 100)])
    await _until(lambda: _run_id_known(index), what="the run id")
    own_redis.kill()
    own_redis.start()
    # Pooled connections died with it; the next call retries on a fresh one.
    assert await link.call("ping", link.client.ping)
    await _until(lambda: _republished(index), timeout_s=20.0, what="the re-publish")
    assert await index.remote.lookup([100]) == {"e1": {TIER_DEVICE: 1}}


async def test_the_pool_makes_load_wait_not_fail(own_redis):
    """More concurrent calls than connections: they queue for one (redis-py's
    default pool raised MaxConnectionsError past 100)."""
    link = RedisLink(make_redis_client(own_redis.url, max_connections=4, timeout_s=2.0),
                     timeout_s=2.0)
    try:
        results = await asyncio.gather(*(link.call("ping", link.client.ping)
                                         for _ in range(400)))
        assert all(results) and link.consecutive_failures == 0
    finally:
        await link.aclose()


async def test_the_breaker_opens_only_after_failures_in_a_row(own_redis):
    link = RedisLink(make_redis_client(own_redis.url, max_connections=8, timeout_s=0.1),
                     timeout_s=0.1, failures_to_open=3, retry_interval_s=0.05)
    try:
        own_redis.pause()
        for expected in (LinkState.UP, LinkState.UP, LinkState.DOWN):
            with pytest.raises(RedisUnavailable):
                await link.call("ping", link.client.ping)
            assert link.state is expected
        assert link.health()["state"] == "down" and "ping" in link.health()["last_error"]
        with pytest.raises(RedisUnavailable):  # refused at once, nothing sent
            await link.call("ping", link.client.ping)
        own_redis.resume()
        deadline = time.monotonic() + 10
        while not await link.probe():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert link.state is LinkState.RESYNCING and not link.available
        link.close_breaker()
        assert await link.call("ping", link.client.ping)
    finally:
        own_redis.resume()
        await link.aclose()


async def test_a_routing_read_while_redis_is_down_comes_from_the_own_copy(
        own_redis, fallback):
    """``route_read`` degrades as ``lookup`` and ``get_session`` do: this replica's
    record and entries, no published handle (only Redis holds those)."""
    index, link, _ = fallback
    await index.store("e1", TIER_DEVICE, [(1, 100), (2, 101)])
    await index.put_session("s", b"rec", ttl_s=60)
    await link.client.set(index.remote.keys.handle("s"), b"h", px=60_000)
    read = await index.route_read("s", [100, 101])
    assert (read.record, read.handle, read.matches) == (b"rec", b"h", {"e1": {TIER_DEVICE: 2}})
    own_redis.pause()
    try:
        started = time.monotonic()
        for _ in range(3):
            read = await index.route_read("s", [100, 101], take_handle=True)
            assert (read.record, read.handle, read.handle_taken) == (b"rec", None, False)
            assert read.matches == {"e1": {TIER_DEVICE: 2}}
        assert time.monotonic() - started < 2.0 and index.degraded
        await index.return_handle("s", b"h", 1000)   # dropped, no raise
    finally:
        own_redis.resume()


async def test_a_call_past_its_deadline_is_cut_and_counted_and_the_caller_goes_on():
    """The link's own deadline (twice ``timeout_s``), for a call the client's socket
    timeout does not end: the call is cancelled, counted as a timeout, and the
    calling task (a request) is not left cancelled."""
    errors: list[str] = []
    link = RedisLink(object(), timeout_s=0.05, failures_to_open=5, on_error=errors.append)
    cancelled = asyncio.Event()

    async def hangs() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    started = time.monotonic()
    with pytest.raises(RedisUnavailable):
        await link.call("route_read", hangs)
    assert 0.09 <= time.monotonic() - started < 1.0
    assert cancelled.is_set() and errors == ["redis_timeout"]
    assert link.consecutive_failures == 1 and link.state is LinkState.UP
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0.01)   # not cancelled: it waits as any task does

    async def answers() -> str:
        return "ok"

    assert await link.call("get", answers) == "ok" and link.consecutive_failures == 0
