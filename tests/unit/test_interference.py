"""The interference benchmark's pure parts: the config comparison that enforces its
fairness rules (with negative controls), a step's window over aiperf's records, goodput
and the verdict."""

from __future__ import annotations

import pytest

import interference as bench


def server_info(**over) -> dict:
    """A ``/server_info?config_format=json`` answer, trimmed to a few keys."""
    cfg = {"model_config": {"model": "/m", "dtype": "torch.float32", "max_model_len": 2048,
                            "seed": 0},
           "cache_config": {"block_size": 32, "enable_prefix_caching": True,
                            "num_gpu_blocks_override": 512},
           "scheduler_config": {"max_num_batched_tokens": 256, "enable_chunked_prefill": True},
           "parallel_config": {"master_port": 29501},
           "kv_events_config": {"endpoint": "tcp://*:32001"},
           "kv_transfer_config": None, "instance_id": "a"}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_NIXL_SIDE_CHANNEL_PORT": 5600,
           "VLLM_USE_AOT_COMPILE": False}
    for key, value in over.items():
        section, _, name = key.partition("__")
        if section == "env":
            env[name] = value
        elif name:
            cfg[section][name] = value
        else:
            cfg[section] = value
    return {"vllm_config": cfg, "vllm_env": env,
            "system_env": {"torch_version": "2.13.0+cpu", "vllm_version": "0.32.0",
                           "cpu_info": "varies"}}


