"""The handle channel: D's end-of-turn handles over real ZMQ into the proxy's index.

The engine side's real ``HandleChannel`` (PUB) and the proxy's ``HandleSubscribers``
(SUB) on loopback, the handle landing where ``route_read`` hands it out.  The
end-to-end test on real engines (a streamed chat session pulling from D with no
Redis) is ``tests/e2e/test_streamed_handles.py``.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sessionkv_proxy.handle_subscriber import HandleSubscriber, HandleSubscribers
from sessionkv_proxy.index.memory import MemoryIndex
from vllm_sessionkv.config import ConfigError, parse_config
from vllm_sessionkv.handle_channel import HandleChannel
from vllm_sessionkv.wire.handle_channel import encode_frames
from vllm_sessionkv.wire.protocol import (
    SessionPayload,
    encode_handle,
    handle_from_params,
    session_store_key,
    with_payload,
)


def d_params(session_id: str | None, lease_s: float = 60.0, tenant: str | None = None
             ) -> dict:
    """D's end-of-turn kv_transfer_params, as the scheduler exports them."""
    nixl = {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "d0",
            "remote_host": "127.0.0.1", "remote_port": 5600, "remote_num_tokens": 80}
    return with_payload(nixl, SessionPayload(
        session_id=session_id, tenant=tenant, hash_chain="AAAAAAAAAAA=", block_size=32,
        hash_algo="sha256", num_tokens=80, expires_at_unix_s=time.time() + lease_s,
        hold_token=7))


def raw_handle(session_id: str | None, **kwargs) -> bytes:
    return encode_handle(handle_from_params(d_params(session_id, **kwargs)))


async def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_handle_sent_by_d_is_handed_out_once_by_the_routing_read():
    channel = HandleChannel("tcp://127.0.0.1:*")
    index = MemoryIndex()
    subscribers = HandleSubscribers({"http://d0": channel.endpoint}, index)
    subscribers.start()
    sub = subscribers.subscribers["http://d0"]
    try:
        # A SUB socket takes messages only once its connection is up (ZMQ's slow
        # joiner): send until the first one lands, as D's turns would.
        async def first_arrival():
            while not sub.stats.received:
                assert channel.publish(d_params("warm-up"))
                await asyncio.sleep(0.01)
        await asyncio.wait_for(first_arrival(), 10.0)
        received = sub.stats.received
        assert channel.publish(d_params("s1", tenant="acme"))
        await wait_for(lambda: sub.stats.received > received, "the handle")
        key = session_store_key("s1", "acme")
        read = await index.route_read(key, [], take_handle=True)
        assert read.handle_taken and 0 < read.handle_ttl_ms <= 60_000
        handle = msgspec.json.decode(read.handle)
        assert handle["payload"]["session_id"] == "s1"
        assert handle["nixl_params"]["remote_block_ids"] == [[1, 2, 3]]
        # Single use: the next read finds none; another tenant's key never had it.
        assert (await index.route_read(key, [], take_handle=True)).handle is None
        assert (await index.route_read(session_store_key("s1", None), [])).handle is None
        report, problems = subscribers.health()
        assert report["http://d0"]["stored"] == sub.stats.received
        assert report["http://d0"].get("lost", 0) == 0 and problems == []
        registry = CollectorRegistry()
        registry.register(subscribers.collector())
        text = generate_latest(registry).decode()
        assert ('sessionkv_proxy_channel_handles_total{engine="http://d0",outcome="stored"} '
                f'{float(sub.stats.received)}') in text
    finally:
        await subscribers.stop()
        channel.close()


