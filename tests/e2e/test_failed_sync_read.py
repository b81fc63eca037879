"""A failed synchronous read leaves nothing findable in the reader's prefix cache.

vLLM hashes a synchronous load's blocks when it allocates them, before the read; under
``kv_load_failure_policy: recompute`` it keeps a failed read's blocks cached under the
prompt's hashes and counts on the request recomputing them.  Here the request is
aborted while that recompute is under way (P computes 8 tokens a step, so the
recompute of a long prompt spans many steps): its blocks are freed with their hashes,
and the next request with that prefix would attach KV nothing wrote.

The case, on real engines (P, D and a co-located server, float32, the tiny model): a
turn held on D, the hold ended by a reset (so P's claim is refused: the read fails),
P's turn with that handle sent and aborted by its client as soon as P counts the
refused claim (P's metrics, polled), then the same prompt sent straight to P, with no
handle.  With the quarantine (the default) the answer equals the co-located server's,
in each of three such victims; the negative control (``sync_read_quarantine: false``,
vLLM's own behaviour) must differ in at least one of up to six, which shows the case
reaches the window.  A try whose abort lands after P answered shows nothing (P's
``vllm:request_success_total`` counts it): each arm must have at least one try whose
abort landed in the window, and the failure message says how many did.
The read must have been synchronous and refused, or the test proves nothing.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse

import pytest
import requests

from cluster import (
    SESSION_COST,
    TEST_DTYPE,
    TEST_ENGINE_ARGS,
    TEST_KV_CACHE_GB,
    free_port_block,
)
from helpers import (
    assert_same,
    compare,
    completion_body,
    metric_sum,
    post,
    reset_prefix_cache,
    wait_until,
)

pytestmark = pytest.mark.cluster

PROMPT_TOKENS = 6400        # about 800 steps of P's recompute at 8 tokens a step
CHUNK_TOKENS = 8
MAX_MODEL_LEN = 8192        # the tiny model's positions; the launcher's default is 4096
TRIES = 3                   # with the quarantine: every one must be right
CONTROL_TRIES = 6           # without: until one is wrong
# Every warm pull runs inside the step (the read this test fails must be synchronous).
SYNC_COST = dict(SESSION_COST, sync_load_max_stall_s=0.5)


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729 + (i * i) % 13) % 990 + 20 for i in range(n)]


def _engine(tiny_model: str, role: str, port: int, **options):
    from vllm_sessionkv.dev.launch import EngineSpec

    return EngineSpec(role=role, model=tiny_model, port=port, dtype=TEST_DTYPE,
                      kv_cache_space_gb=TEST_KV_CACHE_GB, served_model_name=tiny_model,
                      max_model_len=MAX_MODEL_LEN,
                      extra_args=[*TEST_ENGINE_ARGS, *options.pop("extra_args", [])], **options)


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """D, the co-located server and a P of each arm (quarantine on, off), started
    together (one after another, the P took a minute more each) and shared."""
    from vllm_sessionkv.dev.launch import start_engine, stop_all, wait_healthy

    log_dir = tmp_path_factory.mktemp("failed-sync-read-logs")
    base = free_port_block(7)
    specs = {"decode": _engine(tiny_model, "decode", base, side_channel_port=base + 1,
                               sessionkv={"cost": SESSION_COST}),
             "colocated": _engine(tiny_model, "colocated", base + 2)}
    for i, quarantine in enumerate((True, False)):
        port = base + 3 + 2 * i
        specs[f"prefill-{quarantine}"] = _engine(
            tiny_model, "prefill", port, side_channel_port=port + 1,
            sessionkv={"cost": SYNC_COST, "sync_read_quarantine": quarantine},
            extra_args=["--max-num-batched-tokens", str(CHUNK_TOKENS)])
    procs = []
    try:
        for name, spec in specs.items():
            procs.append(start_engine(spec, name, log_dir))
        wait_healthy([(proc, spec.url) for proc, spec in zip(procs, specs.values())],
                     timeout_s=400)
        yield {name: spec.url for name, spec in specs.items()}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module", params=[True, False], ids=["quarantine", "no_quarantine"])
def prefill(request, engines):
    return engines[f"prefill-{request.param}"], request.param


def _held_on_d(d_url: str, model: str, prompt: list[int], session: str):
    out = post(d_url, "/v1/completions", completion_body(
        model, prompt, max_tokens=8, session_id=session,
        kv_transfer_params={"sessionkv": {"session_id": session}}))
    return out, dict(out.raw["kv_transfer_params"], do_remote_decode=True,
                     do_remote_prefill=False)


def _send_without_reading(url: str, body: dict) -> http.client.HTTPConnection:
    """POST a completion and leave its answer unread (the caller hangs up)."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    return conn


