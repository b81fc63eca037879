"""Foundation: requests go proxy -> P -> NIXL -> D and equal a co-located server.

Real vLLM servers, real NIXL transfers over UCX, real Redis.  Each test checks token
ids and top-5 logprobs against the co-located baseline.
"""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest

from vllm_sessionkv.wire.early_decode import EarlyDecodeSender, new_early_decode_id
from vllm_sessionkv.dev.launch import cpu_seconds, process_tree

from helpers import (
    assert_same,
    chat_body,
    compare,
    completion_body,
    fresh_prefill_params,
    metric_sum,
    post,
    wait_until,
)

pytestmark = pytest.mark.cluster

PROMPT_IDS = [(7 * i + 3) % 900 + 20 for i in range(150)]
MESSAGES = [{"role": "system", "content": "tool call result kato rimu senlo " * 12},
            {"role": "user", "content": "the vaqu is of zipe and dramon? " * 6}]


def test_local_cluster_ready_within_two_minutes(pd_cluster):
    print(f"local_cluster.py READY after {pd_cluster.ready_s:.0f}s")
    assert pd_cluster.ready_s < 120.0, f"READY after {pd_cluster.ready_s:.0f}s"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_through_proxy_equals_baseline(pd_cluster, stream):
    d_url = pd_cluster.decode[0]
    bytes_before = metric_sum(d_url, "vllm:nixl_bytes_transferred_sum")
    waits_before = metric_sum(d_url, "sessionkv_idle_step_recv_wait_seconds_count")
    sync_before = metric_sum(d_url, "sessionkv_peer_loads_total", mode="sync")
    early_before = metric_sum(d_url, "sessionkv_early_decode_requests_total")
    early_ready_before = metric_sum(d_url, "sessionkv_early_decode_requests_total",
                                    outcome="ready")
    p_pushes_before = metric_sum(pd_cluster.prefill[0], "sessionkv_early_decode_pushes_total")
    body = completion_body(pd_cluster.model, PROMPT_IDS, max_tokens=24, stream=stream)
    got = post(pd_cluster.proxy, "/v1/completions", body)
    base = post(pd_cluster.colocated, "/v1/completions", dict(body, stream=False))
    assert_same(got, base, f"completions stream={stream}")
    assert got.headers.get("x-sessionkv-route") == "disaggregated"
    assert metric_sum(d_url, "vllm:nixl_bytes_transferred_sum") > bytes_before
    # D had nothing else to run: its read from P (which it has read from before in all
    # but the module's first test) ran inside the step that computed the request, or
    # the step that posted it waited for it.
    assert (metric_sum(d_url, "sessionkv_peer_loads_total", mode="sync") == sync_before + 1
            or metric_sum(d_url, "sessionkv_idle_step_recv_wait_seconds_count")
            > waits_before)
    assert metric_sum(d_url, "vllm:nixl_num_failed_transfers_total") == 0
    # D got the request while P prefilled, held it, and then P's parameters.
    assert metric_sum(d_url, "sessionkv_early_decode_requests_total") == early_before + 1
    assert metric_sum(d_url, "sessionkv_early_decode_requests_total",
                      outcome="ready") == early_ready_before + 1
    # P's connector pushed its parameters to D itself (connected while it prefilled).
    assert metric_sum(pd_cluster.prefill[0],
                      "sessionkv_early_decode_pushes_total") == p_pushes_before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_proxy_equals_baseline(pd_cluster, stream):
    d_url = pd_cluster.decode[0]
    bytes_before = metric_sum(d_url, "vllm:nixl_bytes_transferred_sum")
    body = chat_body(pd_cluster.model, MESSAGES, max_tokens=24, stream=stream)
    got = post(pd_cluster.proxy, "/v1/chat/completions", body)
    base = post(pd_cluster.colocated, "/v1/chat/completions", dict(body, stream=False))
    assert_same(got, base, f"chat stream={stream}")
    assert metric_sum(d_url, "vllm:nixl_bytes_transferred_sum") > bytes_before


@pytest.mark.parametrize("path, stream", [("/v1/completions", False),
                                          ("/v1/completions", True),
                                          ("/v1/chat/completions", False),
                                          ("/v1/chat/completions", True)])