def test_every_message_gets_one_outcome_and_gaps_count_as_lost():
    now = time.time()
    index = MemoryIndex(max_handles=1)
    sub = HandleSubscriber("d0", "tcp://127.0.0.1:1", index, clock=lambda: now)
    assert sub.receive(encode_frames(0, raw_handle("a"))) == "stored"
    assert sub.receive(encode_frames(3, raw_handle("b"))) == "stored"   # 1 and 2 lost
    assert sub.stats.outcomes["lost"] == 2
    assert sub.stats.outcomes["evicted"] == 1                          # bound of one
    assert sub.receive(encode_frames(0, raw_handle("c"))) == "stored"   # D restarted
    assert sub.stats.publisher_restarts == 1 and sub.stats.outcomes["lost"] == 2
    assert sub.receive(encode_frames(1, b"{not json")) == "undecodable"
    assert sub.receive([b"other-topic", b"x"]) == "undecodable"
    assert sub.receive(encode_frames(2, raw_handle(None))) == "no_session"
    assert sub.receive(encode_frames(3, raw_handle("d", lease_s=-1.0))) == "expired"
    newer = msgspec.json.decode(raw_handle("e"))
    newer["version"] = 99
    assert sub.receive(encode_frames(4, msgspec.json.encode(newer))) == \
        "unsupported_version"
    assert sub.stats.received == 8
    assert sum(n for k, n in sub.stats.outcomes.items() if k not in ("lost", "evicted")) == 8


def test_with_a_secret_only_handles_with_a_valid_mac_are_kept():
    """A process that takes over D's address (or a D without the secret) cannot feed
    the proxy handles: unsigned or wrongly signed messages are counted
    ``unauthenticated`` and kept nowhere.  Control: the same frames signed are kept."""
    secret = b"s3cret-shared-by-proxy-and-engines"
    now = time.time()
    index = MemoryIndex()
    sub = HandleSubscriber("d0", "tcp://127.0.0.1:1", index, clock=lambda: now,
                           secret=secret.decode())
    assert sub.receive(encode_frames(0, raw_handle("a"))) == "unauthenticated"
    assert sub.receive(encode_frames(1, raw_handle("a"), b"another-secret-16+")) == \
        "unauthenticated"
    signed = encode_frames(2, raw_handle("a"), secret)
    assert sub.receive(signed[:2] + [raw_handle("b")] + signed[3:]) == "unauthenticated"
    assert sub.receive(signed) == "stored"
    assert sub.stats.outcomes["unauthenticated"] == 3
    # A withdrawal's MAC covers its topic: a handle's MAC does not pass for one.
    from vllm_sessionkv.wire.handle_channel import WITHDRAW_TOPIC
    from vllm_sessionkv.wire.protocol import HandleWithdrawal, encode_withdrawal
    body = encode_withdrawal(HandleWithdrawal(session_id="a", hold_token=7, ttl_s=60.0))
    forged = encode_frames(3, body, secret)
    assert sub.receive([WITHDRAW_TOPIC] + forged[1:]) == "unauthenticated"
    assert sub.receive(encode_frames(4, body, secret, WITHDRAW_TOPIC)) == "withdrawn"
    # No secret: a signed message is read as before (its MAC ignored).
    plain = HandleSubscriber("d0", "tcp://127.0.0.1:1", MemoryIndex(), clock=lambda: now)
    assert plain.receive(encode_frames(0, raw_handle("a"), secret)) == "stored"


async def test_a_signing_channel_reaches_a_subscriber_with_the_secret():
    secret = "s3cret-shared-by-proxy-and-engines"
    channel = HandleChannel("tcp://127.0.0.1:*", secret)
    index = MemoryIndex()
    subscribers = HandleSubscribers({"http://d0": channel.endpoint}, index, secret)
    subscribers.start()
    sub = subscribers.subscribers["http://d0"]
    try:
        async def first_arrival():
            while not sub.stats.outcomes.get("stored"):
                assert channel.publish(d_params("s1"))
                await asyncio.sleep(0.01)
        await asyncio.wait_for(first_arrival(), 10.0)
        assert sub.stats.outcomes.get("unauthenticated", 0) == 0
        read = await index.route_read(session_store_key("s1", None), [], take_handle=True)
        assert read.handle_taken
    finally:
        await subscribers.stop()
        channel.close()


