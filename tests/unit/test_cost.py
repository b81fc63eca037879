"""The cost model: published reference figures, model shapes, and the pull decision."""

from __future__ import annotations

import json
import pathlib

import msgspec
import pytest

from vllm_sessionkv.planner import capacity
from vllm_sessionkv.planner import model as planner_model
from vllm_sessionkv.planner.capacity import CachingRegime, Hardware, Workload
from vllm_sessionkv.planner.model import ConfigError, KVDtype
from vllm_sessionkv.wire import cost
from vllm_sessionkv.wire.cost import LinkModel, PullQuote, RecomputeModel

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "model_configs"
REL = 0.02  # the tolerance for published figures


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def shape(name: str, **kw) -> planner_model.ModelShape:
    return planner_model.model_shape_from_hf_config(load(name), **kw)


# The reference replica: 4 GPUs at 400 TFLOP/s effective each.
REF_HW = Hardware(
    gpu_peak_flops_per_s=1000e12,
    flops_utilisation=0.4,
    gpus_per_replica=4,
    hbm_bytes_per_gpu=80e9,
    hbm_bytes_per_s_per_gpu=3.35e12,
)

WORKLOAD = Workload(
    shared_prefix_tokens=4096,
    task_tokens=512,
    steps=20,
    tool_output_tokens=1024,
    generated_tokens=256,
    concurrent_sessions=256,
    tool_delay_s=2.0,
    tpot_s=0.025,
)


@pytest.mark.parametrize("module", [cost, capacity, planner_model])
def test_all_is_sorted_and_resolves(module):
    assert module.__all__ == sorted(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), name


# --------------------------------------------------------------------- reference figures


def test_llama_70b_kv_bytes_per_token():
    s = shape("llama-3.1-70b")
    assert (s.layers, s.kv_heads, s.kv_head_dim) == (80, 8, 128)
    assert planner_model.kv_bytes_per_token(s, KVDtype.BF16) == 327_680


def test_llama_70b_8k_prompt_is_2_68_gb():
    per_prompt = 8192 * planner_model.kv_bytes_per_token(shape("llama-3.1-70b"), KVDtype.BF16)
    assert per_prompt == pytest.approx(2.68e9, rel=REL)
    assert round(per_prompt / 1e9, 2) == 2.68


def test_70b_prefills_8k_in_717_ms_on_4_gpus_at_400_tflops():
    s = shape("llama-3.1-70b", active_params=70e9)  # "a 70B model"
    t_s = capacity.prefill_time_s(planner_model.prefill_flops(s, 8192, attention=False), REF_HW)
    assert capacity.replica_flops_per_s(REF_HW) == pytest.approx(1.6e15)
    assert t_s == pytest.approx(0.717, rel=REL)
    # The count estimated from config.json (70.55 B) lands within the tolerance too.
    t_est_s = capacity.prefill_time_s(planner_model.prefill_flops(shape("llama-3.1-70b"), 8192, attention=False), REF_HW)
    assert t_est_s == pytest.approx(0.717, rel=REL)


def test_400g_handoff_is_about_7_pct_of_prefill():
    s = shape("llama-3.1-70b", active_params=70e9)
    handoff_s = cost.transfer_time_s(8192 * planner_model.kv_bytes_per_token(s, KVDtype.BF16),
                                     capacity.LINK_400G.line_bytes_per_s)
    prefill_s = capacity.prefill_time_s(planner_model.prefill_flops(s, 8192, attention=False), REF_HW)
    assert handoff_s == pytest.approx(0.0537, rel=REL)
    share = handoff_s / prefill_s
    assert share == pytest.approx(0.075, rel=REL)
    assert int(100 * share) == 7
    assert capacity.handoff_share_ratio(s, KVDtype.BF16, REF_HW, capacity.LINK_400G.line_bytes_per_s) == (
        pytest.approx(share)
    )


def test_llama_8b_is_128_kib_per_token():
    assert planner_model.kv_bytes_per_token(shape("llama-3.1-8b"), KVDtype.BF16) == 128 * 1024


@pytest.mark.parametrize("tokens", [512, 8192, 131072])
def test_handoff_share_does_not_depend_on_prompt_length(tokens):
    s = shape("llama-3.1-70b")
    per_token = planner_model.kv_bytes_per_token(s, KVDtype.BF16)
    link_bps = capacity.LINK_400G.line_bytes_per_s
    share = cost.transfer_time_s(tokens * per_token, link_bps) / capacity.prefill_time_s(
        planner_model.prefill_flops(s, tokens, attention=False), REF_HW
    )
    assert share == pytest.approx(capacity.handoff_share_ratio(s, KVDtype.BF16, REF_HW, link_bps))


