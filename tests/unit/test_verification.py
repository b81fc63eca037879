"""Verification on plain data: how much remote KV may be attached to a prompt."""

from __future__ import annotations

import pytest

from vllm_sessionkv.wire.hashing import engine_block_hashes
from vllm_sessionkv.verification import LocalPrompt, RemoteKV, verify_remote_kv

B = 32


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 17) % 1000 + 10 for i in range(n)]


def _remote(seq: list[int], num_tokens: int | None = None, tenant=None, **kw) -> RemoteKV:
    """What D would export after holding KV for ``seq[:num_tokens]``."""
    n = len(seq) if num_tokens is None else num_tokens
    full = n // B
    return RemoteKV(num_tokens=n, block_size=B, hash_algo="sha256",
                    chain=engine_block_hashes(seq[:full * B], B),
                    tail_token_ids=seq[full * B:n], tenant=tenant, **kw)


def _local(prompt: list[int], tenant=None, max_loadable=None) -> LocalPrompt:
    return LocalPrompt(prompt_token_ids=prompt, block_hashes=engine_block_hashes(prompt, B),
                       block_size=B, hash_algo="sha256", tenant=tenant,
                       max_loadable_tokens=max_loadable)


def test_identical_history_verifies_fully_including_partial_tail():
    seq = _tokens(200)                    # 6 full blocks + 8 tokens
    prompt = seq + _tokens(50, seed=9)    # next turn extends it
    v = verify_remote_kv(_local(prompt), _remote(seq))
    assert (v.verified_tokens, v.refused_tokens, v.reason) == (200, 0, "ok")


def test_prompt_shorter_than_remote_is_capped_not_shifted():
    seq = _tokens(320)
    prompt = seq[:250]
    v = verify_remote_kv(_local(prompt, max_loadable=249), _remote(seq))
    # The prompt's 7 full blocks verify; its 26-token partial block lies inside a full
    # remote block whose hash also covers tokens the prompt lacks: unprovable.
    assert v.verified_tokens == 224
    assert v.refused_tokens == 25
    assert v.reason == "partial_block_unverifiable"


