"""What engine shapes the connector serves, checked once at start-up.

Pure: plain numbers in, the reason for a refusal (naming the setting) or None out.
Each refusal is a case where serving would risk a crash or wrong KV rather than cost
speed, so the engine stops at start-up instead:

* **More than one KV cache group** (hybrid models: sliding-window and full-attention
  layers, Mamba layers).  vLLM maps a failed read back to blocks only with one group
  (``Scheduler._handle_invalid_blocks`` raises otherwise), block ids are per group, and
  our hash chains and verification cover one group's blocks.  Serving them needs
  per-group verification and per-group failure reports, which are not built.
* **A hash unit other than the block size** (``hash_block_size``, set by
  ``--prefix-match-unit`` or a hybrid model's groups): with one group vLLM itself
  requires them equal; checked so a future vLLM that relaxes it is refused here, not
  verified at the wrong granularity.
* **A load-failure policy other than ``recompute``.**  Every refused or failed pull
  (the pull guard, a verification refusal, a NIXL error) falls back to computing the
  prompt; under ``fail`` vLLM would fail those requests instead.  vLLM's default is
  ``fail``, and a config cannot tell a default from a choice, so the setting is
  required rather than overridden in silence.
"""

from __future__ import annotations

__all__ = ["refusal"]


def refusal(*, num_kv_cache_groups: int, block_size: int, hash_tokens: int,
            kv_load_failure_policy: str) -> str | None:
    if num_kv_cache_groups > 1:
        return (f"the model has {num_kv_cache_groups} KV cache groups (a hybrid model, "
                "e.g. sliding-window or Mamba layers); SessionKVConnector verifies and "
                "recovers reads for one group only. Serve it with stock NixlConnector, "
                "or with --disable-hybrid-kv-cache-manager if every layer may use full "
                "attention")
    if hash_tokens != block_size:
        return (f"hash_block_size ({hash_tokens} tokens, from --prefix-match-unit) differs "
                f"from block_size ({block_size}); SessionKVConnector verifies whole blocks: "
                "leave --prefix-match-unit unset")
    if kv_load_failure_policy != "recompute":
        return (f"kv_transfer_config.kv_load_failure_policy is {kv_load_failure_policy!r} "
                "(vLLM's default is 'fail'); SessionKVConnector needs 'recompute': a "
                "refused or failed pull falls back to computing the prompt. Add "
                "\"kv_load_failure_policy\":\"recompute\" to --kv-transfer-config")
    return None
