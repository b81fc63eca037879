"""The subscribers' Inbox on real ZMQ sockets: every message received in order
whether it came before or while a receive waited, none buffered outside ZMQ (its
high-water mark still drops), the reader quiet while nothing waits, and nothing
left on the loop after close."""

from __future__ import annotations

import asyncio
import random

import pytest
import zmq
import zmq.asyncio

from sessionkv_proxy.zmq_inbox import Inbox

TOPIC = b"t"


@pytest.fixture
async def pair(free_port):
    """A PUB bound and a subscribed SUB not yet connected (plain sockets of an
    asyncio context, as the subscribers make them); ``make(sndhwm, rcvhwm)``."""
    ctx = zmq.asyncio.Context()
    made = []

    def make(sndhwm: int = 1000, rcvhwm: int = 1000):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        pub = ctx.socket(zmq.PUB, socket_class=zmq.Socket)
        pub.setsockopt(zmq.SNDHWM, sndhwm)   # before bind: a listener keeps its options
        pub.bind(endpoint)
        sub = ctx.socket(zmq.SUB, socket_class=zmq.Socket)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.setsockopt(zmq.RCVHWM, rcvhwm)
        made.extend((pub, sub))
        return pub, sub, endpoint

    yield make
    for sock in made:
        if not sock.closed:
            sock.close(linger=0)
    ctx.term()


async def _connected(pub, inbox) -> None:
    """Publish probes until one arrives (a SUB drops what came before its
    subscription reached the PUB), then drain them."""
    for _ in range(200):
        pub.send_multipart([TOPIC, b"probe"])
        try:
            await asyncio.wait_for(inbox.recv_multipart(), 0.05)
            break
        except asyncio.TimeoutError:
            continue
    else:
        raise AssertionError("SUB never connected")
    await asyncio.sleep(0.05)
    while inbox._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        await inbox.recv_multipart()


async def test_messages_come_in_order_whether_sent_before_or_while_a_receive_waits(pair):
    pub, sub, endpoint = pair()
    sub.connect(endpoint)
    inbox = Inbox(sub)
    try:
        await _connected(pub, inbox)
        rng = random.Random(0)
        sent = 0

        async def publish() -> None:
            nonlocal sent
            for burst in range(60):
                for _ in range(rng.choice([1, 1, 2, 7])):
                    pub.send_multipart([TOPIC, str(sent).encode(), b"x" * rng.randrange(2000)])
                    sent += 1
                await asyncio.sleep(rng.choice([0, 0.001, 0.003]))

        publisher = asyncio.create_task(publish())
        got = []
        while not publisher.done() or len(got) < sent:
            frames = await asyncio.wait_for(inbox.recv_multipart(), 5)
            assert frames[0] == TOPIC and len(frames) == 3
            got.append(int(frames[1]))
            if rng.random() < 0.2:   # a slow consumer: the signals come with no waiter
                await asyncio.sleep(0.002)
        assert got == list(range(sent)) and sent > 100
    finally:
        inbox.close()


async def test_messages_wait_in_zmq_under_its_high_water_mark(pair):
    pub, sub, endpoint = pair(sndhwm=10, rcvhwm=10)
    sub.connect(endpoint)
    inbox = Inbox(sub)
    try:
        await _connected(pub, inbox)
        # No receive waits, but the loop runs between sends, slower than ZMQ
        # delivers: a reader that moved messages out of ZMQ would keep its queues
        # empty and get them all.
        for i in range(600):
            pub.send_multipart([TOPIC, str(i).encode(), b"x" * 20_000])
            await asyncio.sleep(0.0005)
        await asyncio.sleep(0.3)
        got = []
        while True:
            try:
                got.append(int((await asyncio.wait_for(inbox.recv_multipart(), 0.3))[1]))
            except asyncio.TimeoutError:
                break
        # ZMQ dropped what its queues (and the kernel's) could not hold.
        assert got == sorted(got) and 0 < len(got) < 600, (len(got), got[:12])
    finally:
        inbox.close()


async def test_the_reader_is_quiet_while_nothing_waits(pair):
    pub, sub, endpoint = pair()
    sub.connect(endpoint)
    inbox = Inbox(sub)
    calls = 0
    signalled = inbox._signalled

    def counting() -> None:
        nonlocal calls
        calls += 1
        signalled()

    loop = asyncio.get_running_loop()
    loop.remove_reader(inbox._fd)
    loop.add_reader(inbox._fd, counting)
    try:
        await _connected(pub, inbox)
        calls = 0
        for i in range(3):
            pub.send_multipart([TOPIC, str(i).encode(), b""])
        await asyncio.sleep(0.2)   # messages pending, no receive waiting
        assert calls <= 6, calls   # a signal or two per message, not a busy loop
        assert [int((await inbox.recv_multipart())[1]) for _ in range(3)] == [0, 1, 2]
    finally:
        inbox.close()


async def test_close_takes_the_reader_off_the_loop_after_a_cancelled_receive(pair):
    pub, sub, endpoint = pair()
    sub.connect(endpoint)
    inbox = Inbox(sub)
    fd = inbox._fd
    receive = asyncio.create_task(inbox.recv_multipart())
    await asyncio.sleep(0.05)
    receive.cancel()
    with pytest.raises(asyncio.CancelledError):
        await receive
    assert inbox._waiter is None
    inbox.close()
    assert sub.closed
    assert not asyncio.get_running_loop().remove_reader(fd)   # none was left
