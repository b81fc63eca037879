"""Decide how much of a remote engine's KV may be attached to a new prompt.

Pure: plain data in, a verdict out.  The rule is the project's correctness
guarantee: remote KV is attached only as far as it provably holds the new prompt's
tokens.  Full hash units are proven by the chained block hashes (one hash per
``hash_tokens`` tokens: vLLM's ``hash_block_size``, the block size unless a hybrid
model or ``--prefix-match-unit`` makes it finer); the remote's partial last unit by
its token ids (KV at a position depends only on the tokens up to it, so a matching
prefix of that unit is as good as a match of the whole) -- but only where no request
key beyond the tokens exists (LoRA, multimodal inputs, prompt embeddings live only in
full-unit hashes), and only between engines serving the same model (``model_id``).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from vllm_sessionkv.wire.hashing import verified_prefix_blocks

__all__ = ["REFUSAL_REASONS", "LocalPrompt", "RemoteKV", "Verdict", "verify_remote_kv"]

# Reasons that reject a handle as a whole, before any block is compared.
REFUSAL_REASONS = frozenset({"tenant_mismatch", "block_size_mismatch", "hash_algo_mismatch",
                             "hash_unit_mismatch", "model_mismatch",
                             "malformed_handle", "unverifiable_handle", "expired_handle",
                             "unsupported_version"})


class RemoteKV(msgspec.Struct, frozen=True, kw_only=True):
    """What a handle claims the remote engine holds."""

    num_tokens: int
    block_size: int
    hash_algo: str
    chain: Sequence[bytes]           # one hash per full hash unit, in order
    tail_token_ids: Sequence[int] = ()  # tokens of the partial unit after the chain
    tenant: str | None = None
    hash_tokens: int = 0             # tokens per chain hash; 0: block_size (older peers)
    model_id: str = ""               # the holder's model identity; "": not stated


class LocalPrompt(msgspec.Struct, frozen=True, kw_only=True):
    prompt_token_ids: Sequence[int]
    block_hashes: Sequence[bytes]    # this engine's hashes (Request.block_hashes)
    block_size: int
    hash_algo: str
    tenant: str | None = None
    hash_tokens: int = 0             # tokens per hash; 0: block_size
    model_id: str = ""
    # False when the request has keys beyond its tokens (LoRA, multimodal inputs,
    # prompt embeddings): a partial unit's token ids would not prove its KV.
    tail_verifiable: bool = True
    # Tokens the engine may load at most (vLLM keeps the last prompt token to compute
    # the first logits, or backs off further for some models).
    max_loadable_tokens: int | None = None


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    verified_tokens: int   # leading prompt tokens the remote KV provably holds
    refused_tokens: int    # remote tokens overlapping the prompt that failed the check
    reason: str            # "ok", "prefix_mismatch", or a REFUSAL_REASONS entry

    @property
    def refused_whole_handle(self) -> bool:
        return self.reason in REFUSAL_REASONS


def verify_remote_kv(local: LocalPrompt, remote: RemoteKV) -> Verdict:
    num_prompt_tokens = len(local.prompt_token_ids)
    overlap_tokens = min(remote.num_tokens, num_prompt_tokens)
    if local.max_loadable_tokens is not None:
        overlap_tokens = min(overlap_tokens, local.max_loadable_tokens)

    def refuse(reason: str) -> Verdict:
        return Verdict(verified_tokens=0, refused_tokens=max(0, overlap_tokens), reason=reason)

    unit = local.hash_tokens or local.block_size
    if remote.tenant != local.tenant:
        return refuse("tenant_mismatch")
    if remote.model_id and local.model_id and remote.model_id != local.model_id:
        return refuse("model_mismatch")
    if remote.block_size != local.block_size:
        return refuse("block_size_mismatch")
    if (remote.hash_tokens or remote.block_size) != unit:
        return refuse("hash_unit_mismatch")
    if remote.hash_algo != local.hash_algo:
        return refuse("hash_algo_mismatch")
    if len(remote.chain) * unit > remote.num_tokens:
        return refuse("malformed_handle")

    verified_blocks = verified_prefix_blocks(local.block_hashes, remote.chain)
    verified_tokens = verified_blocks * unit
    whole_chain_matched = verified_blocks == len(remote.chain)
    if whole_chain_matched and remote.tail_token_ids and local.tail_verifiable:
        prompt_tail = local.prompt_token_ids[verified_tokens:verified_tokens
                                             + len(remote.tail_token_ids)]
        for remote_token, prompt_token in zip(remote.tail_token_ids, prompt_tail):
            if remote_token != prompt_token:
                break
            verified_tokens += 1

    verified_tokens = min(verified_tokens, overlap_tokens)
    refused_tokens = max(0, overlap_tokens - verified_tokens)
    if refused_tokens == 0:
        reason = "ok"
    elif (verified_blocks == len(local.block_hashes) and not whole_chain_matched) or (
            whole_chain_matched and remote.tail_token_ids and not local.tail_verifiable):
        # Every full unit of the prompt matched; the prompt's partial last unit sits
        # inside a full remote unit whose hash covers tokens the prompt lacks (or it
        # has keys beyond its tokens), so it cannot be proven and is recomputed
        # (fewer than a unit's tokens).
        reason = "partial_block_unverifiable"
    else:
        reason = "prefix_mismatch"
    return Verdict(verified_tokens=verified_tokens, refused_tokens=refused_tokens, reason=reason)
