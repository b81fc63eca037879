"""D's early-decode inbox and the proxy's sender, over real ZMQ sockets."""

from __future__ import annotations

import socket
import time

import pytest
import zmq

from vllm_sessionkv.config import ConfigError, parse_config
from vllm_sessionkv.early_decode import EarlyDecodeInbox, Outcome
from vllm_sessionkv.wire.early_decode import EarlyDecodeSender, new_early_decode_id
from vllm_sessionkv.wire.protocol import PrefillDone, decode_prefill_done, encode_prefill_done

P_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[3, 4]],
            "remote_engine_id": "p0", "remote_host": "127.0.0.1", "remote_port": 5555,
            "sessionkv": {"hash_chain": "abc", "block_size": 32}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pair():
    """An inbox on a fresh port with a fake clock, and a connected sender."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    clock = _Clock()
    inbox = EarlyDecodeInbox(endpoint, timeout_s=30.0, clock=clock)
    sender = EarlyDecodeSender([endpoint])
    # IMMEDIATE: a send succeeds only once the connection is up.
    deadline = time.monotonic() + 5
    while not sender.send(endpoint, "warm-up", None):
        assert time.monotonic() < deadline, "sender never connected"
        time.sleep(0.01)
    _poll_until(inbox, "warm-up", Outcome.PREFILL_FAILED)
    yield inbox, sender, endpoint, clock
    sender.close()
    inbox.close()


def _poll_until(inbox: EarlyDecodeInbox, early_id: str, want: Outcome,
                timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        outcome, params, waited = inbox.poll(early_id)
        if outcome is want:
            return params, waited
        assert outcome is Outcome.WAITING, outcome
        assert time.monotonic() < deadline, f"{early_id} never became {want}"
        time.sleep(0.005)


def test_message_round_trips():
    raw = encode_prefill_done(PrefillDone(early_decode_id="x", kv_transfer_params=P_PARAMS))
    assert decode_prefill_done(raw) == PrefillDone(early_decode_id="x",
                                                   kv_transfer_params=P_PARAMS)


def test_request_waits_until_params_arrive(pair):
    inbox, sender, endpoint, clock = pair
    early_id = new_early_decode_id()
    assert inbox.poll(early_id)[0] is Outcome.WAITING
    assert inbox.waiting == 1
    clock.now += 0.25
    assert sender.send(endpoint, early_id, P_PARAMS)
    params, waited = _poll_until(inbox, early_id, Outcome.READY)
    assert params == P_PARAMS
    assert waited == pytest.approx(0.25)
    assert inbox.waiting == 0
    # Claimed once: the id is gone.
    assert inbox.poll(early_id)[0] is Outcome.WAITING


def test_params_that_arrive_before_the_request_are_kept(pair):
    inbox, sender, endpoint, _ = pair
    early_id = new_early_decode_id()
    assert sender.send(endpoint, early_id, P_PARAMS)
    assert inbox.wait(5.0), "the params never reached the inbox"
    params, waited = _poll_until(inbox, early_id, Outcome.READY)
    assert params == P_PARAMS and waited == 0.0


def test_prefill_failure_lets_d_compute(pair):
    inbox, sender, endpoint, _ = pair
    early_id = new_early_decode_id()
    inbox.poll(early_id)
    assert sender.send(endpoint, early_id, None)
    params, _ = _poll_until(inbox, early_id, Outcome.PREFILL_FAILED)
    assert params is None


def test_request_times_out_when_nothing_comes(pair):
    inbox, _, _, clock = pair
    early_id = new_early_decode_id()
    assert inbox.poll(early_id)[0] is Outcome.WAITING
    clock.now += 29.9
    assert inbox.poll(early_id)[0] is Outcome.WAITING
    clock.now += 0.2
    outcome, params, waited = inbox.poll(early_id)
    assert outcome is Outcome.TIMED_OUT and params is None and waited >= 30.0
    assert inbox.waiting == 0


def test_unclaimed_params_expire_and_aborted_requests_are_forgotten(pair):
    inbox, sender, endpoint, clock = pair
    orphan, aborted = new_early_decode_id(), new_early_decode_id()
    assert sender.send(endpoint, orphan, P_PARAMS)
    deadline = time.monotonic() + 5
    while orphan not in inbox._arrived:
        inbox.poll(aborted)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    inbox.forget(aborted)
    assert inbox.waiting == 0
    clock.now += 31
    inbox.poll("someone-else")
    assert orphan not in inbox._arrived


def test_params_for_a_held_request_wait_for_it_however_late_it_is_polled(pair):
    """Under KV pressure D's scheduler may not reach a held request for minutes
    (a run of chat_pressure, 2026-12-06: polled at 23:52:33, P's push at ~23:52:40,
    polled again at 23:56:42).  The push must still be there: expiring it with the
    unclaimed ones turned a READY into TIMED_OUT (waited_ms=248595) for a P that had
    answered and pushed."""
    inbox, sender, endpoint, clock = pair
    held = new_early_decode_id()
    assert inbox.poll(held)[0] is Outcome.WAITING
    clock.now += 7
    assert sender.send(endpoint, held, P_PARAMS)
    deadline = time.monotonic() + 5
    while held not in inbox._arrived:     # read while the scheduler polls another
        inbox.poll("someone-else")
        assert time.monotonic() < deadline
        time.sleep(0.005)
    inbox.forget("someone-else")
    clock.now += 240                      # far past timeout_s (30) since it arrived
    inbox.poll("yet-another")             # a drain in between expires nothing held
    outcome, params, waited = inbox.poll(held)
    assert outcome is Outcome.READY and params == P_PARAMS
    assert waited == pytest.approx(247)
    assert inbox.waiting == 1             # only "yet-another" is still held


def test_malformed_messages_are_dropped(pair):
    inbox, _, endpoint, _ = pair
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(endpoint)
    push.send(b"not json")
    push.send(b'{"kv_transfer_params": {}}')   # no id
    deadline = time.monotonic() + 5
    while inbox.refused["malformed"] < 2:
        inbox.poll("x")
        assert time.monotonic() < deadline
        time.sleep(0.005)
    push.close()
    ctx.term()


def test_sender_reports_an_endpoint_it_cannot_reach():
    endpoint = f"tcp://127.0.0.1:{_free_port()}"   # nobody listens
    sender = EarlyDecodeSender([endpoint])
    try:
        assert not sender.send(endpoint, "x", P_PARAMS)
        assert not sender.send("tcp://127.0.0.1:1", "x", P_PARAMS)   # not configured
    finally:
        sender.close()


def test_sender_says_when_a_connection_is_up():
    """``connected`` (the proxy waits on it at start-up) is false while nobody
    listens, and turns true once D's inbox is bound, with no send needed."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sender = EarlyDecodeSender([endpoint])
    inbox = None
    try:
        assert not sender.connected(endpoint)
        assert not sender.connected("tcp://127.0.0.1:1")   # not configured
        inbox = EarlyDecodeInbox(endpoint, timeout_s=1.0)
        deadline = time.monotonic() + 5
        while not sender.connected(endpoint):
            assert time.monotonic() < deadline, "never connected"
            time.sleep(0.01)
        assert sender.send(endpoint, "x", P_PARAMS)
    finally:
        sender.close()
        if inbox is not None:
            inbox.close()