def test_flatten_takes_config_env_and_the_system_keys_that_matter():
    flat = bench.flatten(server_info())
    assert flat["cache_config.enable_prefix_caching"] is True
    assert flat["env.VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert flat["system.torch_version"] == "2.13.0+cpu"
    assert "system.cpu_info" not in flat


def test_arms_that_differ_only_in_knobs_and_per_server_keys_pass():
    coloc = bench.flatten(server_info(scheduler_config__max_num_batched_tokens=1024,
                                      parallel_config__master_port=29600,
                                      kv_events_config__endpoint="tcp://*:32011",
                                      instance_id="b", env__VLLM_CPU_OMP_THREADS_BIND="1"))
    pd = bench.flatten(server_info(
        kv_transfer_config={"kv_connector": "SessionKVConnector", "kv_role": "kv_producer"},
        env__VLLM_NIXL_SIDE_CHANNEL_PORT=5601))
    kinds = {d["key"]: d["kind"] for d in bench.check_configs({"coloc/0": coloc, "pd/P": pd})}
    assert kinds["scheduler_config.max_num_batched_tokens"] == "knob"
    assert kinds["kv_transfer_config.kv_connector"] == "knob"
    assert kinds["env.VLLM_CPU_OMP_THREADS_BIND"] == "instance"
    assert kinds["env.VLLM_NIXL_SIDE_CHANNEL_PORT"] == "instance"
    assert kinds["parallel_config.master_port"] == "instance"
    assert set(kinds.values()) <= {"knob", "instance"}


@pytest.mark.parametrize("override, key", [
    ({"cache_config__enable_prefix_caching": False}, "cache_config.enable_prefix_caching"),
    ({"model_config__dtype": "torch.bfloat16"}, "model_config.dtype"),
    ({"model_config__max_model_len": 1024}, "model_config.max_model_len"),
    ({"cache_config__num_gpu_blocks_override": 256}, "cache_config.num_gpu_blocks_override"),
    ({"env__VLLM_USE_AOT_COMPILE": True}, "env.VLLM_USE_AOT_COMPILE"),
])
def test_a_forbidden_difference_is_refused_naming_the_key(override, key):
    same = bench.flatten(server_info())
    other = bench.flatten(server_info(**override))
    assert bench.check_configs({"a": same, "b": bench.flatten(server_info())}) == []
    with pytest.raises(bench.FairnessError, match=key.replace(".", r"\.")):
        bench.check_configs({"a": same, "b": other})
    # Named by the operator, it is accepted and reported as allowed.
    diffs = bench.check_configs({"a": same, "b": other}, allow=(key,))
    assert [(d["key"], d["kind"]) for d in diffs] == [(key, "allowed")]


def test_prefix_caching_on_one_side_only_is_refused_and_nothing_else_is_named():
    coloc = bench.flatten(server_info(cache_config__enable_prefix_caching=False,
                                      env__VLLM_CPU_OMP_THREADS_BIND="1"))
    pd = bench.flatten(server_info(kv_transfer_config={"kv_connector": "SessionKVConnector"}))
    with pytest.raises(bench.FairnessError) as err:
        bench.check_configs({"coloc/coloc0": coloc, "pd/P0": pd})
    assert [line.split(":")[0].strip() for line in str(err.value).splitlines()[1:]] == \
        ["cache_config.enable_prefix_caching"]


def test_a_key_missing_on_one_engine_is_a_difference():
    a = bench.flatten(server_info())
    b = dict(a)
    del b["model_config.seed"]
    with pytest.raises(bench.FairnessError, match="model_config.seed"):
        bench.check_configs({"a": a, "b": b})


def record(start_s: float, ttft_ms: float | None, gaps_ms: list[float], error=None) -> dict:
    """An aiperf per-request record, cut to what the benchmark reads."""
    metrics = {} if ttft_ms is None else {"time_to_first_token": {"value": ttft_ms}}
    if gaps_ms:
        metrics["inter_chunk_latency"] = {"value": gaps_ms}
    return {"metadata": {"request_start_ns": int(start_s * 1e9)}, "metrics": metrics,
            **({"error": error} if error else {})}


def test_chunk_times_come_from_ttft_and_the_gaps():
    (r,) = bench.requests_of([record(100.0, 500.0, [100.0, 250.0])])
    assert r["ttft_s"] == pytest.approx(0.5)
    assert r["chunks_s"] == pytest.approx([100.5, 100.6, 100.85])
    (failed,) = bench.requests_of([record(100.0, None, [], error={"code": 500})])
    assert (failed["ttft_s"], failed["chunks_s"], failed["error"]) == (None, [], True)


def test_a_step_counts_only_what_falls_in_its_window():
    """The window is [t0 + warm, t0 + duration], t0 the first long prompt's send."""
    victims = bench.requests_of([
        record(99.0, 100.0, [500.0, 900.0, 100.0, 5000.0]),   # chunks 99.1 99.6 100.5 100.6 105.6
        record(101.0, 200.0, [300.0]),                        # chunks 101.2 101.5
    ])
    injected = bench.requests_of([record(100.0, 2000.0, [10.0]), record(100.52, 900.0, []),
                                  record(100.98, None, [])])   # due at 100.0, 100.5, 101.0
    s = bench.summarize_step(victims, injected, rate=2.0, warm_s=0.4, duration_s=4.0)
    # Window [100.4, 104.0]: gaps 100.5->100.6 and 101.2->101.5; 100.6->105.6 ends outside.
    assert s["victim_itl_s"]["p50"] == pytest.approx(0.1)
    assert s["victim_itl_s"]["p99"] == pytest.approx(0.3)
    assert s["victim_gaps"] == 2
    assert s["victim_ttft_s"]["p99"] == pytest.approx(0.2)        # only the one sent inside
    assert (s["injected"], s["injected_failed"]) == (2, 1)        # the second and third
    assert s["injected_ttft_s"]["p50"] == pytest.approx(0.9)
    assert s["victims_cover_window"] is True
    short = bench.summarize_step(victims[:1], injected, 2.0, warm_s=0.4, duration_s=6.0)
    assert short["victims_cover_window"] is False                 # last chunk 105.6 < 106
    alone = bench.summarize_step(victims, [], 0.0, warm_s=0.4, duration_s=4.0)   # t0 = 99.0
    assert alone["victim_gaps"] == 3 and alone["injected"] == 0


def _step(rate, itl_p99, ttft_p99, failed=0):
    return {"rate": rate, "errors": 0, "injected_failed": failed,
            "injected": 0 if rate == 0 else 5, "victim_itl_s": {"p99": itl_p99},
            "injected_ttft_s": {"p99": ttft_p99}}


def test_goodput_is_the_highest_rate_with_every_lower_one_passing():
    steps = {"0": _step(0, 0.02, None), "1": _step(1, 0.05, 1.0),
             "2": _step(2, 0.2, 1.0), "3": _step(3, 0.05, 1.0)}
    assert bench.goodput(steps, ttft_s=2.0, itl_s=0.1) == 1
    steps["1"] = _step(1, 0.05, 1.0, failed=1)
    assert bench.goodput(steps, 2.0, 0.1) == 0


def test_verdict_follows_goodput_and_says_inconclusive_on_a_tie_or_a_bad_baseline():
    def arms(pd_itl, base=0.02):
        return {"c": {"kind": "coloc", "steps": {"0": _step(0, base, None),
                                                  "1": _step(1, 0.3, 1.0)}},
                "p": {"kind": "pd", "steps": {"0": _step(0, 0.02, None),
                                              "1": _step(1, pd_itl, 1.0)}}}
    v = bench.verdict(arms(0.05), 2.0, 0.1)
    assert (v["decision"], v["best_pd"], v["goodput"]) == ("disaggregate", "p", {"c": 0, "p": 1})
    assert bench.verdict(arms(0.5), 2.0, 0.1)["decision"] == "inconclusive"
    v = bench.verdict(arms(0.05, base=0.2), 2.0, 0.1)
    assert v["decision"] == "inconclusive" and "with no long prompts at all" in v["why"]
    flipped = arms(0.05)
    flipped["c"]["kind"], flipped["p"]["kind"] = "pd", "coloc"
    assert bench.verdict(flipped, 2.0, 0.1)["decision"] == "stay co-located"


def test_histogram_quantile_interpolates_within_the_bucket():
    from sessionkv_bench.metrics import histogram_quantile

    # 100 observations: 50 under 10 ms, 40 in 10-50 ms, 10 in 50-100 ms.
    buckets = {0.01: 50.0, 0.05: 90.0, 0.1: 100.0, float("inf"): 100.0}
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.01)
    assert histogram_quantile(buckets, 0.7) == pytest.approx(0.03)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.095)
    assert histogram_quantile({0.01: 0.0, float("inf"): 0.0}, 0.5) is None
    # Past the last finite bound: that bound, not infinity.
    assert histogram_quantile({0.01: 1.0, float("inf"): 10.0}, 0.99) == 0.01


def test_the_quick_and_full_runs_parse():
    quick = bench.parse_args(["--quick"])
    assert (quick.rate_list, quick.max_num_batched_tokens, quick.duration_s) == ([0.0, 1.0],
                                                                                "256", 10.0)
    full = bench.parse_args(["--rates", "1,0", "--victims", "2"])
    assert (full.rate_list, full.victims, full.prompt_tokens) == ([0.0, 1.0], 2, 1536)
    with pytest.raises(SystemExit):
        bench.parse_args(["--pd-modes", "sideways"])


def test_the_committed_quick_report_is_what_render_writes_from_its_json():
    """docs/benchmarks/interference_quick.{json,md} came from one run; rendering its JSON
    again gives its markdown, so the report's table and verdict read the fields they name."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
    res = json.loads((docs / "interference_quick.json").read_text())
    assert bench.render(res) == (docs / "interference_quick.md").read_text()
    again = bench.verdict(res["arms"], res["meta"]["ttft_target_ms"] / 1e3,
                          res["meta"]["itl_target_ms"] / 1e3)
    assert again == res["verdict"]
