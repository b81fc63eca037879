"""Decide how much of a remote engine's KV may be attached to a new prompt.

Pure: plain data in, a verdict out.  The rule is the project's correctness
guarantee: remote KV is attached only as far as it provably holds the new prompt's
tokens.  Full blocks are proven by the chained block hashes; the remote's partial
last block by its token ids (KV at a position depends only on the tokens up to it,
so a matching prefix of that block is as good as a match of the whole).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from vllm_sessionkv.wire.hashing import verified_prefix_blocks

__all__ = ["REFUSAL_REASONS", "LocalPrompt", "RemoteKV", "Verdict", "verify_remote_kv"]

# Reasons that reject a handle as a whole, before any block is compared.
REFUSAL_REASONS = frozenset({"tenant_mismatch", "block_size_mismatch", "hash_algo_mismatch",
                             "malformed_handle", "unverifiable_handle", "expired_handle",
                             "unsupported_version"})


class RemoteKV(msgspec.Struct, frozen=True, kw_only=True):
    """What a handle claims the remote engine holds."""

    num_tokens: int
    block_size: int
    hash_algo: str
    chain: Sequence[bytes]           # one hash per full block, in order
    tail_token_ids: Sequence[int] = ()  # tokens of the partial block after the chain
    tenant: str | None = None


class LocalPrompt(msgspec.Struct, frozen=True, kw_only=True):
    prompt_token_ids: Sequence[int]
    block_hashes: Sequence[bytes]    # this engine's hashes of the prompt's full blocks
    block_size: int
    hash_algo: str
    tenant: str | None = None
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

    if remote.tenant != local.tenant:
        return refuse("tenant_mismatch")
    if remote.block_size != local.block_size:
        return refuse("block_size_mismatch")
    if remote.hash_algo != local.hash_algo:
        return refuse("hash_algo_mismatch")
    if len(remote.chain) * remote.block_size > remote.num_tokens:
        return refuse("malformed_handle")

    verified_blocks = verified_prefix_blocks(local.block_hashes, remote.chain)
    verified_tokens = verified_blocks * local.block_size
    whole_chain_matched = verified_blocks == len(remote.chain)
    if whole_chain_matched and remote.tail_token_ids:
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
    elif verified_blocks == len(local.block_hashes) and not whole_chain_matched:
        # Every full block of the prompt matched; the prompt's partial last block sits
        # inside a full remote block whose hash covers tokens the prompt lacks, so it
        # cannot be proven and is recomputed (fewer than block_size tokens).
        reason = "partial_block_unverifiable"
    else:
        reason = "prefix_mismatch"
    return Verdict(verified_tokens=verified_tokens, refused_tokens=refused_tokens, reason=reason)
