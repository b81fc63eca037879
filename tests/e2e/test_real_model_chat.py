"""A real instruct model through P/D, in chat text, against a co-located server, with
prices the engines calibrate themselves.

The model is SmolLM2-135M-Instruct, built by ``sessionkv-real-model`` from its PyPI
wheel (the session fixture ``real_model``), served in float32 (``--dtype``: in bfloat16
a P/D answer and a co-located one can part at near-ties when the prefill is split
differently, which would hide real faults in noise).  1P+1D+Redis behind our proxy,
disaggregation forced (every turn goes P -> D), a plain co-located server as the
baseline, and a P that runs the model with its k/v projections scaled by -3 for the
negative control.

No ``cost`` in the connector's config: the recompute price starts at the prior sized
for the tiny test model (``cost.recompute_prior_s_per_token``), at which P would
recompute D's blocks of an earlier answer rather than pull them.  The fixture sends two
warm-up prompts of about a thousand tokens, from whose prefill steps P times itself
(``Pricing.step_finished``); from then on P pulls where a pull is cheaper, so the
D -> P path runs in the chat tests too.  ``test_p_pulls_where_a_pull_is_cheaper_from_
calibrated_prices`` checks the calibration itself, with its control in the same figures.

The session is what a chat client sends: a system prompt, tools in the request, a
coding task, tool results, the model's answers kept in history as text, streamed and
non-streamed turns, and one turn whose earlier answer the client trims to its last
line.  Each answer must equal the co-located server's in text and token ids, with the
top-5 logprobs within ``REAL_LOGPROB_TOLERANCE``.

Cost on the 2-core machine: the model build (about 30 s, once per test session), four
eager engines' start, two warm-up prompts and the turns; see docs/testing.md.
"""

from __future__ import annotations

import contextlib
import json
import subprocess

import pytest
import requests

from cluster import cluster_with_baselines, free_port_block, launcher_child
from helpers import (
    Generation,
    chat_body,
    compare,
    fresh_prefill_params,
    metric_sum,
    post,
    wait_until,
)
from sessionkv_proxy.resent_answers import ANSWER_IDS_HEADER
from sessionkv_proxy.tokenizer import LocalTokenizer

from vllm_sessionkv.config import CostConfig
from vllm_sessionkv.dev.real_model import (
    MARKER_NAME,
    SERVED_NAME,
    WHEEL_SHA256,
    build_real_model,
)
from vllm_sessionkv.planner.model import model_shape_from_hf_config
from vllm_sessionkv.wire.cost import RecomputeModel, recompute_time_s, transfer_time_s

DTYPE = "float32"
MAX_MODEL_LEN = 4096
MAX_TOKENS = 40
# float32 P/D against float32 co-located on this model: equal runs differ by rounding
# in how the prefill is split (measured below 1e-4); KV from the perturbed P moves
# them by whole units.
REAL_LOGPROB_TOLERANCE = 1e-3

SYSTEM = ("You are a careful Python coding assistant. Answer briefly, with code when "
          "the user asks for code.")