def test_attention_term_shrinks_the_share_at_long_prompts():
    s = shape("llama-3.1-70b")
    per_token = planner_model.kv_bytes_per_token(s, KVDtype.BF16)
    shares = [
        cost.transfer_time_s(n * per_token, 50e9) / capacity.prefill_time_s(planner_model.prefill_flops(s, n), REF_HW)
        for n in (1024, 8192, 131072)
    ]
    assert shares[0] > shares[1] > shares[2]


# --------------------------------------------------------------------- model shapes


def test_kv_dtypes():
    s = shape("llama-3.1-70b")
    assert planner_model.kv_bytes_per_token(s, KVDtype.FP8) == 163_840
    # NVFP4: 4 bits plus one FP8 scale per 16 values = 0.5625 bytes per value.
    assert planner_model.kv_bytes_per_element(KVDtype.NVFP4) == 0.5625
    assert planner_model.kv_bytes_per_token(s, KVDtype.NVFP4) == 163_840 * 0.5625 == 92_160


def test_mla_stores_one_latent_per_layer_not_per_head():
    s = shape("deepseek-v3")
    assert s.attention is planner_model.AttentionKind.MLA
    assert s.kv_elements_per_token == 61 * (512 + 64)
    assert planner_model.kv_bytes_per_token(s, KVDtype.BF16) == 70_272
    assert planner_model.kv_bytes_per_token(s, KVDtype.FP8) == 35_136
    assert planner_model.kv_bytes_per_token(s, KVDtype.NVFP4) == pytest.approx(35_136 * 0.5625)
    # vLLM keeps the whole latent on every TP rank.
    assert capacity.kv_copies_per_replica(s, REF_HW) == 4


def test_gqa_replicates_heads_once_tp_exceeds_them():
    s = shape("llama-3.1-8b")
    assert capacity.kv_copies_per_replica(s, REF_HW) == 1
    hw16 = msgspec.structs.replace(REF_HW, gpus_per_replica=16)
    assert capacity.kv_copies_per_replica(s, hw16) == 2


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        ("llama-3.1-8b", 8.03, 8.03),
        ("llama-3.1-70b", 70.6, 70.6),
        ("mixtral-8x7b", 46.7, 12.9),
        ("deepseek-v3", 671, 37),
    ],
)
def test_params_match_published_counts(name, total_b, active_b):
    s = shape(name)
    assert s.total_params / 1e9 == pytest.approx(total_b, rel=REL)
    assert s.active_params / 1e9 == pytest.approx(active_b, rel=REL)


def test_moe_prefill_uses_active_params():
    s = shape("mixtral-8x7b")
    assert planner_model.linear_prefill_flops(s, 1000) == pytest.approx(2 * s.active_params * 1000)
    assert s.active_params < s.total_params / 3


def test_param_overrides():
    dense = shape("llama-3.1-70b", active_params=70e9)
    assert dense.total_params == dense.active_params == 70e9
    moe = shape("mixtral-8x7b", active_params=13e9)
    assert moe.active_params == 13e9 and moe.total_params == pytest.approx(46.7e9, rel=REL)
    with pytest.raises(ValueError, match="active_params"):
        shape("mixtral-8x7b", active_params=50e9)


def test_head_dim_defaults_to_hidden_over_heads_and_text_config_is_read():
    cfg = {k: v for k, v in load("llama-3.1-8b").items() if k != "head_dim"}
    assert planner_model.model_shape_from_hf_config({"text_config": cfg}).kv_head_dim == 4096 // 32


@pytest.mark.parametrize(
    ("drop", "source"),
    [
        ("num_hidden_layers", "llama-3.1-8b"),
        ("vocab_size", "llama-3.1-8b"),
        ("intermediate_size", "llama-3.1-8b"),
        ("num_experts_per_tok", "mixtral-8x7b"),
        ("qk_rope_head_dim", "deepseek-v3"),
    ],
)
def test_missing_key_is_named(drop, source):
    cfg = {k: v for k, v in load(source).items() if k != drop}
    with pytest.raises(ConfigError, match=drop) as info:
        planner_model.model_shape_from_hf_config(cfg)
    assert info.value.key == drop


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        planner_model.model_shape_from_hf_config({**load("llama-3.1-8b"), "num_key_value_heads": 0})