def test_one_token_request_is_served_by_prefill_alone(pd_cluster, path, stream):
    """Nothing to decode: P answers it whole; D and NIXL are not touched."""
    p_url, d_url = pd_cluster.prefill[0], pd_cluster.decode[0]
    if path == "/v1/completions":
        body = completion_body(pd_cluster.model, PROMPT_IDS[::-1], max_tokens=1,
                               stream=stream)
    else:  # the chat cap vLLM reads first
        body = chat_body(pd_cluster.model, MESSAGES[::-1], stream=stream,
                         max_completion_tokens=1)
        del body["max_tokens"]

    def counts() -> tuple[float, float, float]:
        return (metric_sum(p_url, "vllm:request_success_total"),
                metric_sum(d_url, "vllm:request_success_total"),
                metric_sum(d_url, "vllm:nixl_bytes_transferred_sum"))

    before = counts()
    got = post(pd_cluster.proxy, path, body)
    # vLLM counts a finished request after its answer is out.
    wait_until(lambda: counts()[0] > before[0], 30, "P to count the finished request")
    after = counts()
    base = post(pd_cluster.colocated, path, dict(body, stream=False))
    assert_same(got, base, f"{path} stream={stream}, one token")
    assert got.headers.get("x-sessionkv-route") == "prefill_only", got.headers
    assert got.headers.get("x-sessionkv-prefill-engine") == p_url
    assert len(got.token_ids) == 1
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (1, 0, 0)


def _pull_through(p_url: str, d_url: str, model: str, prompt: list[int], max_tokens: int,
                  timeout: float = 300.0):
    """P prefills ``prompt`` for D, then D decodes on P's handle.

    Returns D's generation, whether NIXL bytes reached D meanwhile (a failed read
    makes D recompute, which looks the same from outside), and D's request time."""
    p_out = post(p_url, "/v1/completions",
                 completion_body(model, prompt, max_tokens=1,
                                 kv_transfer_params=fresh_prefill_params()))
    bytes_before = metric_sum(d_url, "vllm:nixl_bytes_transferred_sum")
    started = time.perf_counter()
    got = post(d_url, "/v1/completions",
               completion_body(model, prompt, max_tokens=max_tokens,
                               kv_transfer_params=p_out.raw["kv_transfer_params"]),
               timeout=timeout)
    took_s = time.perf_counter() - started
    return got, metric_sum(d_url, "vllm:nixl_bytes_transferred_sum") > bytes_before, took_s


def test_first_pull_from_a_new_prefill_is_prompt_while_decode_is_busy(pd_cluster):
    """D's first read from a P it has never talked to, while D is busy decoding.

    With NIXL's default UCX peer error handling, two engines on one host talk over
    TCP, and setting up that connection needs UCX progress on P, which P only gives
    in certain states: this first read waited for P's 30 s lease to run out, or for
    minutes.  It must take about as long as any other pull.  Uses the perturbed-model
    P, which has handed no KV to D yet (its output is the negative control's
    business, below)."""
    p_url = pd_cluster.extras["perturbed_prefill"]
    d_url = pd_cluster.decode[0]
    stop = threading.Event()

    def keep_decode_busy(seed: int) -> None:
        prompt = [(13 * i + seed) % 900 + 20 for i in range(60)]
        while not stop.is_set():
            post(d_url, "/v1/completions",
                 completion_body(pd_cluster.model, prompt, max_tokens=200), timeout=120)

    load = [threading.Thread(target=keep_decode_busy, args=(seed,), daemon=True)
            for seed in (1, 2)]
    for thread in load:
        thread.start()
    took, crossed = [], False
    try:
        wait_until(lambda: metric_sum(d_url, "vllm:num_requests_running") >= 2, 60,
                   "D to run both background requests")
        # A handshake can still time out on a loaded 2-core machine (D then
        # recomputes); a second attempt then makes the first real read.
        for attempt in range(2):
            prompt = [(17 * i + 7 + attempt) % 900 + 20 for i in range(140)]
            _, crossed, took_s = _pull_through(p_url, d_url, pd_cluster.model, prompt,
                                               max_tokens=8, timeout=90)
            took.append(took_s)
            if crossed:
                break
    finally:
        stop.set()
        for thread in load:
            thread.join(timeout=150)
    print(f"first pulls from a new P under load took {[round(t, 2) for t in took]} s")
    assert crossed, "no NIXL transfer from the new P in 2 attempts"
    assert max(took) < 15.0, f"a first pull from a new P took {max(took):.1f} s"


