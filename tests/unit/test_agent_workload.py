"""The agent benchmark's workload: prompt building, stripping, sub-agents, skew, the
replays, and the reuse ceiling (pure; no engines)."""

from __future__ import annotations

import json

import pytest


from agentload.workload import (
    AgentConfig,
    Session,
    Step,
    Workload,
    agent_workload,
    ceiling,
    mooncake_file_ceiling,
    mooncake_workload,
    pin_sessions,
    steps_per_session,
    workload_ceiling,
)

THINK = 5


def fake_outputs(workload: Workload) -> dict:
    """Deterministic stand-ins for the model's answers (distinct per step)."""
    return {(sid, k): [2000 + 97 * i + 7 * k + j for j in range(workload.session(sid)
                                                              .steps[k].max_tokens)]
            for i, (sid, k) in enumerate(workload.keys())}


def two_step(strip: bool) -> Workload:
    s = Session(sid="a", head=(1, 2, 3), steps=(
        Step(new_tokens=(10, 11), max_tokens=4, think_tokens=2),
        Step(new_tokens=(20,), max_tokens=3, strip_reasoning=strip, think_tokens=1)))
    return Workload("t", [s], block_size=2, think_open=THINK)


def test_prompt_appends_output_and_next_tool_output():
    w = two_step(strip=False)
    outs = {("a", 0): [40, 41, 42, 43], ("a", 1): [50, 51, 52]}
    assert w.prompt("a", 0, outs) == [1, 2, 3, 10, 11, THINK]
    assert w.prompt("a", 1, outs) == [1, 2, 3, 10, 11, THINK, 40, 41, 42, 43, 20, THINK]


def test_strip_drops_think_opener_and_reasoning():
    w = two_step(strip=True)
    outs = {("a", 0): [40, 41, 42, 43], ("a", 1): [50, 51, 52]}
    # <think> and the 2 reasoning tokens of step 0 are gone; the tool call stays.
    assert w.prompt("a", 1, outs) == [1, 2, 3, 10, 11, 42, 43, 20, THINK]


def test_subagent_inherits_parent_history_up_to_spawn():
    parent = Session(sid="p", head=(1, 2), steps=(Step((3,), 2), Step((4,), 2), Step((5,), 2)))
    child = Session(sid="c", head=(), parent="p", spawn_after=1, steps=(Step((9,), 2),))
    w = Workload("t", [parent, child], block_size=2, think_open=THINK)
    outs = {("p", 0): [30, 31], ("p", 1): [40, 41], ("p", 2): [50, 51], ("c", 0): [60, 61]}
    assert w.prompt("c", 0, outs) == w.prompt("p", 1, outs) + [40, 41, 9, THINK]
    assert w.dependencies("c", 0) == [("p", 1)]
    order = w.canonical_order()
    assert order.index(("p", 1)) < order.index(("c", 0))


def test_ceiling_counts_leading_blocks_computed_before():
    a = [1, 2, 3, 4, 5, 6]
    b = [1, 2, 3, 4, 9, 9, 9]            # shares two blocks of 2 with a
    c = [1, 2, 3, 4, 5, 6]               # all of a: the last block is still computed
    got = ceiling([(("a", 0), a, []), (("b", 0), b, []), (("c", 0), c, [])], block_size=2)
    assert got.per_request == {("a", 0): (6, 0), ("b", 0): (7, 4), ("c", 0): (6, 4)}
    assert got.prompt_tokens == 19 and got.reusable_tokens == 8


def test_ceiling_counts_generated_tokens_but_not_the_last():
    # The answer [7, 8, 9] computes KV for 7 and 8 only (9 is sampled, never fed back).
    first = ceiling([(("a", 0), [1, 2], [7, 8, 9]), (("a", 1), [1, 2, 7, 8, 9, 10, 11], [])],
                    block_size=2)
    assert first.per_request[("a", 1)] == (7, 4)
    # A different block in the middle stops the chain there.
    other = ceiling([(("a", 0), [1, 2], [7, 8, 9]), (("a", 1), [1, 2, 7, 0, 9, 10, 11], [])],
                    block_size=2)
    assert other.per_request[("a", 1)] == (7, 2)


def test_agent_workload_is_seeded_and_reuse_ceiling_is_high():
    cfg = AgentConfig(sessions=4, steps=5, prefix_tokens=256, tool_output_tokens=96,
                      output_tokens=16, think_tokens=4, subagent_share=1.0, seed=3)
    w1, w2 = agent_workload(cfg), agent_workload(cfg)
    assert [s.steps for s in w1.sessions] == [s.steps for s in w2.sessions]
    assert agent_workload(AgentConfig(seed=4)).sessions[0].head != w1.sessions[0].head
    subs = [s for s in w1.sessions if s.parent]
    assert subs, "subagent_share=1.0 spawns sub-agents"
    outs = fake_outputs(w1)
    ceil = workload_ceiling(w1, outs)
    assert ceil.prompt_tokens == sum(len(w1.prompt(*k, outs)) for k in w1.keys())
    # Agent traffic re-sends its history: most prompt tokens are reusable.
    assert 0.7 < ceil.reusable_share < 1.0
    # Every step after the first reuses at least the shared prefix's full blocks.
    for (sid, k), (n, can) in ceil.per_request.items():
        if k > 0:
            assert can >= 256 // 32 * 32