# --------------------------------------------------------------------- the connector

# 10k tokens/s idle, attention 2 ns per (new, earlier) pair, load doubles recompute per unit.
RECOMPUTE = RecomputeModel(
    s_per_token=1e-4, s_per_token_per_context_token=2e-9, load_slowdown_per_unit=1.0
)
LINK = LinkModel(bytes_per_s=10e9, per_transfer_s=5e-3)
KV_PER_TOKEN_BYTES = 128 * 1024


def quote(tokens: int, context: int, load: float = 0.0) -> PullQuote:
    return PullQuote(tokens, context, KV_PER_TOKEN_BYTES, load)


def test_recompute_time_formula():
    model = RecomputeModel(s_per_token=1.0, s_per_token_per_context_token=0.1,
                           load_slowdown_per_unit=0.5)
    # (3 * 1 + 0.1 * (10 + 11 + 12)) * (1 + 0.5 * 2)
    assert cost.recompute_time_s(3, 10, model, 2.0) == pytest.approx(12.6)
    assert cost.recompute_time_s(0, 10, model, 2.0) == 0.0
    with pytest.raises(ValueError, match="engine_load"):
        cost.recompute_time_s(3, 10, model, -1.0)


def test_small_tail_recomputed_at_short_context_pulled_at_long():
    short = cost.decide_pull(quote(32, 0), RECOMPUTE, LINK)
    long = cost.decide_pull(quote(32, 100_000), RECOMPUTE, LINK)
    assert not short.pull and short.reason == "recompute faster"
    assert long.pull and long.reason == "pull faster"
    assert short.pull_s == pytest.approx(long.pull_s)  # the pull does not care about context
    assert long.recompute_s > short.recompute_s


def test_engine_load_flips_recompute_to_pull():
    idle = cost.decide_pull(quote(32, 0, load=0.0), RECOMPUTE, LINK)
    busy = cost.decide_pull(quote(32, 0, load=1.0), RECOMPUTE, LINK)
    assert not idle.pull and busy.pull
    assert busy.recompute_s == pytest.approx(2 * idle.recompute_s)


@pytest.mark.parametrize("tokens", [0, -5])
def test_zero_tokens_never_pull(tokens):
    free_link = LinkModel(bytes_per_s=1e15, per_transfer_s=0.0)
    d = cost.decide_pull(quote(tokens, 1_000_000, load=100.0), RECOMPUTE, free_link)
    assert not d.pull and d.pull_s == 0.0 and d.recompute_s == 0.0


def test_min_pull_tokens_floor():
    assert cost.decide_pull(quote(32, 100_000), RECOMPUTE, LINK, min_pull_tokens=32).pull
    d = cost.decide_pull(quote(32, 100_000), RECOMPUTE, LINK, min_pull_tokens=64)
    assert not d.pull and d.reason == "below min_pull_tokens"
    assert d.pull_s < d.recompute_s  # priced anyway, so the log shows what the floor cost


def test_tie_recomputes():
    model = RecomputeModel(s_per_token=1e-3, s_per_token_per_context_token=0.0,
                           load_slowdown_per_unit=0.0)
    link = LinkModel(bytes_per_s=1000.0, per_transfer_s=0.0)
    d = cost.decide_pull(PullQuote(10, 0, 1.0, 0.0), model, link)  # both exactly 10 ms
    assert d.pull_s == d.recompute_s and not d.pull


def test_queued_bytes_delay_a_pull():
    q = msgspec.structs.replace(quote(32, 100_000), queued_bytes=1e9)
    assert not cost.decide_pull(q, RECOMPUTE, LINK).pull


def test_models_validate_and_reject_unknown_fields():
    with pytest.raises(ValueError, match="bytes_per_s"):
        LinkModel(bytes_per_s=0.0, per_transfer_s=0.0)
    with pytest.raises(ValueError, match="s_per_token"):
        RecomputeModel(s_per_token=-1.0, s_per_token_per_context_token=0.0, load_slowdown_per_unit=0.0)
    with pytest.raises(msgspec.ValidationError, match="per_pull_s"):
        msgspec.convert({"bytes_per_s": 1e9, "per_pull_s": 0.0}, LinkModel)


