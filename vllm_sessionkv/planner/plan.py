"""``sessionkv-plan``: the cost model as a capacity planner.

    sessionkv-plan --config PATH/config.json --kv-dtype {bf16,fp8,nvfp4} [--json]

Prints a table, or with ``--json`` one JSON object whose numeric keys end with their
unit.  All arithmetic lives in :mod:`vllm_sessionkv.wire.cost`, the module the connector
and the router use; this file only gathers the numbers (:func:`build_plan`, pure) and
renders them.  Exit status 2 means bad input (a missing config key is named).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from vllm_sessionkv.planner import capacity, model
from vllm_sessionkv.planner.capacity import CachingRegime, Hardware, Workload
from vllm_sessionkv.planner.model import KVDtype, ModelShape
from vllm_sessionkv.wire.cost import transfer_time_s

__all__ = ["HostGaps", "build_plan", "main", "render_table"]

# Prompt lengths for the "handoff share does not depend on prompt length" table.
_SHARE_PROMPTS_TOKENS = (1024, 8192, 32768, 131072)
_GB = 1e9


class HostGaps(msgspec.Struct, frozen=True):
    """Tool gaps between a session's turns (lognormal through p50 and p99; published
    agent traces: about 5 s and over 80 s), the session lease, and the warm shares to
    size the host tier for."""

    p50_s: float = 5.0
    p99_s: float = 80.0
    lease_s: float = 120.0
    warm_shares: tuple[float, ...] = (0.5, 0.9, 0.99)


_DEFAULT_GAPS = HostGaps()


def build_plan(
    shape: ModelShape,
    kv_dtype: KVDtype,
    hw: Hardware,
    workload: Workload,
    prompt_tokens: int,
    host_gaps: HostGaps | None = None,
) -> dict[str, Any]:
    """Every figure the planner reports, as plain data with unit-suffixed keys."""
    host_gaps = host_gaps or HostGaps()
    per_token = model.kv_bytes_per_token(shape, kv_dtype)
    prompt_bytes = prompt_tokens * per_token
    linear_flops = model.linear_prefill_flops(shape, prompt_tokens)
    attn_flops = model.attention_prefill_flops(shape, prompt_tokens)
    linear_s = capacity.prefill_time_s(linear_flops, hw)
    full_s = capacity.prefill_time_s(linear_flops + attn_flops, hw)
    kv_capacity = capacity.kv_capacity_bytes_per_replica(shape, hw)
    warnings: list[str] = []
    if kv_capacity <= 0:
        usable = hw.gpus_per_replica * hw.hbm_bytes_per_gpu * hw.memory_utilisation
        warnings.append(
            f"weights need {capacity.weight_bytes(shape, hw) / _GB:.0f} GB but a replica has "
            f"{usable / _GB:.0f} GB usable: raise --gpus-per-replica or --hbm-gb, or lower "
            "--weight-bytes-per-param; pool sizes are null"
        )

    handoff = _handoff(shape, kv_dtype, hw, prompt_bytes, linear_s, full_s)

    by_length = _handoff_by_length(shape, hw, per_token, prompt_tokens)

    regimes = {r: capacity.session_prefill_work(shape, workload, hw, r) for r in CachingRegime}

    # The host tier matters most at the last step, when the session history is longest.
    history_tokens, _ = capacity.step_new_tokens(workload, workload.steps, CachingRegime.PREFIX)
    restore = capacity.host_restore(
        shape, kv_dtype, hw, history_tokens, workload.shared_prefix_tokens
    )

    pools, host_tier = _pools(shape, kv_dtype, hw, workload, kv_capacity, host_gaps,
                              warnings)

    return {
        "model": _model_info(shape),
        "kv_dtype": kv_dtype.value,
        "hardware": _hardware_info(shape, hw, kv_capacity),
        "workload": msgspec.to_builtins(workload),
        "kv": {
            "kv_bytes_per_token": per_token,
            "prompt_tokens": prompt_tokens,
            "prompt_kv_bytes": prompt_bytes,
            "by_dtype": {
                f"{d.value}_kv_bytes_per_token": model.kv_bytes_per_token(shape, d) for d in KVDtype
            },
        },
        "prefill": {
            "prompt_tokens": prompt_tokens,
            "linear_flops": linear_flops,
            "attention_flops": attn_flops,
            "linear_ms": linear_s * 1e3,
            "with_attention_ms": full_s * 1e3,
        },
        "handoff": handoff,
        "handoff_400g_by_prompt_length": by_length,
        "caching_regimes": _caching_regimes(regimes),
        "host_restore": _host_restore_info(restore, hw, workload),
        "pools": pools,
        "host_tier": host_tier,
        "warnings": warnings,
    }


def _pools(shape: ModelShape, kv_dtype: KVDtype, hw: Hardware, workload: Workload,
           kv_capacity: float, host_gaps: HostGaps, warnings: list[str]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """P and D pool sizes, and the host tier per D (a warning when a size is null)."""
    dtypes = [kv_dtype] if kv_dtype is KVDtype.FP8 else [kv_dtype, KVDtype.FP8]
    residency = [
        capacity.decode_residency_pool(shape, d, hw, workload, prefix_dedup=dedup, retained=kept)
        for kept in (True, False)
        for d in dtypes
        for dedup in (False, True)
    ]
    bandwidth = [capacity.decode_bandwidth_pool(shape, d, hw, workload) for d in dtypes]
    if any(p.replicas is None for p in bandwidth) and kv_capacity > 0:
        warnings.append(
            "reading the weights once takes longer than --tpot-ms: decode pool by bandwidth is null"
        )

    # Host memory per D: with as many D as decoding at the TPOT takes (the first dtype).
    decode_replicas = bandwidth[0].replicas or 1
    host_tier = [msgspec.to_builtins(capacity.host_tier_sizing(
        shape, kv_dtype, hw, workload, decode_replicas=decode_replicas,
        gap_p50_s=host_gaps.p50_s, gap_p99_s=host_gaps.p99_s, lease_s=host_gaps.lease_s,
        warm_share=share)) for share in host_gaps.warm_shares]
    pools = {
        "prefill_by_throughput": [
            msgspec.to_builtins(capacity.prefill_pool(shape, workload, hw, r)) for r in CachingRegime
        ] if kv_capacity > 0 else [],
        "decode_by_residency": [msgspec.to_builtins(p) for p in residency],
        "decode_by_bandwidth": [msgspec.to_builtins(p) for p in bandwidth],
    }
    return pools, {"decode_replicas": decode_replicas, "by_warm_share": host_tier}


def _handoff(shape: ModelShape, kv_dtype: KVDtype, hw: Hardware, prompt_bytes: float,
             linear_s: float, full_s: float) -> list[dict[str, Any]]:
    """The prompt's P->D handoff over each catalogued link, as a share of prefill."""
    handoff = []
    for link in capacity.LINKS:
        line_s = transfer_time_s(prompt_bytes, link.line_bytes_per_s)
        eff_s = transfer_time_s(prompt_bytes, link.effective_bytes_per_s)
        handoff.append({
            "link": link.name,
            "line_bytes_per_s": link.line_bytes_per_s,
            "effective_bytes_per_s": link.effective_bytes_per_s,
            "line_rate_ms": line_s * 1e3,
            "effective_ms": eff_s * 1e3,
            "share_of_linear_prefill_line_rate_pct": 100 * line_s / linear_s,
            "share_of_linear_prefill_pct": 100 * eff_s / linear_s,
            "share_of_prefill_with_attention_pct": 100 * eff_s / full_s,
            "closed_form_share_ratio": capacity.handoff_share_ratio(
                shape, kv_dtype, hw, link.effective_bytes_per_s
            ),
        })
    return handoff


