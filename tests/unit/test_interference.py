"""The interference benchmark's pure parts: the config comparison that enforces its
fairness rules (with negative controls), the arrival file and its replay at a rate,
goodput and the verdict."""

from __future__ import annotations


import pytest


from interfere import fairness, load, report


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
    flat = fairness.flatten(server_info())
    assert flat["cache_config.enable_prefix_caching"] is True
    assert flat["env.VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert flat["system.torch_version"] == "2.13.0+cpu"
    assert "system.cpu_info" not in flat


def test_arms_that_differ_only_in_knobs_and_per_server_keys_pass():
    coloc = fairness.flatten(server_info(scheduler_config__max_num_batched_tokens=1024,
                                         parallel_config__master_port=29600,
                                         kv_events_config__endpoint="tcp://*:32011",
                                         instance_id="b", env__VLLM_CPU_OMP_THREADS_BIND="1"))
    pd = fairness.flatten(server_info(
        kv_transfer_config={"kv_connector": "SessionKVConnector", "kv_role": "kv_producer"},
        env__VLLM_NIXL_SIDE_CHANNEL_PORT=5601))
    diffs = fairness.check_configs({"coloc/0": coloc, "pd/P": pd})
    kinds = {d.key: d.kind for d in diffs}
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
    same = fairness.flatten(server_info())
    other = fairness.flatten(server_info(**override))
    assert fairness.check_configs({"a": same, "b": fairness.flatten(server_info())}) == []
    with pytest.raises(fairness.FairnessError, match=key.replace(".", r"\.")):
        fairness.check_configs({"a": same, "b": other})
    # Named by the operator, it is accepted and reported as allowed.
    diffs = fairness.check_configs({"a": same, "b": other}, allow=(key,))
    assert [(d.key, d.kind) for d in diffs] == [(key, "allowed")]


def test_a_key_missing_on_one_engine_is_a_difference():
    a = fairness.flatten(server_info())
    b = dict(a)
    del b["model_config.seed"]
    with pytest.raises(fairness.FairnessError, match="model_config.seed"):
        fairness.check_configs({"a": a, "b": b})


def test_server_counts_and_arrival_files_must_match():
    fairness.check_server_counts({"coloc": 2, "pd": 2})
    with pytest.raises(fairness.FairnessError, match="coloc=2, pd=3"):
        fairness.check_server_counts({"coloc": 2, "pd": 3})
    fairness.check_same_arrivals({"coloc": "ab" * 32, "pd": "ab" * 32})
    with pytest.raises(fairness.FairnessError, match="different arrival files"):
        fairness.check_same_arrivals({"coloc": "ab" * 32, "pd": "cd" * 32})


def test_arrival_file_is_deterministic_and_replays_at_any_rate(tmp_path):
    a = load.write_arrivals(tmp_path / "a.jsonl", 12, 1.0, 100, 8, seed=3)
    b = load.write_arrivals(tmp_path / "b.jsonl", 12, 1.0, 100, 8, seed=3)
    assert fairness.file_digest(a) == fairness.file_digest(b)
    arrivals = load.read_arrivals(a)
    assert load.file_rate(arrivals) == pytest.approx(1.0)
    at2 = load.schedule(arrivals, 2.0, 5.0)
    assert [round(t, 6) for t, _ in at2] == [i / 2 for i in range(10)]
    assert [x.prompt for _, x in at2] == [x.prompt for x in arrivals[:10]]
    assert load.schedule(arrivals, 0.0, 5.0) == []
    with pytest.raises(ValueError, match="runs out"):
        load.schedule(arrivals, 0.5, 60.0)
    # Steps take consecutive slices: no prompt is sent by two steps.
    starts = load.step_starts(arrivals, [2.0, 0.0, 1.0], 3.0)
    assert starts == {0.0: 0, 1.0: 0, 2.0: 3}
    assert [x.prompt for _, x in load.schedule(arrivals, 2.0, 3.0, starts[2.0])] == \
        [x.prompt for x in arrivals[3:9]]
    with pytest.raises(ValueError, match="runs out"):
        load.step_starts(arrivals, [1.0, 2.0], 5.0)


def test_a_bad_arrival_line_is_refused_naming_it(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t_s": 0, "prompt": [1, 2]}\n{"t_s": 1, "prompt": [1], "x": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load.read_arrivals(path)


def test_gaps_count_only_inside_the_window():
    s = load.Stream("victim", 64, sent_s=0.5, chunk_s=[1.0, 1.1, 2.0, 2.05, 5.0])
    assert s.ttft_s == pytest.approx(0.5)
    assert s.gaps(1.05, 4.0) == pytest.approx([0.9, 0.05])


def _step(rate, itl_p99, ttft_p99, unfinished=0):
    return {"rate": rate, "errors": 0, "injected_unfinished": unfinished,
            "injected": 0 if rate == 0 else 5, "victim_itl_s": {"p99": itl_p99},
            "injected_ttft_s": {"p99": ttft_p99}}


def test_goodput_is_the_highest_rate_with_every_lower_one_passing():
    steps = {"0": _step(0, 0.02, None), "1": _step(1, 0.05, 1.0),
             "2": _step(2, 0.2, 1.0), "3": _step(3, 0.05, 1.0)}
    assert report.goodput(steps, ttft_target_s=2.0, itl_target_s=0.1) == 1
    steps["1"] = _step(1, 0.05, 1.0, unfinished=1)
    assert report.goodput(steps, 2.0, 0.1) == 0


def test_verdict_follows_goodput_and_says_inconclusive_on_a_tie():
    def arms(pd_itl):
        return {"c": {"kind": "coloc", "steps": {"0": _step(0, 0.02, None),
                                                  "1": _step(1, 0.3, 1.0)}},
                "p": {"kind": "pd", "steps": {"0": _step(0, 0.02, None),
                                              "1": _step(1, pd_itl, 1.0)}}}
    v = report.verdict(arms(0.05), [0, 1], 2.0, 0.1)
    assert (v["decision"], v["best_pd"], v["goodput"]) == ("disaggregate", "p",
                                                           {"c": 0, "p": 1})
    v = report.verdict(arms(0.5), [0, 1], 2.0, 0.1)
    assert v["decision"] == "inconclusive" and "no injected rate" in v["why"]
    flipped = arms(0.05)
    flipped["c"]["kind"], flipped["p"]["kind"] = "pd", "coloc"
    assert report.verdict(flipped, [0, 1], 2.0, 0.1)["decision"] == "stay co-located"


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
    before = [{0.01: 50.0, 0.05: 90.0, float("inf"): 100.0}]
    after = [{0.01: 50.0, 0.05: 90.0, float("inf"): 110.0}]
    assert report.engine_itl(before, after)["p50"] == 0.05   # only the new, slow ones