def test_early_decode_request_told_its_prefill_failed_is_computed_on_d(pd_cluster):
    """D holds a request sent with an early-decode id and no P parameters; told that P
    failed, it computes the prompt itself and answers as the co-located server does."""
    d_url = pd_cluster.decode[0]
    failed_before = metric_sum(d_url, "sessionkv_early_decode_requests_total",
                               outcome="prefill_failed")
    prompt = [(11 * i + 5) % 900 + 20 for i in range(140)]
    body = completion_body(pd_cluster.model, prompt, max_tokens=16)
    body["kv_transfer_params"] = {"sessionkv": {"early_decode_id": new_early_decode_id()}}
    answer: dict = {}
    thread = threading.Thread(
        target=lambda: answer.update(got=post(d_url, "/v1/completions", body)))
    thread.start()
    # D holds the request (waiting for P's parameters, which never come unasked).
    wait_until(lambda: not thread.is_alive()
               or metric_sum(d_url, "vllm:num_requests_waiting")
               + metric_sum(d_url, "vllm:num_requests_running") >= 1, 30,
               "D to hold the request")
    assert thread.is_alive(), "D answered a request still waiting for P's parameters"
    sender = EarlyDecodeSender([pd_cluster.early_decode[d_url]])
    try:
        deadline = time.monotonic() + 10
        early_id = body["kv_transfer_params"]["sessionkv"]["early_decode_id"]
        while not sender.send(pd_cluster.early_decode[d_url], early_id, None):
            assert time.monotonic() < deadline, "D's early-decode socket never connected"
            time.sleep(0.05)
    finally:
        sender.close()
    thread.join(120)
    assert "got" in answer, "D did not answer after P's failure was pushed"
    base = post(pd_cluster.colocated, "/v1/completions",
                completion_body(pd_cluster.model, prompt, max_tokens=16))
    assert_same(answer["got"], base, "early decode, prefill failed")
    assert metric_sum(d_url, "sessionkv_early_decode_requests_total",
                      outcome="prefill_failed") == failed_before + 1


def test_negative_control_perturbed_prefill_is_detected(pd_cluster):
    """P runs a model whose k/v projections are scaled by -3.  D decodes on the KV
    it pulls, so its output must differ from the baseline: proof that the
    comparison can fail and that D really uses transferred KV."""
    p_url = pd_cluster.extras["perturbed_prefill"]
    d_url = pd_cluster.decode[0]
    # A read from P can fail on a loaded 2-core machine (a handshake timeout); D then
    # recomputes (the failure policy), which proves nothing here.  Only an attempt
    # whose bytes really crossed counts.
    for attempt in range(3):
        prompt = [(11 * i + 5 + attempt) % 900 + 20 for i in range(140)]  # not cached on D
        got, crossed, _ = _pull_through(p_url, d_url, pd_cluster.model, prompt, max_tokens=24)
        if crossed:
            break
    else:
        pytest.fail("no NIXL transfer from the perturbed P in 3 attempts")
    base = post(pd_cluster.colocated, "/v1/completions",
                completion_body(pd_cluster.model, prompt, max_tokens=24))
    result = compare(got, base)
    assert not result.equal, "D's output ignored the perturbed KV it was handed"
    acct = got.raw["kv_transfer_params"]["sessionkv"]["accounting"]
    assert acct["pulled_from_peer_tokens"] > 0