def test_strip_steps_lower_the_ceiling_only_after_the_strip_point():
    base = AgentConfig(sessions=2, steps=4, prefix_tokens=128, tool_output_tokens=64,
                       output_tokens=40, think_tokens=20, subagent_share=0.0, seed=1)
    kept = agent_workload(AgentConfig(**{**base.__dict__, "strip_share": 0.0}))
    strip = agent_workload(AgentConfig(**{**base.__dict__, "strip_share": 1.0}))
    assert all(st.strip_reasoning for s in strip.sessions for st in s.steps[1:])
    ck = workload_ceiling(kept, fake_outputs(kept))
    cs = workload_ceiling(strip, fake_outputs(strip))
    assert cs.reusable_tokens < ck.reusable_tokens
    for key, (n, can) in cs.per_request.items():
        if key[1] > 0:   # the history before the stripped <think> is still reusable
            assert can >= 128 // 32 * 32


def test_skew_puts_most_steps_on_a_few_sessions():
    cfg = AgentConfig(sessions=8, steps=4, skew=1.5)
    counts = steps_per_session(cfg)
    assert sum(counts) == 32 and min(counts) >= 1
    assert counts[0] + counts[1] > 0.5 * 32
    w = agent_workload(cfg)
    assert [s.hot for s in w.sessions if not s.parent][:3] == [True, True, False]
    assert steps_per_session(AgentConfig(sessions=3, steps=4)) == [4, 4, 4]


def test_mooncake_shared_hash_ids_are_shared_tokens():
    lines = [json.dumps({"timestamp": 0, "input_length": 1500, "output_length": 160,
                         "hash_ids": [1, 2, 3]}),
             json.dumps({"timestamp": 500, "input_length": 1100, "output_length": 32,
                         "hash_ids": [1, 2, 4]}),
             json.dumps({"timestamp": 900, "input_length": 600, "output_length": 32,
                         "hash_ids": [5, 6]})]
    w = mooncake_workload(lines, block_size=32, time_scale=2.0)
    p = [s.head for s in w.sessions]
    assert p[0][:64] == p[1][:64] and p[0][64:96] != p[1][64:96]
    assert len(p[0]) == 64 + round((1500 - 1024) / 16)
    assert [s.start_s for s in w.sessions] == [0.0, 1.0, 1.8]
    assert [s.steps[0].max_tokens for s in w.sessions] == [10, 2, 2]
    # 2 of the slice's 8 blocks were seen before (ids 1 and 2 in the second request).
    assert mooncake_file_ceiling(lines) == pytest.approx(2 / 8)
    outs = {k: [3000 + i] for i, k in enumerate(w.keys())}
    assert workload_ceiling(w, outs).reusable_tokens == 64


def test_the_host_tier_arms_run_the_host_workload_only():
    import agent_workload as bench

    by_name = {name: arms for name, (_, arms)
               in bench.build_workloads(bench.parse_args(["--quick"])).items()}
    assert by_name and not any(a.startswith("8-") for arms in by_name.values() for a in arms)
    host = bench.build_workloads(bench.parse_args(["--quick", "--workloads", "host,r1"]))
    assert host["host"][1] == ["8-ours-nohost", "8-ours-host"]
    assert not any(a.startswith("8-") for a in host["r1"][1])


def test_chat_pressure_gaps_are_heavy_tailed_seeded_and_off_by_default():
    """``gap_sigma``: tool delays lognormal around the median ``tool_delay_s``; 0 keeps
    the 0.5x-1.5x draw (chat and chat_long unchanged); the pressure arms run only
    chat_pressure, which no default workload list names."""
    import dataclasses
    import statistics

    import agent_workload as bench
    from agentload.chat import ChatConfig, chat_workload

    def gaps(cfg):
        return [t.delay_s for s in chat_workload(cfg).sessions for t in s.steps[1:]]

    base = ChatConfig(sessions=12, turns=6, tool_delay_s=5.0, seed=5)
    assert all(2.5 <= g <= 7.5 for g in gaps(base))
    heavy = gaps(dataclasses.replace(base, gap_sigma=1.0))
    assert heavy == gaps(dataclasses.replace(base, gap_sigma=1.0))
    assert 3.0 < statistics.median(heavy) < 8.0 and max(heavy) > 5 * statistics.median(heavy)
    args = bench.parse_args(["--client", "chat", "--workloads", "chat_pressure", "--quick"])
    assert bench.build_workloads(args)["chat_pressure"][1] == list(bench.armlib.PRESSURE_ARMS)
    for argv in (["--client", "chat"], ["--client", "chat", "--quick"], []):
        assert not any(a.startswith("9-") for _, arms in
                       bench.build_workloads(bench.parse_args(argv)).values() for a in arms)


