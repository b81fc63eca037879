"""Where a finished request's prompt tokens came from, on plain plans."""

from __future__ import annotations

from vllm_sessionkv.scheduling.accounting import account_decision, accounting, record_accounting
from vllm_sessionkv.scheduling.remote_plan import D_TO_P, P_TO_D, RemotePlan
from vllm_sessionkv.verification import Verdict

OK = Verdict(verified_tokens=96, refused_tokens=0, reason="ok")


def plan(**kw) -> RemotePlan:
    fields = dict(direction=D_TO_P, verdict=OK, local_hit_tokens=32, load_tokens=64,
                  decision="pull")
    fields.update(kw)
    return RemotePlan(**fields)


def test_no_remote_kv_local_host_and_computed():
    acct = accounting(100, None, local_hit_tokens=32, host_restored_tokens=48,
                      kv_bytes_per_token=10.0, now_s=0.0)
    assert (acct.local_hit_tokens, acct.pulled_from_host_tokens, acct.recomputed_tokens,
            acct.decision) == (32, 48, 20, "host:restore")
    assert accounting(100, None, 0, 0, 1.0, 0.0).decision == "none"


def test_a_pull_and_its_failure():
    acct = accounting(100, plan(pull_ms=2.5, pull_started_s=1.0), 0, 0,
                      kv_bytes_per_token=10.0, now_s=9.0)
    assert (acct.pulled_from_peer_tokens, acct.recomputed_tokens, acct.pulled_bytes,
            acct.pull_ms, acct.decision) == (64, 4, 640, 2.5, "d_to_p:pull:ok")
    failed = accounting(100, plan(failed=True), 0, 0, 10.0, 0.0)
    assert (failed.pulled_from_peer_tokens, failed.recomputed_tokens,
            failed.decision) == (0, 68, "d_to_p:pull_failed:ok")


def test_a_read_not_yet_timed_when_its_request_ends_is_timed_to_the_end():
    # A synchronous read on P's prefill-only turn: the request ends in the step that ran
    # the read, before the step's report would have timed it.
    acct = accounting(100, plan(sync=True, pull_started_s=1.0), 0, 0, 10.0, now_s=1.25)
    assert acct.pull_ms == 250.0
    # Timed already (an asynchronous read, received in an earlier step): kept.
    assert accounting(100, plan(pull_ms=2.5, pull_started_s=1.0), 0, 0, 10.0,
                      now_s=1.25).pull_ms == 2.5
    # Never queued, or failed: nothing to time.
    assert accounting(100, plan(), 0, 0, 10.0, now_s=1.25).pull_ms == 0.0
    assert accounting(100, plan(failed=True, pull_started_s=1.0), 0, 0, 10.0,
                      now_s=1.25).pull_ms == 0.0


def test_a_whole_prompt_loaded_leaves_one_token_unless_p_sent_its_token():
    whole = plan(direction=P_TO_D, local_hit_tokens=0, load_tokens=96)
    assert accounting(96, whole, 0, 0, 1.0, 0.0).recomputed_tokens == 1
    handed = plan(direction=P_TO_D, local_hit_tokens=0, load_tokens=96, first_token=True)
    acct = accounting(96, handed, 0, 0, 1.0, 0.0)
    assert acct.recomputed_tokens == 0 and acct.first_token_from_prefill


def test_refused_tokens_beyond_the_local_hit():
    refused = plan(verdict=Verdict(verified_tokens=0, refused_tokens=96,
                                   reason="prefix_mismatch"), load_tokens=0,
                   decision="none")
    assert accounting(100, refused, 0, 0, 1.0, 0.0).refused_by_verification_tokens == 64


class Stats:
    def __init__(self) -> None:
        self.data: dict[str, list] = {}

    def record(self, key: str, value: int | float = 1) -> None:
        self.data.setdefault(key, []).append(value)


def test_stats_count_tokens_by_source_and_a_decision_once():
    stats = Stats()
    record_accounting(stats, accounting(100, plan(), 0, 0, 1.0, 0.0))
    p = plan(decision="recompute")
    account_decision(stats, p)
    account_decision(stats, p)
    data = stats.data
    assert data == {"prompt_tokens_local_hit": [32], "prompt_tokens_pulled_from_peer": [64],
                    "prompt_tokens_recomputed": [4],
                    "decision_recompute": [1]}
