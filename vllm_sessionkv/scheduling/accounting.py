"""Where each prompt token of a finished request came from (``TokenAccounting``,
returned to the proxy in the payload and counted as ``sessionkv_prompt_tokens``), and
the once-per-request counts of a session pull's decision."""

from __future__ import annotations

from vllm_sessionkv.scheduling.counters import StatsSink
from vllm_sessionkv.scheduling.remote_plan import D_TO_P, RemotePlan
from vllm_sessionkv.wire.protocol import TokenAccounting

__all__ = ["account_decision", "accounting", "record_accounting"]

_SOURCES = ("local_hit", "pulled_from_peer", "pulled_from_host", "recomputed",
            "refused_by_verification")


def accounting(num_prompt_tokens: int, plan: RemotePlan | None, local_hit_tokens: int,
               host_restored_tokens: int, kv_bytes_per_token: float,
               now_s: float) -> TokenAccounting:
    """``now_s``: the ``perf_counter`` time the request finished."""
    if plan is None:
        # No remote KV involved: what was not hit locally or restored from the host
        # tier was computed here.
        return TokenAccounting(
            prompt_tokens=num_prompt_tokens, local_hit_tokens=local_hit_tokens,
            pulled_from_host_tokens=host_restored_tokens,
            recomputed_tokens=max(0, num_prompt_tokens - local_hit_tokens
                                  - host_restored_tokens),
            decision="host:restore" if host_restored_tokens else "none")
    pulled = 0 if plan.failed else plan.load_tokens
    # When the whole prompt is loaded, vLLM recomputes the last token anyway to get
    # the first logits (scheduler._update_waiting_for_remote_kv), unless the request
    # continues from P's token, whose KV comes after the prompt.
    computed = max(0, num_prompt_tokens - plan.local_hit_tokens - pulled)
    if pulled and computed == 0 and not plan.first_token:
        pulled, computed = pulled - 1, 1
    verdict = plan.verdict
    return TokenAccounting(
        prompt_tokens=num_prompt_tokens,
        local_hit_tokens=plan.local_hit_tokens,
        pulled_from_peer_tokens=pulled,
        recomputed_tokens=computed,
        refused_by_verification_tokens=max(
            0, verdict.verified_tokens + verdict.refused_tokens
            - max(verdict.verified_tokens, plan.local_hit_tokens)),
        pulled_bytes=int(pulled * kv_bytes_per_token),
        pull_ms=round(_pull_ms(plan, now_s), 3) if pulled else 0.0,
        priced_pull_ms=round(plan.pull_s * 1e3, 4),
        priced_recompute_ms=round(plan.recompute_s * 1e3, 4),
        priced_engine_load=round(plan.engine_load, 3),
        first_token_from_prefill=plan.first_token,
        decision=f"{plan.direction}:{'pull_failed' if plan.failed else plan.decision}"
                 f":{verdict.reason}")


def _pull_ms(plan: RemotePlan, now_s: float) -> float:
    """The read's time, queued to received.  A synchronous read whose request ends in
    the step that ran it (P's prefill-only turn) is not timed yet: vLLM frees the
    step's finished requests before it hands the connector the step's transfers
    (``SyncReads.finished_step``), so it is timed to now."""
    if plan.pull_ms or not plan.pull_started_s:
        return plan.pull_ms
    return max(0.0, now_s - plan.pull_started_s) * 1e3


def record_accounting(stats: StatsSink, acct: TokenAccounting) -> None:
    for source in _SOURCES:
        tokens = getattr(acct, f"{source}_tokens")
        if tokens:
            stats.record(f"prompt_tokens_{source}", tokens)


def account_decision(stats: StatsSink, plan: RemotePlan) -> None:
    """Count a session pull's decision once, when its blocks are allocated."""
    if plan.accounted:
        return
    plan.accounted = True
    if plan.direction == D_TO_P:
        if plan.decision in ("pull", "recompute"):
            stats.record(f"decision_{plan.decision}")
        if plan.verdict.reason == "expired_handle":
            stats.record("pull_failed")
        elif plan.verdict.refused_whole_handle:
            stats.record("handle_refused")