def test_pressure_sizing_gives_d_a_quarter_of_the_sessions_kv(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import agent_workload as bench

    monkeypatch.setattr(bench.tempfile, "mkdtemp", lambda prefix: str(tmp_path / prefix))
    (tmp_path / "config.json").write_text(json.dumps({   # SmolLM2-135M's shape
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "intermediate_size": 1536}))
    opts = bench.armlib.EngineOptions(model=str(tmp_path), max_model_len=2048, p_blocks=72,
                                      d_blocks=256, coloc_blocks=164)
    args = SimpleNamespace(dtype="float32", max_model_len=2048, p_blocks=72)
    meta = bench.pressure_sizing(opts, SimpleNamespace(prompt_tokens=50_000,
                                                       reusable_tokens=10_000), args)
    block = 30 * 2 * 3 * 64 * 4 * 32
    assert meta["d_blocks"] == opts.pressure["d_blocks"] == 313   # 40,000 tokens / 128
    assert meta["kv_bytes_per_block"] == block and meta["coloc_blocks"] == (72 + 313) // 2
    assert opts.pressure["sessionkv"]["host_tier_bytes"] == 313 * block
    assert opts.pressure["sessionkv"]["disk_tier_bytes"] == 4 * 313 * block
    # A small workload: D still holds one max_model_len request and a block.
    assert bench.pressure_sizing(opts, SimpleNamespace(prompt_tokens=100, reusable_tokens=0),
                                 args)["d_blocks"] == 65


def test_pin_sessions_round_robins_top_level_sessions_and_keeps_subagents_with_parents():
    cfg = AgentConfig(sessions=3, steps=3, prefix_tokens=64, task_tokens=8,
                      tool_output_tokens=16, output_tokens=4, think_tokens=0,
                      subagent_share=1.0, subagent_steps=1, seed=3)
    w = agent_workload(cfg)
    pinned = pin_sessions(w, ["u0", "u1"])
    tops = [s.sid for s in w.sessions if s.parent is None]
    assert [pinned[sid] for sid in tops] == ["u0", "u1", "u0"]
    subs = [s for s in w.sessions if s.parent is not None]
    assert subs, "subagent_share=1.0 spawns sub-agents"
    assert all(pinned[s.sid] == pinned[s.parent] for s in subs)
    assert set(pinned) == {s.sid for s in w.sessions}


def test_a_run_summary_and_every_committed_report_render():
    """``measure.summarize`` on a made-up run of two engines, and ``report.render`` on it
    and on every committed agent_workload*.json (the figures docs quote stay readable)."""
    from pathlib import Path

    from agentload import measure, report
    from agentload.client import StepResult

    w = agent_workload(AgentConfig(sessions=2, steps=2, prefix_tokens=64, task_tokens=8,
                                   tool_output_tokens=16, output_tokens=4, think_tokens=1,
                                   subagent_share=0.0, seed=2))
    outs = fake_outputs(w)
    ref = {k: StepResult(k, len(w.prompt(*k, outs)), 0.0, token_ids=outs[k],
                         top_logprobs=[[-0.1]] * len(outs[k]), ttft_s=(i + 1) / 10,
                         e2e_s=0.5, prompt_token_ids=w.prompt(*k, outs))
           for i, k in enumerate(w.keys())}
    got = dict(ref)
    got[w.keys()[-1]] = StepResult(w.keys()[-1], 0, 0.0, error="500: boom")
    ceil = workload_ceiling(w, outs)
    before = [{measure.LOCAL_COMPUTE: 10.0}, {}]
    after = [{measure.LOCAL_COMPUTE: 110.0, measure.BYTES: 4e6, measure.REQUESTS: 3.0},
             {measure.LOCAL_COMPUTE: 20.0, measure.REQUESTS: 3.0}]
    s = measure.summarize(w, got, ref, ceil, before, after, [("P", "u0"), ("D", "u1")], 2.0)
    assert (s["steps"], s["ok"], s["errors"], s["computed_tokens"]) == (4, 3, 1, 120.0)
    assert s["prompt_tokens"] == sum(ref[k].prompt_tokens for k in w.keys()[:-1])
    assert s["mismatches"]["compared"] == 3 and s["mismatches"]["token"] == 0
    assert (s["ttft_p50_s"], s["ttft_p99_s"]) == (0.2, 0.3) and s["bytes"] == 4e6
    assert list(s["engines"]) == ["P0", "D0"] and s["requests_per_engine"] == [3.0, 3.0]
    results = {"meta": {"date": "2026-12-06 00:00 UTC", "commit": "abc", "machine": "m",
                        "command": "python benchmarks/agent_workload.py", "model": "tiny",
                        "dtype": "float32", "p_blocks": 1, "d_blocks": 2, "coloc_blocks": 1,
                        "max_model_len": 9, "workloads": {"r1": w.description}},
               "runs": {"r1": {"7-ours": s, "1-rr": s}}, "ceilings": {}, "probes": {}}
    text = report.render(results)
    assert "| 7 ours in full | 3/4 |" in text and "## Headlines" in text
    reports = sorted((Path(__file__).resolve().parents[2] / "docs" / "benchmarks")
                     .glob("agent_workload*.json"))
    assert reports
    for path in reports:
        assert "## How to read it" in report.render(json.loads(path.read_text())), path.name
