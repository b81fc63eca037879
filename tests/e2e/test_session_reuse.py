"""Session reuse across pools: D->P pulls, verification, and the pull/recompute price.

All on real 1P+1D servers over NIXL, compared with a co-located server in token ids
and top-5 logprobs.  The stock-connector control runs vLLM's own NixlConnector with
``bidirectional_kv_xfer`` on the same request sequence and documents the upstream
wrong-output bug (vLLM #43094) that our verification prevents.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import requests

from cluster import launch_cluster, stop_cluster
from helpers import (
    Generation,
    assert_same,
    compare,
    completion_body,
    fresh_prefill_params,
    metric_sum,
    post,
    prefill_accounting,
    prompt_sources,
    reset_prefix_cache,
)

pytestmark = pytest.mark.cluster

def _ids(seed: int, n: int) -> list[int]:
    """Deterministic 'text' token ids away from the special tokens (ids < 10)."""
    return [(seed * 7919 + i * 104729) % 990 + 20 for i in range(n)]


@dataclass
class Turn:
    out: Generation
    handle: dict                # D's end-of-turn kv_transfer_params
    prefill_accounting: dict
    decode_accounting: dict


def session_turn(p_url: str, d_url: str, model: str, prompt: list[int], handle: dict | None,
                 max_tokens: int = 24, session_id: str = "s", timeout: float = 300.0) -> Turn:
    """One turn the way a router drives it: P (with D's last handle), then D."""
    params = fresh_prefill_params()
    if handle is not None:
        params = dict(handle, do_remote_decode=True, do_remote_prefill=False)
    p_out = post(p_url, "/v1/completions", completion_body(
        model, prompt, max_tokens=1, kv_transfer_params=params, session_id=session_id),
        timeout=timeout)
    p_params = p_out.raw["kv_transfer_params"]
    d_out = post(d_url, "/v1/completions", completion_body(
        model, prompt, max_tokens=max_tokens, kv_transfer_params=p_params,
        session_id=session_id), timeout=timeout)
    d_params = d_out.raw["kv_transfer_params"]
    return Turn(out=d_out, handle=d_params,
                prefill_accounting=(p_params.get("sessionkv") or {}).get("accounting", {}),
                decode_accounting=(d_params.get("sessionkv") or {}).get("accounting", {}))


def baseline(url: str, model: str, prompt: list[int], max_tokens: int = 24) -> Generation:
    return post(url, "/v1/completions", completion_body(model, prompt, max_tokens=max_tokens))


# --------------------------------------------------------------------------- 6 turns
@pytest.mark.parametrize("stream", [False, True])
def test_six_turn_conversation_reuses_kv_and_equals_baseline(pd_cluster, stream):
    """Through the proxy.  Streaming turns carry no kv_transfer_params in vLLM 0.32, so
    there the next turn's handle comes from Redis, published by D."""
    p_url = pd_cluster.prefill[0]
    pulled_bytes_before = metric_sum(p_url, "vllm:nixl_bytes_transferred_sum")
    session = f"six-turn-{stream}"
    prompt = _ids(1 if stream else 2, 1500)          # a long system prompt
    prev_prompt_len = 0
    pulled_total = 0
    handles: list[str] = []
    for turn in range(1, 7):
        body = completion_body(pd_cluster.model, prompt, max_tokens=32, stream=stream,
                               session_id=session)
        before = prompt_sources(p_url)
        got = post(pd_cluster.proxy, "/v1/completions", body)
        base = baseline(pd_cluster.colocated, pd_cluster.model, prompt, 32)
        assert_same(got, base, f"turn {turn}")
        acct = prefill_accounting(got, p_url, before, len(prompt))
        assert acct["prompt_tokens"] == len(prompt)
        # Turn 1 has no handle; later turns get D's: from the response, or when
        # streaming from Redis, where D's publisher writes it in the background.
        handle = got.headers["x-sessionkv-handle"]
        handles.append(handle)
        if turn == 1 or not stream:
            assert handle == ("none" if turn == 1 else "attached"), f"turn {turn}: {handle}"
        if turn > 1:
            new_tokens = len(prompt) - prev_prompt_len   # D's output + the new user text
            reused = acct.get("local_hit_tokens", 0) + acct.get("pulled_from_peer_tokens", 0)
            # P computes about the new tokens: at most those plus one partial block.
            assert acct["recomputed_tokens"] <= new_tokens + 32, acct
            assert reused >= prev_prompt_len - 32, acct
            pulled_total += acct.get("pulled_from_peer_tokens", 0)
        prev_prompt_len = len(prompt)
        prompt = prompt + got.token_ids + _ids(100 + turn, 60)
    assert pulled_total > 0, "no turn pulled KV from D"
    assert "attached" in handles[1:], handles
    assert metric_sum(p_url, "vllm:nixl_bytes_transferred_sum") > pulled_bytes_before


def test_d_pulls_back_only_new_blocks(pd_cluster):
    p_url, d_url, model = pd_cluster.prefill[0], pd_cluster.decode[0], pd_cluster.model
    prompt = _ids(3, 300)
    first = session_turn(p_url, d_url, model, prompt, None, session_id="pullback")
    prompt2 = prompt + first.out.token_ids + _ids(33, 90)
    second = session_turn(p_url, d_url, model, prompt2, first.handle, session_id="pullback")
    assert_same(second.out, baseline(pd_cluster.colocated, model, prompt2), "turn 2")
    d = second.decode_accounting
    # D still caches turn 1 (prompt + output, full blocks), so it pulls only the rest.
    held_blocks = (len(prompt) + len(first.out.token_ids) - 1) // 32
    assert d["local_hit_tokens"] >= held_blocks * 32 - 32, d
    assert d["pulled_from_peer_tokens"] + d.get("recomputed_tokens", 0) \
        <= len(prompt2) - d["local_hit_tokens"], d


# --------------------------------------------------------------------------- edits
def _strip_think(prompt: list[int], generated: list[int], think_id: int, reasoning: int,
                 user: list[int]) -> list[int]:
    """Turn 1 ended with '<think>' and D generated the trace and an answer; the client
    drops '<think>' and the first ``reasoning`` generated tokens from history."""
    assert prompt[-1] == think_id
    return prompt[:-1] + generated[reasoning:] + user


def _edit_early_user_token(prompt: list[int], generated: list[int], user: list[int]) -> list[int]:
    edited = list(prompt)
    edited[5] = edited[5] + 1
    return edited + generated + user


def _think_id(model_dir: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<think>")


def _run_edit(p_url, d_url, colocated, model, case: str, think_id: int, reset_p: bool,
              session_id: str | None = None, timeout: float = 300.0):
    session_id = session_id or case
    prompt = _ids(5 if case == "strip_think" else 6, 200) + [think_id]
    first = session_turn(p_url, d_url, model, prompt, None, max_tokens=48,
                         session_id=session_id, timeout=timeout)
    user = _ids(55, 40)
    if case == "strip_think":
        prompt2 = _strip_think(prompt, first.out.token_ids, think_id, 36, user)
    else:
        prompt2 = _edit_early_user_token(prompt, first.out.token_ids, user)
    if reset_p:
        # As if P's cache had been evicted: every reusable token must come from D.
        # P answers the reset with success: false while it still holds turn 1's
        # blocks for D's read (its notification not yet handled), and then keeps
        # them: strip_think then found its 6 verified blocks on P and pulled none.
        # The helper asks again until the reset succeeds.
        reset_prefix_cache(p_url)
    second = session_turn(p_url, d_url, model, prompt2, first.handle, max_tokens=24,
                          session_id=session_id, timeout=timeout)
    return second, baseline(colocated, model, prompt2)


@pytest.mark.parametrize("case", ["strip_think", "edit_early_user_message"])
def test_history_edit_is_verified_and_equals_baseline(pd_cluster, case):
    think_id = _think_id(pd_cluster.model)
    p_url, d_url = pd_cluster.prefill[0], pd_cluster.decode[0]
    refused_before = metric_sum(p_url, "sessionkv_prompt_tokens_total",
                                source="refused_by_verification")
    second, base = _run_edit(p_url, d_url, pd_cluster.colocated, pd_cluster.model, case,
                             think_id, reset_p=True)
    assert_same(second.out, base, case)
    acct = second.prefill_accounting
    assert acct["refused_by_verification_tokens"] > 0, acct
    assert "prefix_mismatch" in acct["decision"], acct
    if case == "strip_think":
        # The 6 blocks before '<think>' verify and are pulled; the rest is refused.
        assert acct["pulled_from_peer_tokens"] == 192, acct
    else:
        assert acct.get("pulled_from_peer_tokens", 0) == 0, acct
    assert metric_sum(p_url, "sessionkv_prompt_tokens_total",
                      source="refused_by_verification") > refused_before


@pytest.fixture(scope="module")
def stock_cluster(tiny_model, tmp_path_factory):
    """vLLM's stock NixlConnector, bidirectional, threshold 0: the upstream behaviour."""
    cluster = launch_cluster(tiny_model, tmp_path_factory.mktemp("stock-logs"), [
        "--prefill", "1", "--decode", "1", "--no-proxy", "--connector", "nixl"])
    try:
        yield cluster
    finally:
        report = stop_cluster(cluster)
        assert not report["alive"], report


@pytest.mark.parametrize("case", ["strip_think", "edit_early_user_message"])
def test_control_stock_nixl_gives_wrong_output_on_edited_history(stock_cluster, pd_cluster,
                                                                 case):
    """Documents vLLM #43094: the stock connector attaches D's blocks by position, so
    the same request sequence that ours serves correctly differs from the baseline.
    If this test starts failing, upstream fixed the bug."""
    think_id = _think_id(stock_cluster.model)
    # Stock NIXL here (UCX "peer" error handling, so TCP) now and then never finishes
    # a read: in one run D waited 300 s for P's blocks, which P released unread when
    # its lease ran out.  That stall is stock's, not the behaviour this control
    # documents, so a stalled attempt is retried once on a fresh session.
    for attempt in range(2):
        try:
            second, base = _run_edit(stock_cluster.prefill[0], stock_cluster.decode[0],
                                     pd_cluster.colocated, stock_cluster.model, case,
                                     think_id, reset_p=True,
                                     session_id=f"{case}-{attempt}", timeout=60.0)
            break
        except requests.ReadTimeout:
            if attempt:
                raise
            print(f"stock NixlConnector, {case}: a request stalled for 60 s; retrying once")
    result = compare(second.out, base)
    print(f"stock NixlConnector, {case}: {result}")
    assert not result.equal, "stock connector matched the baseline on an edited history"


# --------------------------------------------------------------------------- pricing
def _decisions(url: str) -> dict[str, float]:
    return {d: metric_sum(url, "sessionkv_pull_decisions_total", decision=d)
            for d in ("pull", "recompute")}


def _tail_turn(pd_cluster, context_tokens: int, session: str) -> dict:
    """Turn 2 of a session whose P cache holds turn 1: only D's output is pullable."""
    p_url, d_url, model = pd_cluster.prefill[0], pd_cluster.decode[0], pd_cluster.model
    prompt = _ids(sum(map(ord, session)), context_tokens)
    first = session_turn(p_url, d_url, model, prompt, None, max_tokens=32, session_id=session)
    prompt2 = prompt + first.out.token_ids + _ids(77, 8)
    before = _decisions(p_url)
    second = session_turn(p_url, d_url, model, prompt2, first.handle, max_tokens=8,
                          session_id=session)
    assert_same(second.out, baseline(pd_cluster.colocated, model, prompt2, 8), session)
    after = _decisions(p_url)
    return {"accounting": second.prefill_accounting,
            "delta": {k: after[k] - before[k] for k in after}}


def test_decision_moves_with_context_length(pd_cluster):
    short = _tail_turn(pd_cluster, 200, "ctx-short")
    long = _tail_turn(pd_cluster, 2200, "ctx-long")
    print(f"short context: {short}\nlong context: {long}")
    assert short["delta"] == {"pull": 0, "recompute": 1}, short
    assert short["accounting"].get("pulled_from_peer_tokens", 0) == 0
    assert long["delta"] == {"pull": 1, "recompute": 0}, long
    assert long["accounting"].get("pulled_from_peer_tokens", 0) > 0


def _wait_until_idle(url: str, timeout_s: float = 180) -> None:
    """Until the engine runs no request (background load from a test may linger)."""
    deadline = time.monotonic() + timeout_s
    while metric_sum(url, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, f"{url} never went idle"
        time.sleep(0.5)


# With the tests' prices (SESSION_COST) a 48-token recompute after a 192-token hit
# is priced 1.145 ms x (1 + 0.25 x load): 1.64 ms at load 1.73 and 2.00 ms at 3.0,
# against a pull of 2.04-2.08 ms (the link's price moves with what NIXL measured), so
# both were rightly recomputed (the second in a full-suite run, 2026-12-07, when the
# bound here was 2.5).  The two meet near load 3.3; from 4 on (2.29 ms) a pull is
# cheaper by about a tenth: "busy" means that.
BUSY_LOAD = 4.0
BUSY_WORKERS = 16


def test_busy_prefill_engine_prefers_pulling(pd_cluster):
    """The same short-context tail that an idle P recomputes is pulled while P is
    busy generating for other requests."""
    p_url, model = pd_cluster.prefill[0], pd_cluster.model
    stop = threading.Event()

    def load(max_tokens: int):
        while not stop.is_set():
            try:
                requests.post(p_url + "/v1/completions", json=completion_body(
                    model, _ids(900, 64), max_tokens=max_tokens), timeout=120)
            except requests.RequestException:
                return

    # Lengths staggered: with one length the twelve requests finished together, and a
    # turn arriving in that gap found P (nearly) idle, priced at load 2.9 (a full
    # suite run), and rightly recomputed.
    workers = [threading.Thread(target=load, args=(300 + 40 * i,), daemon=True)
               for i in range(BUSY_WORKERS)]
    for w in workers:
        w.start()
    busy = None
    try:
        # The turn must find P busy when P prices it.  In a full-suite run it once was
        # priced at load 0.3 (P's last step had run one request): the background load
        # was not on P at that instant.  That is the setup missing its moment, not a
        # wrong decision, so a turn priced at load < 1 is tried again (a new session);
        # every turn's decision must still follow its own prices.
        for attempt in range(3):
            deadline = time.monotonic() + 60
            while metric_sum(p_url, "vllm:num_requests_running") < 8:
                assert time.monotonic() < deadline, "background load never reached P"
                time.sleep(0.2)
            turn = _tail_turn(pd_cluster, 200, f"ctx-busy-{attempt}")
            print(f"busy P, short context, attempt {attempt}: {turn}")
            acct = turn["accounting"]
            pulls = acct["priced_pull_ms"] < acct["priced_recompute_ms"]
            assert turn["delta"] == {"pull": int(pulls), "recompute": int(not pulls)}, turn
            if acct["priced_engine_load"] >= BUSY_LOAD:
                busy = turn
                break
    finally:
        stop.set()
    assert busy is not None, f"no turn was priced with P busy (load >= {BUSY_LOAD}) in 3 tries"
    assert busy["delta"] == {"pull": 1, "recompute": 0}, busy
    # Once P is idle again, its estimate (which only moves when P steps) must not
    # price the next turn as if the load were still on.
    _wait_until_idle(p_url)
    after = _tail_turn(pd_cluster, 200, "ctx-after-busy")
    print(f"idle again, short context: {after}")
    assert after["accounting"].get("priced_engine_load", 0) == 0, after
    assert after["delta"] == {"pull": 0, "recompute": 1}, after


# --------------------------------------------------------------------------- failures
@pytest.mark.parametrize("fault", ["expired_lease", "unreachable_peer",
                                   "declined_synchronous_read"])
def test_failed_pull_falls_back_to_recompute(pd_cluster, fault):
    """A pull that cannot complete is recomputed on P: no error, no wrong output, and
    it is counted."""
    from cluster import free_port_block

    p_url, d_url, model = pd_cluster.prefill[0], pd_cluster.decode[0], pd_cluster.model
    session = f"fail-{fault}"
    sync_before = metric_sum(p_url, "sessionkv_peer_loads_total", mode="sync")
    if fault == "declined_synchronous_read":
        # P reads from D once, so its next read from D is synchronous.
        warm = _ids(77, 300)
        turn = post(d_url, "/v1/completions", completion_body(
            model, warm, max_tokens=4, session_id="warm-up",
            kv_transfer_params={"sessionkv": {"session_id": "warm-up"}}))
        session_turn(p_url, d_url, model, warm + turn.token_ids + _ids(5, 20),
                     dict(turn.raw["kv_transfer_params"]), session_id="warm-up")
        # P prices a synchronous read against its engine-load estimate: wait out
        # requests an earlier test left running on P.
        _wait_until_idle(p_url)
        sync_before = metric_sum(p_url, "sessionkv_peer_loads_total", mode="sync")
    prompt = _ids(sum(map(ord, fault)), 600)
    # Turn 1 served on D alone, so P has none of it and would pull everything.
    first = post(d_url, "/v1/completions", completion_body(
        model, prompt, max_tokens=24, session_id=session,
        kv_transfer_params={"sessionkv": {"session_id": session}}))
    handle = dict(first.raw["kv_transfer_params"])
    if fault == "expired_lease":
        # D's lease over, on its own clock and on the wall clock.
        handle["remote_blocks_expiry_time"] = handle["remote_blocks_expiry_time"] - 10_000
        handle["sessionkv"] = dict(handle["sessionkv"], expires_at_unix_s=time.time() - 1)
        expected = "expired_handle"
    elif fault == "declined_synchronous_read":
        # D's lease over on D's clock only: P's scheduler plans the read, P's worker
        # declines it inside the step meant to compute on it.
        handle["remote_blocks_expiry_time"] = handle["remote_blocks_expiry_time"] - 10_000
        expected = "pull_failed"
    else:
        # An engine nobody answers for: the NIXL handshake fails.
        handle["remote_engine_id"] = f"gone-{fault}"
        handle["remote_port"] = free_port_block(1)
        expected = "pull_failed"
    failures_before = metric_sum(p_url, "sessionkv_pull_failures_total")
    prompt2 = prompt + first.token_ids + _ids(9, 40)
    second = session_turn(p_url, d_url, model, prompt2, handle, session_id=session)
    assert_same(second.out, baseline(pd_cluster.colocated, model, prompt2), fault)
    acct = second.prefill_accounting
    assert acct.get("pulled_from_peer_tokens", 0) == 0, acct
    assert expected in acct["decision"], acct
    assert metric_sum(p_url, "sessionkv_pull_failures_total") > failures_before
    if fault == "declined_synchronous_read":
        assert metric_sum(p_url, "sessionkv_peer_loads_total", mode="sync") == \
            sync_before + 1