def _handoff_by_length(shape: ModelShape, hw: Hardware, per_token: float,
                       prompt_tokens: int) -> list[dict[str, Any]]:
    """The 400G handoff's share of prefill at several prompt lengths."""
    by_length = []
    link = capacity.LINK_400G
    for tokens in sorted({*_SHARE_PROMPTS_TOKENS, prompt_tokens}):
        handoff_s = transfer_time_s(tokens * per_token, link.line_bytes_per_s)
        lin_s = capacity.prefill_time_s(model.prefill_flops(shape, tokens, attention=False), hw)
        att_s = capacity.prefill_time_s(model.prefill_flops(shape, tokens), hw)
        by_length.append({
            "prompt_tokens": tokens,
            "handoff_line_rate_ms": handoff_s * 1e3,
            "linear_prefill_ms": lin_s * 1e3,
            "prefill_with_attention_ms": att_s * 1e3,
            "share_of_linear_prefill_pct": 100 * handoff_s / lin_s,
            "share_of_prefill_with_attention_pct": 100 * handoff_s / att_s,
        })
    return by_length


def _model_info(shape: ModelShape) -> dict[str, Any]:
    return {
        "name": shape.name,
        "attention": shape.attention.value,
        "layers": shape.layers,
        "kv_heads": shape.kv_heads,
        "kv_head_dim_elements": shape.kv_head_dim,
        "kv_elements_per_token": shape.kv_elements_per_token,
        "total_params": shape.total_params,
        "active_params": shape.active_params,
    }


