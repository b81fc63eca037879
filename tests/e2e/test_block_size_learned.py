"""Engines at --block-size 64 behind a proxy left at its defaults route by KV events.

Two plain vLLM engines (the CPU build takes multiples of 32; 64 is not the proxy's
old fixed 32) publish KV events; a ``sessionkv-proxy`` process is given only the
engines (``--decode url=...,events=...,replay=...``) and a port.  A prompt sent
straight to one engine enters its prefix cache; the proxy learns 64 from that
engine's events and routes a request continuing the prompt, with no session, to the
engine that holds it, each way round.  Each answer equals the other engine's
(token ids and top-5 logprobs, temperature 0).

Negative control: a second proxy over the same engines told ``--block-size 32``
indexes none of their blocks, counts the refused events, and names both engines
in ``/health``.  The engines are the session's ``plain_engines`` (conftest.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from cluster import free_port_block, start_proxy_process
from helpers import assert_same, completion_body, metric_sum, post, wait_until

from vllm_sessionkv.dev.launch import EngineSpec

pytestmark = pytest.mark.cluster

BLOCK_SIZE = 64
PROMPTS = {"a": list(range(300, 300 + 4 * BLOCK_SIZE)),
           "b": list(range(600, 600 + 4 * BLOCK_SIZE))}


@pytest.fixture(scope="module")
def engines(plain_engines) -> dict[str, EngineSpec]:
    assert plain_engines["a"].block_size == BLOCK_SIZE
    return plain_engines


def start_proxy(engines: dict[str, EngineSpec], *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port_block(1)
    argv = [sys.executable, "-m", "sessionkv_proxy", "--host", "127.0.0.1",
            "--port", str(port), *flags]
    for spec in engines.values():
        argv += ["--decode", f"url={spec.url},events={spec.kv_events_endpoint},"
                             f"replay={spec.kv_events_replay_endpoint}"]
    return start_proxy_process(argv, port, timeout_s=60)


def health(url: str) -> dict:
    return requests.get(url + "/health", timeout=10).json()


def test_a_proxy_at_defaults_learns_64_and_routes_to_the_engine_holding_the_prefix(
        engines, tiny_model):
    proxy, url = start_proxy(engines)
    try:
        # The engines are shared (other modules' requests may have published events on
        # either before this proxy started, and it replays them): it learns from
        # whichever engine's events it applies first.
        learned = {f"learned from {spec.url}" for spec in engines.values()}
        for holder in ("b", "a"):
            other = "a" if holder == "b" else "b"
            post(engines[holder].url, "/v1/completions",
                 completion_body(tiny_model, PROMPTS[holder], max_tokens=1))
            wait_until(lambda: metric_sum(url, "sessionkv_proxy_events_applied",
                                          engine=engines[holder].url) >= 1,
                       60, f"the proxy applying engine {holder}'s KV events")
            block_size = health(url)["block_size"]
            assert block_size["tokens"] == BLOCK_SIZE and block_size["source"] in learned, \
                block_size
            body = completion_body(tiny_model, PROMPTS[holder] + [7, 8, 9, 10], max_tokens=8)
            answer = post(url, "/v1/completions", body)
            assert answer.headers["x-sessionkv-decode-engine"] == engines[holder].url, \
                answer.headers
            assert_same(answer, post(engines[other].url, "/v1/completions", body),
                        f"routed to engine {holder}")
        report = health(url)
        assert report["status"] == "ok", report["problems"]
        assert metric_sum(url, "sessionkv_proxy_events_dropped") == 0
    finally:
        proxy.terminate()
        proxy.wait(30)


def test_a_proxy_told_another_size_indexes_nothing_and_says_why(engines, tiny_model):
    """The negative control: the same engines and events, the proxy at 32."""
    for name, spec in engines.items():
        post(spec.url, "/v1/completions", completion_body(tiny_model, PROMPTS[name],
                                                          max_tokens=1))
    proxy, url = start_proxy(engines, "--block-size", "32")
    try:
        wait_until(lambda: all(metric_sum(url, "sessionkv_proxy_events_dropped",
                                          engine=spec.url, reason="block_size_mismatch") >= 1
                               for spec in engines.values()),
                   60, "both engines' events refused")
        report = health(url)
        assert report["block_size"]["tokens"] == 32
        assert report["block_size"]["source"] == "configured"
        assert report["status"] == "degraded"
        for spec in engines.values():
            assert (f"kv events of {spec.url} have block size 64, the proxy routes in "
                    "blocks of 32: not indexed") in report["problems"]
        assert metric_sum(url, "sessionkv_proxy_index_blocks") == 0
        assert metric_sum(url, "sessionkv_proxy_events_applied") == 0
    finally:
        proxy.terminate()
        proxy.wait(30)
