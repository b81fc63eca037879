"""What remote KV one request may attach, and whether to read it.

A request brings remote KV in one of two directions: P->D (D loads the prompt P
computed) or D->P (P pulls the previous turn's blocks from the D that holds them).
Its claim is verified block by block against the prompt (``verification.py``);
a D->P handle is also refused when its lease is (nearly) over, or when the pull
guard is on and the handle has no hold token to claim.  What is verified beyond the
local hit is priced (D->P only): pull, or recompute.  Pure functions of their
arguments, apart from the warnings they log.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.verification import LocalPrompt, RemoteKV, Verdict, verify_remote_kv
from vllm_sessionkv.wire.hashing import decode_chain
from vllm_sessionkv.wire.protocol import SessionPayload, handle_expired

__all__ = ["D_TO_P", "P_TO_D", "RemotePlan", "decide_load", "direction", "judge",
           "names_remote_blocks", "remote_claim"]

logger = logging.getLogger("vllm.sessionkv.scheduler")

P_TO_D = "p_to_d"
D_TO_P = "d_to_p"   # a session pull

_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class RemotePlan(msgspec.Struct):
    """What we decided for one request, kept until it finishes."""

    direction: str                 # D_TO_P (session pull) or P_TO_D
    verdict: Verdict
    local_hit_tokens: int
    load_tokens: int               # tokens we ask vLLM to load
    decision: str                  # "pull", "recompute", "refused", "none"
    pull_s: float = 0.0
    recompute_s: float = 0.0
    engine_load: float = 0.0       # the estimate the decision was priced at
    accounted: bool = False
    failed: bool = False           # the load failed or expired; vLLM recomputed
    pull_started_s: float = 0.0    # perf_counter when the read was queued
    pull_ms: float = 0.0           # queued to received, as the scheduler sees it
    remote_engine_id: str = ""
    sync: bool = False             # read inside the step that computes the request
    sync_block_ids: frozenset[int] = frozenset()   # its destinations (group 0)
    first_token: bool = False      # continues from P's token (all prompt KV loaded)


def names_remote_blocks(params: dict[str, Any]) -> bool:
    """The handle stock code needs to queue a read: blocks and where they live."""
    return bool(params.get("remote_block_ids")) and all(k in params for k in _REMOTE_FIELDS)


def direction(params: dict[str, Any] | None) -> str | None:
    """P_TO_D, D_TO_P, or None when the params bring no remote KV to load."""
    if not params:
        return None
    if params.get("do_remote_prefill"):
        return P_TO_D
    if params.get("do_remote_decode") and names_remote_blocks(params):
        return D_TO_P
    return None


def remote_claim(params: dict[str, Any], payload: SessionPayload, refusal: str | None,
                 error: str = "") -> tuple[RemoteKV | None, str | None]:
    """(the remote's claim, None), (None, None) when the params carry no chain, or
    (None, reason) when the payload is refused whole (``refusal``: why it could not
    be read, if it could not)."""
    try:
        if refusal is None:
            if payload.hash_chain is None:
                return None, None
            return RemoteKV(
                num_tokens=int(params.get("remote_num_tokens") or 0),
                block_size=payload.block_size, hash_algo=payload.hash_algo,
                chain=decode_chain(payload.hash_chain),
                tail_token_ids=payload.tail_token_ids, tenant=payload.tenant,
                hash_tokens=payload.hash_tokens, model_id=payload.model_id), None
    except (TypeError, ValueError) as exc:
        refusal, error = "malformed_handle", str(exc)
    if refusal == "unsupported_version":
        logger.warning("sessionkv: handle not used: %s", error)
    else:
        logger.warning("sessionkv: malformed handle (%s); not used", error)
    return None, refusal


def _refuse(verdict: Verdict, reason: str) -> Verdict:
    return Verdict(verified_tokens=0,
                   refused_tokens=verdict.verified_tokens + verdict.refused_tokens,
                   reason=reason)


def judge(params: dict[str, Any], payload: SessionPayload, claim: RemoteKV | None,
          refusal: str | None, way: str, local: LocalPrompt, num_prompt_tokens: int,
          now_unix_s: float, expiry_margin_s: float, pull_guard: bool) -> Verdict:
    """How much of the remote claim this request may attach (``local``: the prompt,
    with ``max_loadable_tokens`` the most a load may cover)."""
    claimed = int(params.get("remote_num_tokens") or 0)
    if refusal is not None:
        verdict = Verdict(verified_tokens=0,
                          refused_tokens=min(claimed, local.max_loadable_tokens),
                          reason=refusal)
    elif claim is None and way == D_TO_P:
        # A D->P handle without a hash chain cannot be verified: never attach it.
        verdict = Verdict(verified_tokens=0, refused_tokens=min(claimed, num_prompt_tokens),
                          reason="unverifiable_handle")
    elif claim is None:
        # P->D from a stock P: vLLM's own contract (P computed this very prompt).
        verdict = Verdict(verified_tokens=local.max_loadable_tokens, refused_tokens=0,
                          reason="unverified_p_to_d")
    else:
        verdict = verify_remote_kv(local, claim)
    if way == D_TO_P and handle_expired(payload.expires_at_unix_s, now_unix_s,
                                        expiry_margin_s):
        # D's lease is over (or nearly): its blocks may already hold other KV.
        return _refuse(verdict, "expired_handle")
    if way == D_TO_P and pull_guard and not payload.hold_token and verdict.verified_tokens:
        # D cannot be asked to keep the blocks while we read them (guard.py).
        return _refuse(verdict, "unguarded_handle")
    return verdict


def decide_load(verdict: Verdict, way: str, num_computed_tokens: int,
                pricing: Pricing) -> tuple[str, int, float, float]:
    """(decision, tokens to load, priced pull s, priced recompute s): load what is
    verified beyond the local hit; for a session pull, only if pulling is cheaper."""
    load_tokens = max(0, verdict.verified_tokens - num_computed_tokens)
    decision = "pull" if load_tokens else "none"
    if verdict.refused_whole_handle:
        decision = "refused"
    if way != D_TO_P or not load_tokens:
        return decision, load_tokens, 0.0, 0.0
    priced = pricing.decide(load_tokens, num_computed_tokens, pricing.peer_link)
    if not priced.pull:
        return "recompute", 0, priced.pull_s, priced.recompute_s
    return decision, load_tokens, priced.pull_s, priced.recompute_s