def test_recompute_model_from_hardware_matches_planner_prefill():
    s = shape("llama-3.1-70b")
    model = capacity.recompute_model_from_hardware(s, REF_HW)
    for new, ctx in [(1, 0), (8192, 0), (500, 30_000)]:
        assert cost.recompute_time_s(new, ctx, model, 0.0) == pytest.approx(
            capacity.prefill_time_s(planner_model.prefill_flops(s, new, ctx), REF_HW)
        )


# --------------------------------------------------------------------- the router


def test_overlap_credit_blocks():
    assert cost.overlap_credit_blocks(10, 4, 4) == 10 + 3 + 2
    assert cost.overlap_credit_blocks(10, 4, 4, peer_weight=0.0) == 13
    w = cost.OverlapWeights(device=1.0, host=0.5, peer=0.25)
    assert cost.overlap_credit_blocks(-1, 4, 4, w) == 3


def test_peer_credit_weight_follows_link_speed():
    fast = LinkModel(bytes_per_s=1e13, per_transfer_s=0.0)
    slow = LinkModel(bytes_per_s=1e6, per_transfer_s=0.0)
    args = (1024, 50_000, KV_PER_TOKEN_BYTES, RECOMPUTE)
    assert cost.peer_credit_weight(*args, fast) == pytest.approx(1.0, abs=1e-3)
    assert cost.peer_credit_weight(*args, slow) == 0.0
    assert cost.peer_credit_weight(0, 0, KV_PER_TOKEN_BYTES, RECOMPUTE, fast) == 0.0


# --------------------------------------------------------------------- the planner


def test_regime_token_counts():
    # Step k's prompt is 4096 + 512 + (k-1) * 1280.
    tokens = {r: sum(capacity.step_new_tokens(WORKLOAD, k, r)[0] for k in range(1, 21))
              for r in CachingRegime}
    assert tokens[CachingRegime.NONE] == 20 * 4608 + 1280 * 190 == 335_360
    assert tokens[CachingRegime.PREFIX] == 335_360 - 20 * 4096
    assert tokens[CachingRegime.SESSION] == 512 + 19 * 1024


def test_regime_work_orders_and_ratio():
    s = shape("llama-3.1-70b")
    work = {r: capacity.session_prefill_work(s, WORKLOAD, REF_HW, r) for r in CachingRegime}
    none, prefix, session = (work[r].prefill_flops for r in CachingRegime)
    assert none > prefix > session
    assert none / session > 10


def test_host_restore_beats_recompute_and_scales_with_bytes():
    s = shape("llama-3.1-70b")
    r16 = capacity.host_restore(s, KVDtype.BF16, REF_HW, 20_000, 4096)
    r8 = capacity.host_restore(s, KVDtype.FP8, REF_HW, 20_000, 4096)
    assert r16.restore_bytes == 20_000 * 327_680
    # Four GPUs, each over its own ~51 GB/s PCIe link.
    assert r16.restore_s == pytest.approx(r16.restore_bytes / (4 * 64e9 * 0.8))
    assert r8.restore_s == pytest.approx(r16.restore_s / 2)
    assert r16.recompute_s > 10 * r16.restore_s


