"""The session payload and handle: one versioned struct each way, refusals typed."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from vllm_sessionkv.wire import protocol
from vllm_sessionkv.metadata import HostCopy, HostCopyKind, StepInstructions
from vllm_sessionkv.wire.protocol import (
    PROTOCOL_VERSION,
    SESSIONKV_PARAMS_KEY,
    PayloadError,
    SessionPayload,
    TokenAccounting,
    UnsupportedVersion,
    decode_handle,
    decode_payload,
    encode_handle,
    encode_payload,
    handle_from_params,
    payload_from_params,
)

D_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "d0",
    "remote_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": 5600,
    "remote_block_ids": [[3, 4, 5]], "remote_num_tokens": 70,
    SESSIONKV_PARAMS_KEY: {
        "version": PROTOCOL_VERSION, "session_id": "s", "hash_chain": "AAAAAAAAAAA=",
        "tail_token_ids": [7, 8], "block_size": 32, "hash_algo": "sha256",
        "tenant": "t", "num_tokens": 70, "expires_at_unix_s": 1e9,
        "engine_url": "http://d0", "accounting": {"prompt_tokens": 60, "decision": "x"}},
}


def test_all_is_sorted_and_defined():
    assert protocol.__all__ == sorted(protocol.__all__)
    for name in protocol.__all__:
        assert hasattr(protocol, name), name


def test_payload_round_trips_and_always_names_its_version():
    payload = payload_from_params(D_PARAMS)
    assert payload.accounting == TokenAccounting(prompt_tokens=60, decision="x")
    assert payload.tail_token_ids == [7, 8] and payload.tenant == "t"
    assert decode_payload(encode_payload(payload)) == payload
    assert encode_payload(SessionPayload()) == {"version": PROTOCOL_VERSION}
    # No payload at all is an empty one (a stock request).
    assert payload_from_params({"do_remote_decode": True}) == SessionPayload()
    assert payload_from_params(None) == SessionPayload()


def test_unknown_fields_are_accepted():
    raw = {"session_id": "s", "added_by_a_later_minor_change": [1, 2]}
    assert decode_payload(raw) == SessionPayload(session_id="s")


@pytest.mark.parametrize("version", [0, 2, "1", True, None])
def test_an_unknown_payload_version_is_refused_with_a_typed_error(version):
    with pytest.raises(UnsupportedVersion) as err:
        decode_payload({"version": version, "hash_chain": "AAAAAAAAAAA="})
    assert err.value.version == version
    assert isinstance(err.value, PayloadError) and isinstance(err.value, ValueError)
    assert "protocol version" in str(err.value)


def test_a_future_version_is_refused_before_its_fields_are_read():
    # A later version may change a field's type: the refusal names the version, not
    # the field.
    with pytest.raises(UnsupportedVersion):
        decode_payload({"version": 2, "hash_chain": {"algo": "new", "hashes": []}})


def test_a_malformed_payload_names_the_field():
    with pytest.raises(PayloadError, match="first_token_id"):
        decode_payload({"first_token_id": True})
    with pytest.raises(PayloadError):
        decode_payload(["not", "an", "object"])


def test_handle_carries_nixl_params_verbatim_and_the_payload_typed():
    handle = handle_from_params(D_PARAMS)
    assert SESSIONKV_PARAMS_KEY not in handle.nixl_params
    assert handle.nixl_params["remote_block_ids"] == [[3, 4, 5]]
    assert (handle.session_id, handle.tenant, handle.engine_url) == ("s", "t", "http://d0")
    assert handle.expires_at_unix_s == 1e9
    assert decode_handle(encode_handle(handle)) == handle
    assert handle.params() == {**D_PARAMS, SESSIONKV_PARAMS_KEY: encode_payload(
        handle.payload)}


def test_prefill_params_ask_p_to_pull_and_drop_d_s_accounting():
    params = handle_from_params(dict(D_PARAMS, do_remote_decode=False,
                                     do_remote_prefill=True)).prefill_params()
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    ours = params[SESSIONKV_PARAMS_KEY]
    assert "accounting" not in ours and ours["hash_chain"] == "AAAAAAAAAAA="
    assert D_PARAMS[SESSIONKV_PARAMS_KEY]["accounting"]  # the input is not changed


@pytest.mark.parametrize("where", ["handle", "payload"])
def test_an_unknown_handle_version_is_refused(where):
    raw = msgspec.json.decode(encode_handle(handle_from_params(D_PARAMS)))
    (raw if where == "handle" else raw["payload"])["version"] = PROTOCOL_VERSION + 1
    with pytest.raises(UnsupportedVersion):
        decode_handle(msgspec.json.encode(raw))


def test_step_instructions_survive_the_trip_to_the_worker():
    # vLLM pickles the scheduler output (and our instructions on its metadata).
    sent = StepInstructions(
        host_copies=[HostCopy(kind=HostCopyKind.STORE, src=[1, 2], dst=[0, 1]),
                     HostCopy(kind=HostCopyKind.LOAD, src=[0], dst=[9])],
        release_holds={"a"}, sync_loads={"b"}, idle_step=True)
    assert pickle.loads(pickle.dumps(sent)) == sent