def test_bind_failure_names_the_key():
    port = _free_port()
    first = EarlyDecodeInbox(f"tcp://127.0.0.1:{port}", timeout_s=1.0)
    try:
        with pytest.raises(ValueError, match="early_decode_port"):
            EarlyDecodeInbox(f"tcp://127.0.0.1:{port}", timeout_s=1.0)
    finally:
        first.close()


@pytest.mark.parametrize("bad, key", [({"early_decode_port": 70000}, "early_decode_port"),
                                      ({"early_decode_timeout_s": 0},
                                       "early_decode_timeout_s")])
def test_connector_config_refuses_bad_values(bad, key):
    with pytest.raises(ConfigError, match=key):
        parse_config({"sessionkv": bad})


def test_proxy_engine_spec_takes_the_early_decode_endpoint():
    from sessionkv_proxy.config import ConfigError as ProxyConfigError
    from sessionkv_proxy.config import Role, load_config, parse_engine_spec

    decode = parse_engine_spec("url=http://127.0.0.1:8200,early=tcp://127.0.0.1:5620",
                               Role.DECODE)
    prefill = parse_engine_spec("http://127.0.0.1:8100", Role.PREFILL)
    config = load_config(None, {"engines": [prefill, decode]})
    assert config.decode[0].early_decode == "tcp://127.0.0.1:5620"
    with pytest.raises(ProxyConfigError, match="early_decode"):
        load_config(None, {"engines": [dict(prefill, early_decode="tcp://127.0.0.1:1"),
                                       decode]})
    with pytest.raises(ProxyConfigError, match="early_decode"):
        load_config(None, {"engines": [prefill, dict(decode, early_decode="127.0.0.1:1")]})


def test_wait_returns_for_a_message_or_one_already_read(pair):
    inbox, sender, endpoint, _ = pair
    held, other = new_early_decode_id(), new_early_decode_id()
    assert inbox.poll(held)[0] is Outcome.WAITING
    assert inbox.poll(other)[0] is Outcome.WAITING
    started = time.monotonic()
    assert not inbox.wait(0.05)
    assert time.monotonic() - started >= 0.04
    assert sender.send(endpoint, held, P_PARAMS)
    assert inbox.wait(5.0)
    # Read while polling another request: still reported, without blocking.
    assert inbox.poll(other)[0] is Outcome.WAITING
    started = time.monotonic()
    assert inbox.wait(1.0) and time.monotonic() - started < 0.5
    assert inbox.poll(held)[0] is Outcome.READY