def _hardware_info(shape: ModelShape, hw: Hardware, kv_capacity: float) -> dict[str, Any]:
    return {
        "gpu_peak_flops_per_s": hw.gpu_peak_flops_per_s,
        "flops_utilisation_ratio": hw.flops_utilisation,
        "replica_gpus": hw.gpus_per_replica,
        "replica_flops_per_s": capacity.replica_flops_per_s(hw),
        "hbm_bytes_per_gpu": hw.hbm_bytes_per_gpu,
        "hbm_bytes_per_s_per_gpu": hw.hbm_bytes_per_s_per_gpu,
        "weight_bytes": capacity.weight_bytes(shape, hw),
        "kv_capacity_bytes_per_replica": kv_capacity,
        "kv_copies_per_replica": capacity.kv_copies_per_replica(shape, hw),
    }


def _caching_regimes(regimes: dict[CachingRegime, Any]) -> dict[str, Any]:
    none_w, prefix_w, session_w = (regimes[r] for r in CachingRegime)
    return {
        "per_session": [msgspec.to_builtins(w) for w in regimes.values()],
        "none_over_session_flops_ratio": none_w.prefill_flops / session_w.prefill_flops,
        "prefix_over_session_flops_ratio": prefix_w.prefill_flops / session_w.prefill_flops,
        "none_over_prefix_flops_ratio": none_w.prefill_flops / prefix_w.prefill_flops,
        "none_over_session_tokens_ratio": none_w.prefill_tokens / session_w.prefill_tokens,
        "prefix_over_session_tokens_ratio": prefix_w.prefill_tokens / session_w.prefill_tokens,
    }


def _host_restore_info(restore: Any, hw: Hardware, workload: Workload) -> dict[str, Any]:
    return {
        "link": hw.host_link.name,
        "host_link_effective_bytes_per_s_per_gpu": hw.host_link.effective_bytes_per_s,
        "history_tokens": restore.tokens,
        "context_tokens": workload.shared_prefix_tokens,
        "restore_bytes": restore.restore_bytes,
        "restore_ms": restore.restore_s * 1e3,
        "recompute_ms": restore.recompute_s * 1e3,
        "recompute_over_restore_ratio": restore.recompute_s / restore.restore_s
        if restore.restore_s
        else None,
    }


# --------------------------------------------------------------------------- rendering


