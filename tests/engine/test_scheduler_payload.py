"""P's reading of a handle: a payload of an unknown protocol version is refused whole,
with its own verdict reason (never a KeyError, never a partial read)."""

from __future__ import annotations

from vllm_sessionkv.scheduling.remote_plan import remote_claim
from vllm_sessionkv.scheduling.request_state import read_payload
from vllm_sessionkv.verification import REFUSAL_REASONS

PARAMS = {"do_remote_decode": True, "remote_num_tokens": 64,
          "sessionkv": {"hash_chain": "", "block_size": 32, "hash_algo": "sha256"}}


def _read(ours: dict):
    # The payload is decoded once per request (read_payload), then read as a claim.
    params = dict(PARAMS, sessionkv=ours)
    read = read_payload(params)
    return remote_claim(params, read.payload, read.refusal, read.error)


def test_known_version_is_read():
    remote, refusal = _read(dict(PARAMS["sessionkv"], version=1))
    assert refusal is None and remote.num_tokens == 64 and remote.block_size == 32


def test_unknown_version_is_refused_by_name():
    remote, refusal = _read(dict(PARAMS["sessionkv"], version=99))
    assert (remote, refusal) == (None, "unsupported_version")
    assert refusal in REFUSAL_REASONS


def test_malformed_payload_is_refused():
    assert _read(dict(PARAMS["sessionkv"], block_size="big")) == (None, "malformed_handle")
    assert _read(dict(PARAMS["sessionkv"], hash_chain="not base64!")) == (
        None, "malformed_handle")


def test_no_chain_is_no_claim():
    assert _read({"session_id": "s"}) == (None, None)