def test_sender_connects_ahead_so_a_later_send_goes_out():
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    inbox = EarlyDecodeInbox(endpoint, timeout_s=5.0)
    sender = EarlyDecodeSender()   # P: learns D's endpoint from a request
    try:
        sender.connect(endpoint)
        time.sleep(0.2)            # P prefills meanwhile
        early_id = new_early_decode_id()
        assert sender.send(endpoint, early_id, P_PARAMS)
        params, _ = _poll_until(inbox, early_id, Outcome.READY)
        assert params == P_PARAMS
        assert not sender.send(endpoint, "x", {"not": object()})   # unencodable: refused
    finally:
        sender.close()
        inbox.close()


SECRET = "s3cret-shared-by-proxy-and-engines"
FORGED = {"do_remote_prefill": True, "remote_block_ids": [[66, 67]],
          "remote_engine_id": "attacker", "remote_host": "10.6.6.6", "remote_port": 6666}


def _wait_refused(inbox: EarlyDecodeInbox, early_id: str, want: int) -> None:
    """Poll ``early_id`` (it must stay waiting) until ``want`` messages were refused."""
    deadline = time.monotonic() + 5
    while inbox.refused["unauthenticated"] < want:
        assert inbox.poll(early_id)[0] is Outcome.WAITING
        assert time.monotonic() < deadline, f"refused {inbox.refused}, want {want}"
        time.sleep(0.005)


def _forgers(endpoint: str, early_id: str) -> tuple[zmq.Context, list]:
    """Three unauthenticated senders' forged ``PrefillDone`` for ``early_id``: bare
    (no MAC), with a MAC under another secret, with a MAC of the wrong length."""
    forged = encode_prefill_done(PrefillDone(early_decode_id=early_id,
                                             kv_transfer_params=FORGED))
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(endpoint)
    push.send(forged)
    push.send_multipart([forged, b"\0" * 7])
    wrong = EarlyDecodeSender([endpoint], secret="not-the-shared-secret")
    deadline = time.monotonic() + 5
    while not wrong.send(endpoint, early_id, FORGED):
        assert time.monotonic() < deadline, "the forger never connected"
        time.sleep(0.01)
    return ctx, [push, wrong]


def _close_forgers(ctx: zmq.Context, forgers: list) -> None:
    for forger in forgers:
        forger.close()
    ctx.term()


def test_a_forged_prefill_done_is_refused_and_the_authentic_one_taken():
    """Issue 49 must-show 4: on D's real inbox over real ZMQ, with a side_port_secret,
    a PrefillDone from a sender without the secret (bare, or signed with another
    secret) is dropped and counted, and the request keeps waiting; P's authenticated
    one then attaches P's parameters.  Control: the same bare forgery on an inbox
    without a secret is taken, so the test would see a forgery that got through."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    inbox = EarlyDecodeInbox(endpoint, timeout_s=30.0, secret=SECRET)
    genuine = EarlyDecodeSender([endpoint], secret=SECRET)
    early_id = new_early_decode_id()
    ctx, forgers = _forgers(endpoint, early_id)
    try:
        _wait_refused(inbox, early_id, 3)
        assert inbox.take_refused() == {"unauthenticated": 3, "malformed": 0}
        assert inbox.take_refused() == {"unauthenticated": 0, "malformed": 0}
        deadline = time.monotonic() + 5
        while not genuine.send(endpoint, early_id, P_PARAMS):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        params, _ = _poll_until(inbox, early_id, Outcome.READY)
        assert params == P_PARAMS
    finally:
        _close_forgers(ctx, forgers)
        genuine.close()
        inbox.close()

    # The control: no secret, and the bare forgery attaches the attacker's blocks.
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    open_inbox = EarlyDecodeInbox(endpoint, timeout_s=30.0)
    victim = new_early_decode_id()
    ctx, forgers = _forgers(endpoint, victim)
    try:
        params, _ = _poll_until(open_inbox, victim, Outcome.READY)
        assert params == FORGED
    finally:
        _close_forgers(ctx, forgers)
        open_inbox.close()


def test_the_secret_is_validated_and_read_from_the_environment(monkeypatch):
    with pytest.raises(ConfigError, match="side_port_secret"):
        parse_config({"sessionkv": {"side_port_secret": "short"}})
    monkeypatch.setenv("SESSIONKV_SIDE_PORT_SECRET", SECRET)
    assert parse_config({}).side_port_secret == SECRET
    assert parse_config({"sessionkv": {"side_port_secret": "x" * 16}}).side_port_secret \
        == "x" * 16
    monkeypatch.setenv("SESSIONKV_SIDE_PORT_SECRET", "short")
    with pytest.raises(ConfigError, match="side_port_secret"):
        parse_config({})
