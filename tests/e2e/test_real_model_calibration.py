"""The real model with no ``cost`` configuration: P prices recompute from its own steps.

SmolLM2-135M-Instruct (``sessionkv-real-model``) behind 1P+1D+Redis and our proxy,
disaggregation forced, and no ``cost`` in the connector's config: the recompute price
starts at the prior sized for the tiny test model (``cost.recompute_prior_s_per_token``,
2e-5 s a token), at which P would recompute D's blocks of an earlier answer rather than
pull them.  After a few warm-up prompts P has timed its own prefill steps
(``Pricing.step_finished``), and the next turn of a session pulls those blocks
(accounting ``d_to_p:pull``), priced with the calibrated price, which the gauge
``sessionkv_recompute_seconds_per_token`` on P shows.  The control is in the same
figures: the pull's priced time is above what the prior would have priced the
recompute at, so with the prior the decision would have been ``recompute``.

Cost on the 2-core machine: two eager engines' start and four prompts of about a
thousand tokens (prefill runs at about 190 tokens/s here).
"""

from __future__ import annotations

import json
import re

import pytest
import requests

from cluster import launch_cluster, stop_cluster
from helpers import chat_body, post

from vllm_sessionkv.config import CostConfig
from vllm_sessionkv.dev.real_model import SERVED_NAME
from vllm_sessionkv.wire.cost import RecomputeModel, recompute_time_s

DTYPE = "float32"
MAX_MODEL_LEN = 4096
ANSWER_TOKENS = 48
WARM_UPS = 2


def long_text(seed: int, sentences: int = 60) -> str:
    """About a thousand tokens of plain prose, different for each seed (no prefix
    cache hit between the warm-ups and the session)."""
    words = ["river", "stone", "lantern", "garden", "signal", "harbor", "engine", "meadow",
             "ledger", "compass", "thread", "window", "orchard", "bridge", "market"]
    out = []
    for i in range(sentences):
        a, b, c = (words[(seed * 7 + i * k) % len(words)] for k in (1, 3, 5))
        out.append(f"Note {seed}.{i}: the {a} near the {b} kept its {c} until day {i + seed}.")
    return " ".join(out)


def ask(proxy: str, messages: list[dict], session: str) -> tuple[str, dict]:
    got = post(proxy, "/v1/chat/completions",
               chat_body(SERVED_NAME, messages, max_tokens=ANSWER_TOKENS,
                         prompt_cache_key=session))
    return got.text, json.loads(got.headers.get("x-sessionkv-prefill", "{}"))


def gauge(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    found = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.M)
    assert found, f"{name} not on {url}/metrics"
    return float(found.group(1))


@pytest.fixture(scope="module")
def uncosted_cluster(real_model, tmp_path_factory):
    cluster = launch_cluster(real_model, tmp_path_factory.mktemp("calibration-logs"), [
        "--prefill", "1", "--decode", "1", "--redis", "--dtype", DTYPE, "--enforce-eager",
        "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN),
        "--decode-only-max-uncached-tokens", "-1",
        "--nixl-extra-config", json.dumps({"enforce_handshake_compat": False}),
    ], ready_timeout_s=900)
    try:
        yield cluster
    finally:
        report = stop_cluster(cluster)
        assert not report.get("alive"), report


@pytest.mark.cluster
def test_p_pulls_where_a_pull_is_cheaper_from_calibrated_prices(uncosted_cluster):
    proxy, p_url = uncosted_cluster.proxy, uncosted_cluster.prefill[0]
    prior = CostConfig().recompute_prior_s_per_token
    assert CostConfig().recompute_s_per_token is None   # nothing pins it

    for n in range(WARM_UPS):
        ask(proxy, [{"role": "user", "content": long_text(100 + n) + " Summarise."}],
            f"warm-up-{n}")
    calibrated = gauge(p_url, "sessionkv_recompute_seconds_per_token")
    print(f"recompute price: prior {prior:.3g} s/token, calibrated {calibrated:.3g} s/token")
    assert calibrated > 10 * prior, calibrated

    messages = [{"role": "user", "content": long_text(1) + " Summarise the notes."}]
    answer, first = ask(proxy, messages, "calibrated-session")
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "Which note mentions the harbor first?"}]
    _, second = ask(proxy, messages, "calibrated-session")
    print(f"turn 1 {first}\nturn 2 {second}")
    assert second.get("decision", "").startswith("d_to_p:pull"), second
    assert second.get("pulled_from_peer_tokens", 0) > 0, second
    # The control: the tokens pulled, priced at the prior, would have cost less to
    # recompute than the pull was priced at; only the calibrated price pulls them.
    # (One more token than accounted: a load of the whole prompt recomputes its last.)
    defaults = CostConfig()
    at_prior_ms = 1e3 * recompute_time_s(
        second["pulled_from_peer_tokens"] + 1, second["local_hit_tokens"],
        RecomputeModel(s_per_token=prior,
                       s_per_token_per_context_token=defaults.recompute_s_per_token_per_context_token,
                       load_slowdown_per_unit=defaults.load_slowdown_per_unit),
        second["priced_engine_load"])
    assert second["priced_pull_ms"] < second["priced_recompute_ms"], second
    assert at_prior_ms < second["priced_pull_ms"], (at_prior_ms, second)