def test_read_from_a_known_peer_runs_inside_the_computing_step(pd_cluster):
    """Once D has read from a P, its next read from it (short, D idle) is synchronous:
    posted and waited for by the step that computes the request, not by a step of its
    own.  The output still equals the co-located server's, so the read landed before
    the forward used it; and with the perturbed P it differs, so the forward used
    what the read brought, not blocks computed on D."""
    d_url = pd_cluster.decode[0]
    # 129 tokens: the synchronous load stops a token short, at a block boundary (block
    # size 32), so the read must still fill the block holding only the last token.
    cases = ((pd_cluster.prefill[0], True, 140), (pd_cluster.prefill[0], True, 129),
             (pd_cluster.extras["perturbed_prefill"], False, 140))
    for case, (p_url, same, length) in enumerate(cases):
        for attempt in range(3):   # the first reads may be asynchronous (and may fail)
            # Distinct prompts: none is in D's prefix cache.
            prompt = [(19 * i + 3 + attempt + 100 * case) % 900 + 20 for i in range(length)]
            sync_before = metric_sum(d_url, "sessionkv_peer_loads_total", mode="sync")
            got, crossed, _ = _pull_through(p_url, d_url, pd_cluster.model, prompt,
                                            max_tokens=12)
            if crossed and metric_sum(d_url, "sessionkv_peer_loads_total",
                                      mode="sync") == sync_before + 1:
                break
        else:
            pytest.fail(f"no synchronous read from {p_url} in 3 attempts")
        base = post(pd_cluster.colocated, "/v1/completions",
                    completion_body(pd_cluster.model, prompt, max_tokens=12))
        if same:
            assert_same(got, base, "synchronous read")
        else:
            assert not compare(got, base).equal, "D ignored the perturbed KV it read"
        acct = got.raw["kv_transfer_params"]["sessionkv"]["accounting"]
        assert acct["pulled_from_peer_tokens"] == len(prompt) - 1, acct
    assert metric_sum(d_url, "sessionkv_sync_load_timeouts_total") == 0
    assert metric_sum(d_url, "vllm:nixl_num_failed_transfers_total") == 0


def _engine_pid(url: str) -> int:
    """The process listening on an engine's HTTP port (its API server)."""
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise AssertionError(f"no process listens on {url}")


def _cpu_shares(groups: dict[str, list[psutil.Process]], window_s: float = 10.0
                ) -> dict[str, float]:
    """Cores' worth of CPU (1.0 = one core) that each group of processes used over
    the same ``window_s``."""
    before = {name: cpu_seconds(procs) for name, procs in groups.items()}
    time.sleep(window_s)
    return {name: (cpu_seconds(procs) - before[name]) / window_s
            for name, procs in groups.items()}


def _cluster_procs(pd_cluster) -> list[psutil.Process]:
    """Every process local_cluster.py started (P, D, Redis, proxy, with children)."""
    return process_tree(pd_cluster.descendants + [pd_cluster.launcher.pid])


