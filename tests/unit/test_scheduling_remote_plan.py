"""The remote plan on plain data: direction, the claim read from a payload decoded
once per request, the verdict (verification, expiry, guard), the load decision."""

from __future__ import annotations

import hashlib

from vllm_sessionkv.config import CostConfig
from vllm_sessionkv.scheduling import remote_plan
from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.scheduling.remote_plan import D_TO_P, P_TO_D
from vllm_sessionkv.scheduling.request_state import RequestStates, read_payload
from vllm_sessionkv.verification import LocalPrompt, Verdict
from vllm_sessionkv.wire.cost import LinkModel
from vllm_sessionkv.wire.hashing import encode_chain
from vllm_sessionkv.wire.protocol import SessionPayload, encode_payload

BLOCK = 4
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
PROMPT = list(range(17))       # 4 full blocks and one token
HANDLE = {"do_remote_decode": True, "remote_block_ids": [[1, 2, 3, 4]],
          "remote_engine_id": "D", "remote_request_id": "r", "remote_host": "h",
          "remote_port": 1, "remote_num_tokens": 16}


def params(**payload) -> dict:
    fields = dict(hash_chain=encode_chain(HASHES), block_size=BLOCK, hash_algo="sha256",
                  hold_token=7)
    fields.update(payload)
    return dict(HANDLE, sessionkv=encode_payload(SessionPayload(**fields)))


def local(max_loadable: int = 16) -> LocalPrompt:
    return LocalPrompt(prompt_token_ids=PROMPT, block_hashes=HASHES, block_size=BLOCK,
                       hash_algo="sha256", max_loadable_tokens=max_loadable)


def verdict(p: dict, now: float = 0.0, guard: bool = True) -> Verdict:
    read = read_payload(p)
    claim, refusal = remote_plan.remote_claim(p, read.payload, read.refusal, read.error)
    return remote_plan.judge(p, read.payload, claim, refusal, remote_plan.direction(p),
                             local(), len(PROMPT), now, 1.0, guard)


def test_direction():
    assert remote_plan.direction(None) is None
    assert remote_plan.direction({"do_remote_prefill": True}) == P_TO_D
    assert remote_plan.direction(HANDLE) == D_TO_P
    # A D->P handle that does not say where the blocks live brings nothing.
    assert remote_plan.direction({"do_remote_decode": True}) is None


def test_a_matching_chain_is_verified_and_a_changed_prompt_is_not():
    assert verdict(params()) == Verdict(verified_tokens=16, refused_tokens=0, reason="ok")
    other = [hashlib.sha256(b"x").digest(), *HASHES[1:]]
    refused = verdict(params(hash_chain=encode_chain(other)))
    assert refused.verified_tokens == 0 and refused.refused_tokens == 16


def test_a_handle_is_refused_when_expired_unguarded_or_unverifiable():
    assert verdict(params(expires_at_unix_s=100.5), now=100.0).reason == "expired_handle"
    assert verdict(params(expires_at_unix_s=200.0), now=100.0).reason == "ok"
    assert verdict(params(hold_token=0)).reason == "unguarded_handle"
    assert verdict(params(hold_token=0), guard=False).reason == "ok"
    assert verdict(params(hash_chain=None)).reason == "unverifiable_handle"
    malformed = dict(HANDLE, sessionkv={"version": 99})
    assert verdict(malformed) == Verdict(verified_tokens=0, refused_tokens=16,
                                         reason="unsupported_version")


def test_a_stock_p_is_trusted_for_the_prompt_it_computed():
    p = {"do_remote_prefill": True, "remote_num_tokens": 17}
    read = read_payload(p)
    claim, refusal = remote_plan.remote_claim(p, read.payload, read.refusal)
    got = remote_plan.judge(p, read.payload, claim, refusal, P_TO_D, local(16), 17, 0.0,
                            1.0, True)
    assert got == Verdict(verified_tokens=16, refused_tokens=0, reason="unverified_p_to_d")


def test_the_load_decision_prices_session_pulls_only():
    ok = Verdict(verified_tokens=16, refused_tokens=0, reason="ok")
    cheap = Pricing(CostConfig(recompute_s_per_token=1.0), 1.0,
                    LinkModel(bytes_per_s=1.0, per_transfer_s=0.0))
    assert remote_plan.decide_load(ok, D_TO_P, 4, cheap)[:2] == ("pull", 12)
    dear = Pricing(CostConfig(recompute_s_per_token=1e-9, link_bytes_per_s=1.0), 1e6,
                   LinkModel(bytes_per_s=1.0, per_transfer_s=0.0))
    assert remote_plan.decide_load(ok, D_TO_P, 4, dear)[:2] == ("recompute", 0)
    assert remote_plan.decide_load(ok, P_TO_D, 4, dear) == ("pull", 12, 0.0, 0.0)
    assert remote_plan.decide_load(ok, D_TO_P, 16, dear)[:2] == ("none", 0)
    refused = Verdict(verified_tokens=0, refused_tokens=16, reason="expired_handle")
    assert remote_plan.decide_load(refused, D_TO_P, 0, dear)[:2] == ("refused", 0)


def test_the_payload_is_decoded_once_per_params():
    states = RequestStates()
    p = params(session_id="s")
    first = states.of("r", p)
    assert states.of("r", p).read is first.read                 # not decoded again
    replaced = params(session_id="t")                           # early decode: P's params
    assert states.of("r", replaced).payload.session_id == "t"
    assert states.pop("r") is first and states.get("r") is None