def _rows(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    ).rstrip()
    return [fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def _kv(pairs: Sequence[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in pairs)
    return [f"{k.ljust(width)}  {v}" for k, v in pairs]


def _n(value: int | float | None, spec: str = ",.0f") -> str:
    return "n/a" if value is None else format(value, spec)


def render_table(plan: dict[str, Any]) -> str:
    sections = [*_model_sections(plan), *_handoff_sections(plan), _session_section(plan),
                _host_restore_section(plan), _pools_section(plan), *_host_tier_sections(plan)]
    if plan["warnings"]:
        sections.append(("Warnings", [f"- {w}" for w in plan["warnings"]]))
    out: list[str] = []
    for title, lines in sections:
        out.extend(["", f"== {title}", *lines])
    return "\n".join(out[1:]) + "\n"


_Section = tuple[str, list[str]]


def _model_sections(plan: dict[str, Any]) -> list[_Section]:
    m, hw, kv, pf = plan["model"], plan["hardware"], plan["kv"], plan["prefill"]
    return [
        ("Model", _kv([
            ("name", m["name"]),
            ("attention", f"{m['attention']}, {m['layers']} layers, {m['kv_heads']} KV heads "
                          f"x {m['kv_head_dim_elements']}"),
            ("params", f"{m['total_params'] / 1e9:.2f} B total, {m['active_params'] / 1e9:.2f} B active"),
            ("replica", f"{hw['replica_gpus']} x GPU, {hw['replica_flops_per_s'] / 1e12:,.0f} TFLOP/s "
                        f"effective, weights {hw['weight_bytes'] / _GB:,.1f} GB, "
                        f"KV room {hw['kv_capacity_bytes_per_replica'] / _GB:,.1f} GB"),
        ])),
        (f"KV cache ({plan['kv_dtype']})", _kv([
            ("per token", f"{kv['kv_bytes_per_token']:,.0f} B ({kv['kv_bytes_per_token'] / 1024:,.1f} KiB)"),
            (f"per {kv['prompt_tokens']:,}-token prompt", f"{kv['prompt_kv_bytes'] / _GB:,.2f} GB"),
            ("per token by dtype", ", ".join(
                f"{k.split('_')[0]} {b:,.0f} B" for k, b in kv["by_dtype"].items())),
        ])),
        (f"Prefill of {pf['prompt_tokens']:,} tokens", _kv([
            ("linear (2 x params x tokens)", f"{pf['linear_flops']:.3e} FLOP, {pf['linear_ms']:,.1f} ms"),
            ("with attention term", f"{pf['attention_flops']:.3e} FLOP more, {pf['with_attention_ms']:,.1f} ms"),
        ])),
    ]


def _handoff_sections(plan: dict[str, Any]) -> list[_Section]:
    return [
        ("Handoff P->D of that prompt (share of prefill)", _rows(
            ["link", "line GB/s", "eff GB/s", "line ms", "eff ms", "line %", "eff %", "eff % w/ attn"],
            [[h["link"], f"{h['line_bytes_per_s'] / _GB:,.1f}", f"{h['effective_bytes_per_s'] / _GB:,.1f}",
              f"{h['line_rate_ms']:,.1f}", f"{h['effective_ms']:,.1f}",
              f"{h['share_of_linear_prefill_line_rate_pct']:.1f}", f"{h['share_of_linear_prefill_pct']:.1f}",
              f"{h['share_of_prefill_with_attention_pct']:.1f}"] for h in plan["handoff"]],
        )),
        ("400G handoff share by prompt length (line rate): constant against linear prefill", _rows(
            ["prompt tokens", "handoff ms", "linear prefill ms", "share %", "w/ attn ms", "share w/ attn %"],
            [[f"{r['prompt_tokens']:,}", f"{r['handoff_line_rate_ms']:,.1f}", f"{r['linear_prefill_ms']:,.1f}",
              f"{r['share_of_linear_prefill_pct']:.2f}", f"{r['prefill_with_attention_ms']:,.1f}",
              f"{r['share_of_prefill_with_attention_pct']:.2f}"] for r in plan["handoff_400g_by_prompt_length"]],
        )),
    ]


def _session_section(plan: dict[str, Any]) -> _Section:
    wl, cr = plan["workload"], plan["caching_regimes"]
    return (
        f"Prefill per session: prefix {wl['shared_prefix_tokens']:,} + task {wl['task_tokens']:,}, "
        f"{wl['steps']} steps x (gen {wl['generated_tokens']:,} + tool {wl['tool_output_tokens']:,})",
        _rows(
            ["caching", "tokens", "FLOP", "idle replica s"],
            [[w["regime"], f"{w['prefill_tokens']:,}", f"{w['prefill_flops']:.3e}", f"{w['prefill_s']:,.2f}"]
             for w in cr["per_session"]],
        ) + _kv([
            ("none / session", f"{cr['none_over_session_flops_ratio']:.1f}x FLOP "
                               f"({cr['none_over_session_tokens_ratio']:.1f}x tokens)"),
            ("prefix / session", f"{cr['prefix_over_session_flops_ratio']:.1f}x FLOP "
                                 f"({cr['prefix_over_session_tokens_ratio']:.1f}x tokens)"),
            ("none / prefix", f"{cr['none_over_prefix_flops_ratio']:.2f}x FLOP"),
        ]),
    )


def _host_restore_section(plan: dict[str, Any]) -> _Section:
    hr = plan["host_restore"]
    ratio = hr["recompute_over_restore_ratio"]
    return ("Host DRAM restore vs recompute (last step's history)", _kv([
        ("history", f"{hr['history_tokens']:,} tokens after {hr['context_tokens']:,}, "
                    f"{hr['restore_bytes'] / _GB:,.2f} GB"),
        ("restore", f"{hr['restore_ms']:,.1f} ms over {hr['link']} "
                    f"({hr['host_link_effective_bytes_per_s_per_gpu'] / _GB:,.0f} GB/s per GPU)"),
        ("recompute", f"{hr['recompute_ms']:,.1f} ms"
                      + ("" if ratio is None else f"  ({ratio:,.1f}x the restore)")),
    ]))


def _pools_section(plan: dict[str, Any]) -> _Section:
    wl, pools = plan["workload"], plan["pools"]
    return (
        f"Pools for {wl['concurrent_sessions']:,} concurrent sessions, tool delay {wl['tool_delay_s']:g} s, "
        f"TPOT {wl['tpot_s'] * 1e3:g} ms",
        ["P by throughput (prefill FLOP/s demanded / delivered):"]
        + ([] if pools["prefill_by_throughput"] else ["(n/a: the weights do not fit a replica)"])
        + _rows(
            ["caching", "cycle s", "calls/s", "replicas", "GPUs"],
            [[p["regime"], f"{p['step_cycle_s']:.2f}", f"{p['steps_per_s']:,.1f}",
              _n(p["replicas"]), _n(p["gpus"])] for p in pools["prefill_by_throughput"]],
        )
        + ["", "D by KV residency (Little's law: resident = call rate x residency time):"]
        + _rows(
            ["kv dtype", "prefix dedup", "kept through tools", "resident", "GB/session", "replicas", "GPUs"],
            [[p["kv_dtype"], "yes" if p["prefix_dedup"] else "no", "yes" if p["retained"] else "no",
              f"{p['resident_sessions']:,.1f}", f"{p['kv_bytes_per_session'] / _GB:,.2f}",
              _n(p["replicas"]), _n(p["gpus"])] for p in pools["decode_by_residency"]],
        )
        + ["", "D by HBM bandwidth at the TPOT (weights + batch KV read per step):"]
        + _rows(
            ["kv dtype", "decoding", "max batch", "replicas", "GPUs"],
            [[p["kv_dtype"], f"{p['decoding_sessions']:,.1f}", f"{p['max_batch_sessions']:,.1f}",
              _n(p["replicas"]), _n(p["gpus"])] for p in pools["decode_by_bandwidth"]],
        ),
    )


def _host_tier_sections(plan: dict[str, Any]) -> list[_Section]:
    ht = plan["host_tier"]
    rows = ht["by_warm_share"]
    if not rows:
        return []
    first = rows[0]
    return [(
        f"Host tier per D ({ht['decode_replicas']} D by bandwidth, "
        f"{first['sessions_per_replica']:,.1f} sessions each; gaps p50 "
        f"{first['gap_p50_s']:g} s, p99 {first['gap_p99_s']:g} s, mean "
        f"{first['gap_mean_s']:.1f} s; lease {first['lease_s']:g} s: "
        f"{first['outliving_lease_ratio']:.1%} of gaps outlive it)",
        _rows(["warm share", "gap kept s", "sessions on host", "GB/session", "host GB per D"],
              [[f"{r['target_warm_share_ratio']:.0%}", f"{r['warm_gap_s']:,.1f}",
                f"{r['host_sessions_per_replica']:,.1f}",
                f"{r['kv_bytes_per_session'] / _GB:,.2f}",
                f"{r['host_bytes_per_replica'] / _GB:,.1f}"] for r in rows]),
    )]


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sessionkv-plan",
        description="KV size, handoff cost, caching savings and P/D pool sizes for one model.",
    )
    p.add_argument("--config", required=True, help="HF config.json of the model")
    p.add_argument("--kv-dtype", choices=[d.value for d in KVDtype], default="bf16")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--params-b", type=float, help="active parameters, billions (default: from config)")
    p.add_argument("--total-params-b", type=float, help="total parameters, billions (MoE)")
    g = p.add_argument_group("hardware (per GPU unless stated)")
    # 1000 TFLOP/s dense BF16 rounds H100/H200 SXM's 989; at 40 % MFU that is the
    # 400 TFLOP/s effective of the published reference figure.
    g.add_argument("--gpu-tflops", type=float, default=1000.0, help="peak dense BF16 TFLOP/s")
    g.add_argument("--mfu", type=float, default=0.4, help="achieved / peak FLOP/s in prefill")
    g.add_argument("--gpus-per-replica", type=int, default=4, help="TP size of one replica")
    g.add_argument("--hbm-gb", type=float, default=80.0)
    g.add_argument("--hbm-gbps", type=float, default=3350.0, help="HBM bandwidth, GB/s")
    g.add_argument("--hbm-efficiency", type=float, default=0.8)
    g.add_argument("--memory-utilisation", type=float, default=0.9, help="vLLM gpu_memory_utilization")
    g.add_argument("--weight-bytes-per-param", type=float, default=2.0)
    w = p.add_argument_group("workload (one agent session)")
    w.add_argument("--shared-prefix-tokens", type=int, default=4096)
    w.add_argument("--task-tokens", type=int, default=512)
    w.add_argument("--steps", type=int, default=20)
    w.add_argument("--tool-output-tokens", type=int, default=1024, help="per step")
    w.add_argument("--generated-tokens", type=int, default=256, help="per step")
    w.add_argument("--concurrent-sessions", type=int, default=256)
    w.add_argument("--tool-delay-s", type=float, default=2.0)
    w.add_argument("--tpot-ms", type=float, default=25.0, help="target time per output token")
    w.add_argument("--prompt-tokens", type=int, default=8192, help="prompt for the handoff table")
    h = p.add_argument_group("host tier (tool gaps between a session's turns)")
    h.add_argument("--gap-p50-s", type=float, default=_DEFAULT_GAPS.p50_s)
    h.add_argument("--gap-p99-s", type=float, default=_DEFAULT_GAPS.p99_s)
    h.add_argument("--session-lease-s", type=float, default=_DEFAULT_GAPS.lease_s,
                   help="the connector's session_lease_s")
    h.add_argument("--warm-share", type=float, action="append",
                   help="share of sessions to keep warm (repeatable; default 0.5, 0.9, 0.99)")
    return p


def _fail(message: str) -> int:
    sys.stderr.write(f"sessionkv-plan: error: {message}\n")
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with open(args.config, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return _fail(f"cannot read {args.config}: {e}")
    if not isinstance(config, dict):
        return _fail(f"{args.config}: expected a JSON object")
    try:
        shape = model.model_shape_from_hf_config(
            config,
            active_params=None if args.params_b is None else args.params_b * 1e9,
            total_params=None if args.total_params_b is None else args.total_params_b * 1e9,
        )
        hw = Hardware(
            gpu_peak_flops_per_s=args.gpu_tflops * 1e12,
            flops_utilisation=args.mfu,
            gpus_per_replica=args.gpus_per_replica,
            hbm_bytes_per_gpu=args.hbm_gb * 1e9,
            hbm_bytes_per_s_per_gpu=args.hbm_gbps * 1e9,
            hbm_efficiency=args.hbm_efficiency,
            memory_utilisation=args.memory_utilisation,
            weight_bytes_per_param=args.weight_bytes_per_param,
        )
        workload = Workload(
            shared_prefix_tokens=args.shared_prefix_tokens,
            task_tokens=args.task_tokens,
            steps=args.steps,
            tool_output_tokens=args.tool_output_tokens,
            generated_tokens=args.generated_tokens,
            concurrent_sessions=args.concurrent_sessions,
            tool_delay_s=args.tool_delay_s,
            tpot_s=args.tpot_ms / 1e3,
        )
        if args.prompt_tokens < 1:
            raise ValueError("--prompt-tokens must be >= 1")
        gaps = HostGaps(p50_s=args.gap_p50_s, p99_s=args.gap_p99_s,
                        lease_s=args.session_lease_s,
                        warm_shares=tuple(args.warm_share or _DEFAULT_GAPS.warm_shares))
        plan = build_plan(shape, KVDtype(args.kv_dtype), hw, workload, args.prompt_tokens,
                          gaps)
    except model.ConfigError as e:
        return _fail(f"{args.config}: {e}")
    except ValueError as e:
        return _fail(str(e))
    if args.json:
        sys.stdout.write(json.dumps(plan, indent=2) + "\n")
    else:
        sys.stdout.write(render_table(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