@pytest.mark.parametrize("edit_at", [0, 31, 32, 63, 64, 191])
def test_edit_stops_verification_at_its_block(edit_at):
    seq = _tokens(256)
    prompt = list(seq) + _tokens(10, seed=3)
    prompt[edit_at] += 1
    v = verify_remote_kv(_local(prompt), _remote(seq))
    assert v.verified_tokens == (edit_at // B) * B
    assert v.refused_tokens == 256 - v.verified_tokens
    assert v.reason == ("prefix_mismatch" if v.refused_tokens else "ok")


def test_edit_in_partial_tail_keeps_matching_prefix_of_tail():
    seq = _tokens(200)                    # tail is tokens 192..199
    prompt = list(seq) + _tokens(20, seed=4)
    prompt[195] += 1
    v = verify_remote_kv(_local(prompt), _remote(seq))
    assert v.verified_tokens == 195       # 192, 193, 194 of the tail still match
    assert v.refused_tokens == 5


def test_stripped_think_trace():
    history = _tokens(201)
    generated = _tokens(48, seed=7)
    d_seq = history + generated           # D holds 248 tokens (last sampled one has no KV)
    prompt = history[:-1] + generated[36:] + _tokens(40, seed=8)
    v = verify_remote_kv(_local(prompt), _remote(d_seq, num_tokens=248))
    assert v.verified_tokens == 192       # blocks 0-5; block 6 contains '<think>'
    assert v.refused_tokens == 248 - 192


def test_exact_block_boundary_without_tail():
    seq = _tokens(128)
    prompt = seq + _tokens(5, seed=2)
    v = verify_remote_kv(_local(prompt), _remote(seq))
    assert v.verified_tokens == 128 and v.refused_tokens == 0


def test_one_token_short_of_a_block_boundary():
    seq = _tokens(127)                    # 3 full blocks + 31-token tail
    prompt = seq + _tokens(9, seed=2)
    v = verify_remote_kv(_local(prompt), _remote(seq))
    assert v.verified_tokens == 127


@pytest.mark.parametrize("field,value,reason", [
    ("tenant", "other", "tenant_mismatch"),
    ("block_size", 64, "block_size_mismatch"),
    ("hash_algo", "sha256_cbor", "hash_algo_mismatch"),
])
def test_handle_refused_when_metadata_differs(field, value, reason):
    seq = _tokens(100)
    remote = _remote(seq)
    remote = RemoteKV(**{**{f: getattr(remote, f) for f in remote.__struct_fields__},
                         field: value})
    v = verify_remote_kv(_local(seq + [5]), remote)
    assert (v.verified_tokens, v.reason) == (0, reason)
    assert v.refused_tokens == 100


def test_same_tenant_salt_is_required_on_both_sides():
    seq = _tokens(100)
    v = verify_remote_kv(_local(seq + [5], tenant="a"), _remote(seq, tenant="a"))
    assert v.verified_tokens == 100
    v = verify_remote_kv(_local(seq + [5], tenant=None), _remote(seq, tenant="a"))
    assert v.verified_tokens == 0


def test_chain_longer_than_claimed_tokens_is_malformed():
    seq = _tokens(96)
    remote = _remote(seq)
    bad = RemoteKV(num_tokens=40, block_size=B, hash_algo="sha256", chain=remote.chain)
    v = verify_remote_kv(_local(seq), bad)
    assert v.reason == "malformed_handle" and v.verified_tokens == 0


def test_a_later_matching_hash_after_a_mismatch_is_never_used():
    seq = _tokens(160)
    chain = list(engine_block_hashes(seq, B))
    chain[1] = b"\x00" * 8                # block 1 wrong, blocks 2-4 right
    remote = RemoteKV(num_tokens=160, block_size=B, hash_algo="sha256", chain=chain)
    v = verify_remote_kv(_local(seq + [1]), remote)
    assert v.verified_tokens == 32


# ---------------------------------------------------------------- hash granularity
UNIT, BLOCK = 16, 64    # vLLM's hash_block_size finer than the KV block (issue 46)


def _unit_remote(seq: list[int]) -> RemoteKV:
    full = len(seq) // UNIT
    return RemoteKV(num_tokens=len(seq), block_size=BLOCK, hash_algo="sha256",
                    chain=engine_block_hashes(seq[:full * UNIT], UNIT),
                    tail_token_ids=seq[full * UNIT:], hash_tokens=UNIT)


def _unit_local(prompt: list[int], **kw) -> LocalPrompt:
    return LocalPrompt(prompt_token_ids=prompt, block_hashes=engine_block_hashes(prompt, UNIT),
                       block_size=BLOCK, hash_algo="sha256", hash_tokens=UNIT, **kw)


def test_each_hash_counts_its_unit_not_a_block():
    """History edited at token 100: six 16-token hashes match, so 96 tokens are
    verified (counting each hash as a 64-token block said 384)."""
    seq = _tokens(400)
    prompt = list(seq) + _tokens(20, seed=4)
    prompt[100] += 1
    v = verify_remote_kv(_unit_local(prompt), _unit_remote(seq))
    assert (v.verified_tokens, v.reason) == (96, "prefix_mismatch")
    assert v.refused_tokens == 400 - 96


def test_whole_history_at_unit_granularity_with_its_tail():
    seq = _tokens(200)      # 12 units of 16 and 8 tokens
    v = verify_remote_kv(_unit_local(seq + _tokens(30, seed=5)), _unit_remote(seq))
    assert (v.verified_tokens, v.refused_tokens, v.reason) == (200, 0, "ok")


def test_a_claim_at_another_granularity_is_refused_whole():
    seq = _tokens(200)
    v = verify_remote_kv(_local(seq + _tokens(10, seed=6)),
                         RemoteKV(num_tokens=200, block_size=B, hash_algo="sha256",
                                  chain=engine_block_hashes(seq[:192], 16),
                                  tail_token_ids=seq[192:], hash_tokens=16))
    assert (v.verified_tokens, v.reason) == (0, "hash_unit_mismatch")


# --------------------------------------------------- keys beyond the tokens, model
def test_a_partial_block_is_not_proven_by_token_ids_when_the_request_has_other_keys():
    """LoRA, multimodal inputs and prompt embeddings live only in full-block hashes."""
    seq = _tokens(200)                    # 6 full blocks + 8 tokens
    prompt = seq + _tokens(50, seed=9)
    local = LocalPrompt(prompt_token_ids=prompt, block_hashes=engine_block_hashes(prompt, B),
                        block_size=B, hash_algo="sha256", tail_verifiable=False)
    v = verify_remote_kv(local, _remote(seq))
    assert (v.verified_tokens, v.refused_tokens, v.reason) == (192, 8,
                                                               "partial_block_unverifiable")


def test_another_model_is_refused_and_an_unstated_one_is_not():
    seq = _tokens(100)
    prompt = seq + _tokens(5, seed=2)
    local = LocalPrompt(prompt_token_ids=prompt, block_hashes=engine_block_hashes(prompt, B),
                        block_size=B, hash_algo="sha256", model_id="a")
    assert verify_remote_kv(local, _remote(seq, model_id="b")).reason == "model_mismatch"
    assert verify_remote_kv(local, _remote(seq, model_id="a")).reason == "ok"
    assert verify_remote_kv(local, _remote(seq)).reason == "ok"