def _wait_for_no_session_holds(cluster, timeout_s: float = 150.0) -> None:
    """Until no D holds a session turn for a next one: an earlier test's session
    keeps D stepping (paced) for its lease, 120 s by default."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = sum(metric_sum(d, "sessionkv_session_holds") for d in cluster.decode)
        if held == 0:
            return
        assert time.monotonic() < deadline, f"{held:g} session holds after {timeout_s} s"
        time.sleep(1.0)


def _wait_until_drained(cluster, timeout_s: float = 60.0) -> None:
    """Until no engine of the cluster runs or queues a request, and then until the
    cluster's processes have been quiet for one second: an engine that just finished
    work spins up to 1 s before it blocks (vLLM's busy loop)."""
    engines = [*cluster.prefill, *cluster.decode]
    wait_until(lambda: sum(metric_sum(u, "vllm:num_requests_running")
                           + metric_sum(u, "vllm:num_requests_waiting")
                           for u in engines) == 0, timeout_s, "the engines to drain")
    procs = _cluster_procs(cluster)
    wait_until(lambda: _cpu_shares({"cluster": procs}, window_s=1.0)["cluster"] < 0.20,
               timeout_s, "a second of the cluster under a fifth of a core")


def test_idle_cluster_uses_under_20_percent_of_a_core(pd_cluster):
    """Idle for 10 s, with no session lease held."""
    _wait_for_no_session_holds(pd_cluster)
    _wait_until_drained(pd_cluster)
    used = _cpu_shares({"cluster": _cluster_procs(pd_cluster)})["cluster"]
    print(f"idle 1P+1D cluster: {used * 100:.1f}% of one core over 10 s")
    assert used < 0.20, f"idle cluster uses {used * 100:.1f}% of one core"


def test_cluster_holding_a_session_uses_under_half_a_core_and_still_serves_it(pd_cluster):
    """While D holds a session's blocks for the next turn, vLLM 0.32 steps D's engine
    back to back (about 1.4 cores on this machine); the connector paces those steps
    (``holding_step_interval_s``) and caps its queues' spin while it only holds
    (``engine_busy_poll_s``): the holding D under a quarter of a core, the cluster
    under half.  The paced D must still hand the turn to P."""
    session = {"X-Session-ID": "holding-cpu"}
    history = [(5 * i + 2) % 900 + 20 for i in range(1000)]
    first = post(pd_cluster.proxy, "/v1/completions",
                 # D's output fills blocks that only D holds: turn 2 must pull them.
                 completion_body(pd_cluster.model, history, max_tokens=200), headers=session)
    # D holds the turn for the next one, and says so.
    wait_until(lambda: metric_sum(first.headers["x-sessionkv-decode-engine"],
                                  "sessionkv_session_holds") >= 1, 30,
               "D to report the session hold")
    assert metric_sum(first.headers["x-sessionkv-decode-engine"],
                      "sessionkv_session_holds") == 1
    d_url = first.headers["x-sessionkv-decode-engine"]
    shares = _cpu_shares({"cluster": _cluster_procs(pd_cluster),
                          "D": process_tree([_engine_pid(d_url)])})
    print(f"1P+1D cluster with D holding a session: {shares['cluster'] * 100:.1f}% of one "
          f"core over 10 s, the holding D {shares['D'] * 100:.1f}%")
    assert shares["D"] < 0.25, f"a D holding one session uses {shares['D'] * 100:.1f}%"
    assert shares["cluster"] < 0.50, \
        f"a cluster holding one session uses {shares['cluster'] * 100:.1f}% of one core"

    prompt = history + first.token_ids + [(3 * i + 1) % 900 + 20 for i in range(60)]
    body = completion_body(pd_cluster.model, prompt, max_tokens=8)
    got = post(pd_cluster.proxy, "/v1/completions", body, headers=session)
    assert got.headers.get("x-sessionkv-handle") == "attached", dict(got.headers)
    prefill_acct = json.loads(got.headers["x-sessionkv-prefill"])
    assert prefill_acct.get("pulled_from_peer_tokens", 0) > 0, prefill_acct
    assert_same(got, post(pd_cluster.colocated, "/v1/completions", body), "held turn")


def test_admin_reset_drops_session_holds_so_the_prefix_cache_resets(pd_cluster):
    """D's session holds pin blocks, so vLLM's own reset on D answers 200 with
    ``{"success": false}``.  The proxy's ``POST /admin/reset`` has each engine drop its
    holds (``reset_external``) and checks every engine's answer body."""
    import requests

    session = {"X-Session-ID": "admin-reset"}
    first = post(pd_cluster.proxy, "/v1/completions",
                 completion_body(pd_cluster.model, PROMPT_IDS, max_tokens=8), headers=session)
    d_url = first.headers["x-sessionkv-decode-engine"]
    wait_until(lambda: metric_sum(d_url, "sessionkv_session_holds") >= 1, 30,
                "D to report the turn's hold")
    resets_before = metric_sum(d_url, "sessionkv_session_holds_released_total",
                               reason="reset")

    direct = requests.post(d_url + "/reset_prefix_cache", timeout=30)
    assert direct.status_code == 200 and direct.json() == {"success": False}, direct.text

    admin = requests.post(pd_cluster.proxy + "/admin/reset", timeout=60)
    assert admin.status_code == 200, admin.text
    body = admin.json()
    assert body["success"] is True and body["failed"] == [], body
    assert set(body["engines"]) == {*pd_cluster.prefill, *pd_cluster.decode}, body
    assert all(r["success"] for r in body["engines"].values()), body

    wait_until(lambda: metric_sum(d_url, "sessionkv_session_holds") == 0, 30,
                "the hold gauge to drop")
    assert metric_sum(d_url, "sessionkv_session_holds_released_total",
                      reason="reset") > resets_before
    direct = requests.post(d_url + "/reset_prefix_cache", timeout=30)
    assert direct.status_code == 200 and direct.json() == {"success": True}, direct.text
    # The engines still serve after the reset.
    after = post(pd_cluster.proxy, "/v1/completions",
                 completion_body(pd_cluster.model, PROMPT_IDS, max_tokens=8))
    assert_same(after, post(pd_cluster.colocated, "/v1/completions",
                            completion_body(pd_cluster.model, PROMPT_IDS, max_tokens=8)),
                "after reset")