def test_little_law_pools():
    s = shape("llama-3.1-70b")
    pools = {
        (d, dedup): capacity.decode_residency_pool(s, d, REF_HW, WORKLOAD, prefix_dedup=dedup)
        for d in (KVDtype.BF16, KVDtype.FP8)
        for dedup in (False, True)
    }
    for p in pools.values():
        assert p.resident_sessions == pytest.approx(WORKLOAD.concurrent_sessions)
    bf16, bf16_dedup = pools[KVDtype.BF16, False], pools[KVDtype.BF16, True]
    fp8, fp8_dedup = pools[KVDtype.FP8, False], pools[KVDtype.FP8, True]
    assert fp8_dedup.replicas <= fp8.replicas <= bf16.replicas
    assert bf16_dedup.replicas <= bf16.replicas
    # Hand check: 256 sessions x mean held tokens x 327,680 B over 146.9 GB of KV room.
    held_tokens = sum(4608 + (k - 1) * 1280 + 256 for k in range(1, 21)) / 20
    need = 256 * held_tokens * 327_680
    assert bf16.replicas == -(-need // capacity.kv_capacity_bytes_per_replica(s, REF_HW))
    freed = capacity.decode_residency_pool(s, KVDtype.BF16, REF_HW, WORKLOAD, prefix_dedup=False,
                                       retained=False)
    assert freed.resident_sessions < WORKLOAD.concurrent_sessions


def test_prefill_pool_caching_cuts_gpus():
    s = shape("llama-3.1-70b")
    gpus = {r: capacity.prefill_pool(s, WORKLOAD, REF_HW, r).gpus for r in CachingRegime}
    assert gpus[CachingRegime.NONE] > gpus[CachingRegime.PREFIX] > gpus[CachingRegime.SESSION]
    p = capacity.prefill_pool(s, WORKLOAD, REF_HW, CachingRegime.SESSION)
    assert p.steps_per_s == pytest.approx(256 / p.step_cycle_s)


def test_pools_are_none_when_weights_do_not_fit():
    s = shape("deepseek-v3")
    assert capacity.kv_capacity_bytes_per_replica(s, REF_HW) < 0
    assert capacity.decode_residency_pool(s, KVDtype.FP8, REF_HW, WORKLOAD, prefix_dedup=True).replicas is None
    assert capacity.decode_bandwidth_pool(s, KVDtype.FP8, REF_HW, WORKLOAD).replicas is None


def test_workload_and_hardware_validate():
    with pytest.raises(ValueError, match="steps"):
        msgspec.structs.replace(WORKLOAD, steps=0)
    with pytest.raises(ValueError, match="flops_utilisation"):
        msgspec.structs.replace(REF_HW, flops_utilisation=1.5)
    with pytest.raises(msgspec.ValidationError, match="gpus"):
        msgspec.convert({**msgspec.to_builtins(WORKLOAD), "gpus": 1}, Workload)


# --------------------------------------------------------------------------- sync reads
@pytest.mark.parametrize("read_s,engine_load,max_stall_s,sync", [
    (0.003, 0.0, 0.005, True),     # idle engine: the read stalls nobody
    (0.003, 1.0, 0.005, True),     # one other request waits 3 ms
    (0.003, 2.0, 0.005, False),    # two others: 6 ms of stall in all, over budget
    (0.006, 0.0, 0.005, False),    # the read alone is over budget, even when idle
    (0.005, 1.0, 0.005, True),     # at the budget: allowed
    (0.001, 4.0, 0.0, False),      # 0 turns it off
])
def test_sync_read_only_when_the_stall_it_puts_on_others_is_small(
        read_s, engine_load, max_stall_s, sync):
    assert cost.decide_sync_load(read_s, engine_load, max_stall_s) is sync


def test_sync_read_rejects_nonsense_inputs():
    assert cost.decide_sync_load(-1.0, 0.0, 0.005) is False
    assert cost.decide_sync_load(0.001, -1.0, 0.005) is False


def test_host_tier_sizing_keeps_the_gap_quantile_of_sessions():
    w = Workload(shared_prefix_tokens=4096, task_tokens=512, steps=20, tool_output_tokens=1024,
                 generated_tokens=256, concurrent_sessions=256, tool_delay_s=2.0, tpot_s=0.025)
    hw = REF_HW
    sh = shape("llama-3.1-8b")
    size = lambda share, **kw: capacity.host_tier_sizing(  # noqa: E731
        sh, KVDtype.BF16, hw, w, decode_replicas=kw.get("d", 4), gap_p50_s=5.0,
        gap_p99_s=80.0, lease_s=kw.get("lease", 120.0), warm_share=share)
    half, most = size(0.5), size(0.9)
    # The median gap is the p50; a lognormal's mean lies above it.
    assert half.warm_gap_s == pytest.approx(5.0) and half.gap_mean_s > 5.0
    # By hand: turns finish at sessions / (step time + mean gap); the tier holds those
    # finished during the kept gap, each its KV beyond the shared prefix, plus the prefix.
    per_token = planner_model.kv_bytes_per_token(sh, KVDtype.BF16)
    assert half.sessions_per_replica == 64
    assert half.host_sessions_per_replica == pytest.approx(half.finished_sessions_per_s * 5.0)
    assert half.host_bytes_per_replica == pytest.approx(
        half.host_sessions_per_replica * half.kv_bytes_per_session + 4096 * per_token)
    assert most.host_bytes_per_replica > half.host_bytes_per_replica
    # Never more sessions than the D has.
    assert size(0.999).host_sessions_per_replica == 64
    # A shorter lease leaves more gaps to the host tier alone.
    assert size(0.5, lease=10.0).outliving_lease_ratio > half.outliving_lease_ratio
    with pytest.raises(ValueError):
        size(1.0)