def test_subscribers_need_an_index_that_keeps_handles():
    class NoHandles:
        pass

    with pytest.raises(TypeError, match="PublishedHandles"):
        HandleSubscribers({"d0": "tcp://127.0.0.1:1"}, NoHandles())


def test_a_taken_port_stops_the_engine_naming_the_address():
    first = HandleChannel("tcp://127.0.0.1:*")
    try:
        with pytest.raises(ValueError, match="handle_channel_port: cannot bind"):
            HandleChannel(first.endpoint)
    finally:
        first.close()


@pytest.mark.parametrize("raw, key", [
    ({"handle_channel_port": 70000}, "handle_channel_port"),
    ({"handle_channel_port": 5000, "early_decode_port": 5000}, "handle_channel_port"),
    ({"handle_channel_bind_host": "localhost"}, "handle_channel_bind_host"),
])
def test_bad_channel_settings_stop_the_engine_at_start_up(raw, key):
    with pytest.raises(ConfigError, match=key):
        parse_config({"sessionkv": raw})


async def test_a_withdrawal_from_d_drops_the_handle_and_no_copy_of_it_is_attached():
    """D ends a hold before its lease and withdraws the handle on its channel (real
    ZMQ): the channel's copy goes, and the routing read names the hold's token, so a
    copy elsewhere (a session record) is judged dead too.  A later start of the same
    engine (its epoch in a handle) kills every older handle of it.  Control: a handle
    neither withdrawn nor outlived is usable."""
    from vllm_sessionkv.wire.protocol import HandleWithdrawal, decode_handle, handle_is_dead

    channel = HandleChannel("tcp://127.0.0.1:*")
    index = MemoryIndex()
    subscribers = HandleSubscribers({"http://d0": channel.endpoint}, index)
    subscribers.start()
    sub = subscribers.subscribers["http://d0"]
    key = session_store_key("s1", None)
    try:
        def params(session_id: str, token: int, epoch: int) -> dict:
            out = d_params(session_id)
            out["sessionkv"].update(hold_token=token, engine_url="http://d0",
                                    engine_epoch=epoch)
            return out

        # A subscriber misses what is sent before it joined: send until one lands.
        while sub.stats.outcomes.get("stored", 0) == 0:
            channel.publish(params("s1", 11, 100))
            await asyncio.sleep(0.05)
        read = await index.route_read(key, [])
        handle = decode_handle(read.handle)
        assert handle_is_dead(handle, read.withdrawn, read.epochs) is None   # control
        assert read.epochs == {"http://d0": 100}

        assert channel.withdraw(HandleWithdrawal(
            session_id="s1", hold_token=11, reason="kv_pressure", engine_url="http://d0",
            engine_epoch=100, ttl_s=60.0))
        await wait_for(lambda: sub.stats.outcomes.get("withdrawn") == 1, "the withdrawal")
        read = await index.route_read(key, [], take_handle=True)
        assert read.handle is None and read.withdrawn == {11}
        assert handle_is_dead(handle, read.withdrawn, read.epochs) == "withdrawn"

        # Another session's handle from a restarted D (a later epoch).
        other = decode_handle(encode_handle(handle_from_params(params("s2", 12, 100))))
        channel.publish(params("s3", 13, 200))
        await wait_for(lambda: sub.stats.outcomes.get("stored") == 2, "the new handle")
        read = await index.route_read(session_store_key("s2", None), [])
        assert read.epochs == {"http://d0": 200}
        assert handle_is_dead(other, read.withdrawn, read.epochs) == "engine_restarted"
        fresh = decode_handle((await index.route_read(session_store_key("s3", None),
                                                      [])).handle)
        assert handle_is_dead(fresh, read.withdrawn, read.epochs) is None
        assert sub.stats.outcomes.get("lost", 0) == 0
    finally:
        await subscribers.stop()
        channel.close()