def _pull_turn(p_url: str, model: str, prompt: list[int], session: str, handle: dict):
    body = completion_body(model, prompt, max_tokens=1, session_id=session,
                           kv_transfer_params=handle)
    return requests.post(p_url + "/v1/completions", json=body, timeout=300)


def test_an_aborted_request_after_a_failed_sync_read_leaves_no_wrong_kv(
        engines, prefill, tiny_model):
    p_url, quarantine = prefill
    d_url, model = engines["decode"], tiny_model
    for url in (p_url, d_url):
        reset_prefix_cache(url)

    # Victims: the abort must land while P still recomputes (a try whose abort came
    # after P answered is out of the window and shows nothing).  With the quarantine
    # every try must be right; the negative control must answer wrongly at least once.
    tries = in_window = wrong = 0
    for attempt in range(TRIES if quarantine else CONTROL_TRIES):
        direct, expected, aborted_in_time = _aborted_failed_read_then_straight_to_p(
            p_url, d_url, model, engines["colocated"], seed=10 * attempt + 3)
        tries += 1
        in_window += aborted_in_time
        if quarantine:
            assert_same(direct, expected,
                        f"straight to P after the aborted failed read (try {attempt + 1})")
        elif not compare(direct, expected).equal:
            wrong += 1
            break
    assert in_window, (f"no abort of {tries} tries landed before P answered: the case no "
                       "longer reaches the window it tests")
    if not quarantine:
        # vLLM's own behaviour: the failed read's blocks were found under the prompt's
        # hashes.
        assert wrong, (f"every answer was right without the quarantine ({in_window} of "
                       f"{tries} aborts landed before P answered)")


def _claims_refused(p_url: str) -> float:
    return metric_sum(p_url, "sessionkv_pull_guard_fallbacks_total", reason="claim_refused")


def _answered(p_url: str) -> float:
    return metric_sum(p_url, "vllm:request_success_total")


def _aborted_failed_read_then_straight_to_p(p_url: str, d_url: str, model: str,
                                            colocated_url: str, seed: int):
    """A turn held on D, the hold ended, P's synchronous read of it refused and the
    request aborted while P recomputes; then the same prompt straight to P, the
    co-located server's answer to it, and whether the abort landed before P answered
    the aborted request."""
    # A first read from D is asynchronous (handshake), and a failed read makes D a
    # cold peer again: a good read first makes the next one synchronous.
    warm, warm_handle = _held_on_d(d_url, model, _ids(seed + 500, 300), f"warm-{seed}")
    resp = _pull_turn(p_url, model, _ids(seed + 500, 300) + warm.token_ids
                      + _ids(seed + 501, 20), f"warm-{seed}", warm_handle)
    resp.raise_for_status()
    acct = resp.json()["kv_transfer_params"]["sessionkv"]["accounting"]
    assert acct["pulled_from_peer_tokens"] > 0, acct

    prompt = _ids(seed, PROMPT_TOKENS)
    session = f"victim-{seed}"
    first, handle = _held_on_d(d_url, model, prompt, session)
    released = metric_sum(d_url, "sessionkv_session_holds_released_total", reason="reset")
    reset_prefix_cache(d_url)
    wait_until(lambda: metric_sum(d_url, "sessionkv_session_holds_released_total",
                                  reason="reset") > released, 60, "D's hold ended")

    final_prompt = prompt + first.token_ids + _ids(seed + 1, 40)
    sync_before = metric_sum(p_url, "sessionkv_peer_loads_total", mode="sync")
    refused_before = _claims_refused(p_url)
    answered_before = _answered(p_url)
    # The client hangs up as soon as P counts the refused claim (polled without a
    # pause), while P recomputes the failed read's blocks CHUNK_TOKENS a step: vLLM
    # aborts the request.
    conn = _send_without_reading(p_url, completion_body(
        model, final_prompt, max_tokens=1, session_id=session, kv_transfer_params=handle))
    deadline = time.monotonic() + 60
    while _claims_refused(p_url) == refused_before:
        assert time.monotonic() < deadline, "P's claim was never refused"
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: metric_sum(p_url, "vllm:num_requests_running") == 0
               and metric_sum(p_url, "vllm:num_requests_waiting") == 0, 60,
               "P done with the aborted request")
    assert metric_sum(p_url, "sessionkv_peer_loads_total", mode="sync") == sync_before + 1
    assert _claims_refused(p_url) == refused_before + 1
    aborted_in_time = _answered(p_url) == answered_before

    direct = post(p_url, "/v1/completions", completion_body(model, final_prompt,
                                                            max_tokens=16))
    expected = post(colocated_url, "/v1/completions",
                    completion_body(model, final_prompt, max_tokens=16))
    return direct, expected, aborted_in_time