TOOLS = [{"type": "function", "function": {
    "name": "run_tests", "description": "Run the project's unit tests and report results.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
# (user text, streamed, trim the previous answer to its last line first)
TURNS = [
    ("Write a Python function reverse(s) that returns the string s reversed.", False, False),
    ("Tool result from run_tests: 3 passed, 0 failed. Now make it strip surrounding "
     "whitespace first.", True, False),
    ("Tool result from run_tests: 1 failed: test_none (reverse(None) raised TypeError). "
     "Fix it.", False, False),
    ("Thanks. In one sentence, what did we change?", True, True),
]


WARM_UPS = 2


def long_text(seed: int, sentences: int = 60) -> str:
    """About a thousand tokens of plain prose, different for each seed (no prefix
    cache hit between the warm-ups and the sessions)."""
    words = ["river", "stone", "lantern", "garden", "signal", "harbor", "engine", "meadow",
             "ledger", "compass", "thread", "window", "orchard", "bridge", "market"]
    out = []
    for i in range(sentences):
        a, b, c = (words[(seed * 7 + i * k) % len(words)] for k in (1, 3, 5))
        out.append(f"Note {seed}.{i}: the {a} near the {b} kept its {c} until day {i + seed}.")
    return " ".join(out)


def last_line(text: str) -> str:
    """What a client that trims an earlier answer keeps of it."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


def chat_request(messages: list[dict], stream: bool, session: str) -> dict:
    return chat_body(SERVED_NAME, messages, max_tokens=MAX_TOKENS, stream=stream,
                     ignore_eos=False, tools=TOOLS, tool_choice="none",
                     prompt_cache_key=session)


def same(got: Generation, base: Generation) -> bool:
    result = compare(got, base)
    return (got.text == base.text and result.token_mismatches == 0
            and result.max_logprob_diff <= REAL_LOGPROB_TOLERANCE)


def run_session(serve, colocated: str, session: str, turns=TURNS, system: str = SYSTEM
                ) -> list[dict]:
    """Drive the chat session through ``serve(body) -> Generation`` and the co-located
    server alike; returns one record per turn."""
    messages = [{"role": "system", "content": system}]
    records = []
    for n, (user, stream, trim) in enumerate(turns, 1):
        if trim:
            messages[-1] = {"role": "assistant", "content": last_line(messages[-1]["content"])}
        messages.append({"role": "user", "content": user})
        body = chat_request(messages, stream, session)
        got = serve(body)
        base = post(colocated, "/v1/chat/completions", body)
        result = compare(got, base)
        records.append({"turn": n, "stream": stream, "trimmed": trim, "got": got,
                        "base": base, "comparison": result, "same": same(got, base),
                        "prefill": json.loads(got.headers.get("x-sessionkv-prefill", "{}")),
                        "route": got.headers.get("x-sessionkv-route")})
        print(f"turn {n} stream={stream} trimmed={trim} route={records[-1]['route']} "
              f"{result} text_equal={got.text == base.text} prefill={records[-1]['prefill']}"
              f"\n  answer: {got.text[:120]!r}")
        messages.append({"role": "assistant", "content": base.text})
    return records


@pytest.fixture(scope="module")
def real_cluster(real_model, perturbed_real_model, tmp_path_factory):
    """1P+1D+Redis+proxy from local_cluster.py in float32, forced disaggregation, no
    prices configured; a co-located server and the perturbed-model P beside it; P
    calibrated by two warm-up prompts.  Every engine runs eager, as every test engine
    does (``TEST_ENGINE_ARGS``): torch.compile's warm-up took about 50 s a real-model
    engine on the 2-core machine, four engines here, against a few seconds of turns."""
    with cluster_with_baselines(real_model, perturbed_real_model,
                                tmp_path_factory.mktemp("real-cluster-logs"), [
        "--prefill", "1", "--decode", "1", "--redis", "--dtype", DTYPE,
        "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN),
        "--decode-only-max-uncached-tokens", "-1",
        "--nixl-extra-config", json.dumps({"enforce_handshake_compat": False}),
    ], ready_timeout_s=900, served_model_name=SERVED_NAME, dtype=DTYPE,
            max_model_len=MAX_MODEL_LEN) as cluster:
        for n in range(WARM_UPS):
            messages = [{"role": "user", "content": long_text(100 + n) + " Summarise."}]
            post(cluster.proxy, "/v1/chat/completions",
                 chat_body(SERVED_NAME, messages, max_tokens=8, prompt_cache_key=f"warm-up-{n}"))
        yield cluster


def test_model_tool_builds_a_plain_float32_model(real_model):
    """The session fixture built it from the wheel; a second build is a no-op."""
    from pathlib import Path

    folder = Path(real_model)
    marker = json.loads((folder / MARKER_NAME).read_text())
    assert marker["wheel_sha256"] == WHEEL_SHA256
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config, config
    assert config["dtype"] == "float32" and config["num_hidden_layers"] == 30
    assert "<|im_start|>" in (folder / "chat_template.jinja").read_text()
    _, converted = build_real_model(folder)
    assert not converted


@pytest.mark.cluster
def test_served_model_answers_a_known_question(real_cluster):
    body = chat_body(SERVED_NAME, [{"role": "user", "content": "What is the capital of France?"}],
                     max_tokens=16, ignore_eos=False)
    got = post(real_cluster.proxy, "/v1/chat/completions", body)
    print(f"answer through P/D: {got.text!r}")
    assert "Paris" in got.text, got.text
    assert same(got, post(real_cluster.colocated, "/v1/chat/completions", body))


@pytest.mark.cluster
def test_chat_session_through_pd_equals_colocated(real_cluster):
    records = run_session(lambda body: post(real_cluster.proxy, "/v1/chat/completions", body),
                          real_cluster.colocated, "real-chat")
    for r in records:
        assert r["route"] == "disaggregated", r["route"]
        assert r["same"], (f"turn {r['turn']}: {r['comparison']}, text "
                           f"{r['got'].text!r} vs {r['base'].text!r}")
    pulled = sum(r["prefill"].get("pulled_from_peer_tokens", 0) for r in records)
    assert pulled > 0, "P pulled nothing from D in the session"


def _via_perturbed_prefill(cluster):
    """P (the perturbed model) then D, as the proxy drives a disaggregated turn."""
    def serve(body: dict) -> Generation:
        p_out = post(cluster.extras["perturbed_prefill"], "/v1/chat/completions",
                     dict(body, max_tokens=1, stream=False,
                          kv_transfer_params=fresh_prefill_params()))
        return post(cluster.decode[0], "/v1/chat/completions",
                    dict(body, kv_transfer_params=p_out.raw["kv_transfer_params"]))
    return serve


@pytest.mark.cluster
def test_negative_control_perturbed_prefill_fails_the_comparison(real_cluster):
    """The same comparison on a turn whose KV came from the perturbed P: it must fail,
    so the session test above can."""
    # A read from P can fail on a loaded 2-core machine (a handshake timeout); D then
    # recomputes (the failure policy), which proves nothing here.  Only an attempt
    # whose KV really crossed counts; each attempt is a prompt D has not cached.
    for attempt in range(3):
        records = run_session(_via_perturbed_prefill(real_cluster), real_cluster.colocated,
                              f"real-chat-negative-{attempt}", turns=TURNS[:1],
                              system=f"{SYSTEM} Negative control {attempt}.")
        got = records[0]["got"]
        acct = got.raw["kv_transfer_params"]["sessionkv"]["accounting"]
        if acct.get("pulled_from_peer_tokens", 0) > 0:
            break
    else:
        pytest.fail("no KV read from the perturbed P in 3 attempts")
    assert not records[0]["same"], "D's answer ignored the perturbed KV it was handed"


# --------------------------------------------------------------------------------------
# resend_answer_ids: an answer whose generated ids the template re-tokenizes otherwise.
# The benchmark's session 0 (docs/benchmarks/retokenization.md): greedy, SmolLM2 writes
# a 124-token answer with ``L`` + ``ES`` at answer token 88, which the tokenizer merges
# into ``LES`` when the client sends the answer back as text.
RETOK_SYSTEM = ("You are a coding agent working in a Python repository. Rules: answer with "
                "short steps; show code in fenced blocks; call tools by writing "
                "`tool: NAME(ARGS)` on a line of its own; never invent file contents; keep "
                "answers under ten lines. Tools: read_file(path), run_tests(pattern), "
                "grep(pattern), write_file(path, text).")
RETOK_TASK = "Write a function that reverses a string, with a docstring."
RETOK_FOLLOW_UP = ("Tool result (read_file utils.py): def helper(x):\n    return x * 2\n"
                   "Now use helper in your answer.")
BLOCK_TOKENS = 32   # the launcher's block size


def retok_body(messages: list[dict], session: str, max_tokens: int) -> dict:
    # No logprobs: a request asking for them goes to the chat endpoint as text.
    return {"model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": False, "return_token_ids": True,
            "prompt_cache_key": session}


def retok_session(cluster, proxy: str, session: str) -> tuple[Generation, Generation, dict]:
    """Two turns, the first answer kept whole, on emptied caches; (turn 1, turn 2,
    turn 2's body)."""
    reset = requests.post(cluster.proxy + "/admin/reset", timeout=60)
    assert reset.status_code == 200 and reset.json()["success"], reset.text
    messages = [{"role": "system", "content": RETOK_SYSTEM},
                {"role": "user", "content": RETOK_TASK}]
    first = post(proxy, "/v1/chat/completions", retok_body(messages, session, 200))
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": RETOK_FOLLOW_UP}]
    body = retok_body(messages, session, 24)
    return first, post(proxy, "/v1/chat/completions", body), body


@contextlib.contextmanager
def proxy_with_resend_answer_ids(cluster):
    """A second proxy on the same engines, as the launcher starts its own, with the
    option on and no Redis (its sessions stay its own)."""
    argv = launcher_child(cluster, argv_has="sessionkv_proxy").cmdline()
    if "--redis-url" in argv:
        at = argv.index("--redis-url")
        del argv[at:at + 2]
    port = free_port_block(1)
    argv[argv.index("--port") + 1] = str(port)
    log = cluster.log_dir / "proxy-resend-answer-ids.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*argv, "--resend-answer-ids"], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return requests.get(url + "/health", timeout=5).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        wait_until(healthy, 120, "the second proxy's /health")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def prefill_accounting(got: Generation) -> dict:
    return json.loads(got.headers["x-sessionkv-prefill"])


@pytest.mark.cluster
def test_a_resent_answer_that_retokenizes_keeps_its_blocks_with_resend_answer_ids(
        real_cluster, real_model):
    tok = LocalTokenizer(real_model)
    # Without the option (the cluster's proxy): the answer goes back as text.
    off1, off2, off2_body = retok_session(real_cluster, real_cluster.proxy, "retok-off")
    generated = off1.token_ids
    prompt1 = off1.raw["prompt_token_ids"]
    assert off1.raw["choices"][0]["finish_reason"] == "stop", off1.text
    answer_ids = generated[:-1]              # less EOS
    assert tok.decode(answer_ids) == off1.text
    template = tok.encode(off1.text, False)
    diffs = [i for i, (a, b) in enumerate(zip(answer_ids, template)) if a != b]
    assert diffs, "precondition: the answer re-tokenizes as generated (model changed?)"
    held = len(prompt1) + len(generated) - 1   # D's KV: all but the last sampled token
    ideal = held // BLOCK_TOKENS * BLOCK_TOKENS
    kept_off = (len(prompt1) + diffs[0]) // BLOCK_TOKENS * BLOCK_TOKENS
    assert kept_off < ideal, "precondition: the difference lies in a full block"
    acct_off = prefill_accounting(off2)
    print(f"answer {len(generated)} tokens, first difference at answer token {diffs[0]}: "
          f"ideal {ideal}, without the option {acct_off}")
    reused_off = acct_off["local_hit_tokens"] + acct_off["pulled_from_peer_tokens"]
    assert reused_off <= kept_off and acct_off.get("refused_by_verification_tokens", 0) > 0
    assert same_ids(off2, post(real_cluster.colocated, "/v1/chat/completions", off2_body))

    with proxy_with_resend_answer_ids(real_cluster) as url:
        on1, on2, _ = retok_session(real_cluster, url, "retok-on")
    assert on1.token_ids == generated and on1.text == off1.text
    assert on2.headers[ANSWER_IDS_HEADER] == "spliced"
    prompt2 = on2.raw["prompt_token_ids"]
    assert prompt2[:len(prompt1) + len(answer_ids)] == prompt1 + answer_ids
    acct_on = prefill_accounting(on2)
    print(f"with the option {acct_on}")
    assert acct_on.get("refused_by_verification_tokens", 0) == 0
    # All of D's KV (its partial last block too, verified by token ids).
    assert acct_on["local_hit_tokens"] + acct_on["pulled_from_peer_tokens"] == held
    # Equal to the co-located server given the same prompt ids.
    base = post(real_cluster.colocated, "/v1/completions", {
        "model": SERVED_NAME, "prompt": prompt2, "max_tokens": 24, "temperature": 0,
        "ignore_eos": False, "return_token_ids": True})
    assert same_ids(on2, base)


def same_ids(got: Generation, base: Generation) -> bool:
    return got.token_ids == base.token_ids and got.text == base.text


# --------------------------------------------------------------------------------------
# Calibration: the pull above happens at prices P measured, not at the prior.
CALIBRATION_ANSWER_TOKENS = 48


@pytest.mark.cluster
def test_p_pulls_where_a_pull_is_cheaper_from_calibrated_prices(real_cluster, real_model):
    proxy, p_url = real_cluster.proxy, real_cluster.prefill[0]
    prior = CostConfig().recompute_prior_s_per_token
    assert CostConfig().recompute_s_per_token is None   # nothing pins it
    calibrated = metric_sum(p_url, "sessionkv_recompute_seconds_per_token")   # one P
    print(f"recompute price: prior {prior:.3g} s/token, calibrated {calibrated:.3g} s/token")
    assert calibrated > 10 * prior, calibrated

    def ask(messages: list[dict]) -> tuple[str, dict]:
        got = post(proxy, "/v1/chat/completions",
                   chat_body(SERVED_NAME, messages, max_tokens=CALIBRATION_ANSWER_TOKENS,
                             prompt_cache_key="calibrated-session"))
        return got.text, json.loads(got.headers.get("x-sessionkv-prefill", "{}"))

    messages = [{"role": "user", "content": long_text(1) + " Summarise the notes."}]
    answer, first = ask(messages)
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "Which note mentions the harbor first?"}]
    _, second = ask(messages)
    print(f"turn 1 {first}\nturn 2 {second}")
    assert second.get("decision", "").startswith("d_to_p:pull"), second
    assert second.get("pulled_from_peer_tokens", 0) > 0, second
    # The control: with every price at its prior (the recompute price and the link's,
    # which earlier pulls in this module may have measured faster), P would have
    # recomputed the tokens it pulled.  (One more token than accounted: a load of the
    # whole prompt recomputes its last.)
    defaults = CostConfig()
    at_prior_ms = 1e3 * recompute_time_s(
        second["pulled_from_peer_tokens"] + 1, second["local_hit_tokens"],
        RecomputeModel(s_per_token=prior,
                       s_per_token_per_context_token=defaults.recompute_s_per_token_per_context_token,
                       load_slowdown_per_unit=defaults.load_slowdown_per_unit),
        second["priced_engine_load"])
    pull_at_prior_ms = 1e3 * transfer_time_s(
        second["pulled_from_peer_tokens"] * kv_bytes_per_token(real_model),
        defaults.link_bytes_per_s, defaults.per_transfer_s)
    assert second["priced_pull_ms"] < second["priced_recompute_ms"], second
    assert at_prior_ms < pull_at_prior_ms, (at_prior_ms, pull_at_prior_ms, second)


def kv_bytes_per_token(model_dir: str) -> int:
    """K and V of every layer, in float32 (the engines' dtype here)."""
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return model_shape_from_hf_config(cfg).kv_elements_per_token * 4
