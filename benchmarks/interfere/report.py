"""Per-step numbers, goodput, the verdict, the markdown report and the plot.

Top-level imports are the standard library only: ``plot`` runs under the side venv's
python (matplotlib lives there)."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from sessionkv_bench.metrics import histogram_quantile
from sessionkv_bench.stats import pct

# Engine counters read around every step (summed over label sets).
COUNTERS = (
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
    "vllm:request_success_total",
    "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_bytes_transferred_sum",
    "sessionkv_sync_load_wait_seconds_sum", "sessionkv_sync_load_wait_seconds_count",
)


# vLLM's own inter-token latency, stamped by the engine core: it leaves out the
# delays of the API server, the proxy and the client that the streamed gaps include.
ENGINE_ITL = "vllm:inter_token_latency_seconds"


def engine_itl(before: list[dict[float, float]], after: list[dict[float, float]]) -> dict:
    """p50/p95/p99 of the engines' ITL histograms over a step (every engine's tokens
    together: victims' and the long prompts' few), interpolated within buckets."""
    delta: dict[float, float] = {}
    for b, a in zip(before, after):
        for le, n in a.items():
            delta[le] = delta.get(le, 0.0) + n - b.get(le, 0.0)
    out = {f"p{round(q * 100)}": histogram_quantile(delta, q) for q in (0.5, 0.95, 0.99)}
    out["tokens"] = max(delta.values()) if delta else 0.0
    return out


def _pcts(xs: list[float], qs=(0.5, 0.95, 0.99)) -> dict[str, float | None]:
    return {f"p{round(q * 100)}": pct(xs, q) for q in qs}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def pools(engines: list[tuple[str, str]], before: list[dict], after: list[dict]) -> dict:
    """Counter deltas per pool (``coloc``, ``P``, ``D``) and what they say."""
    sums: dict[str, dict[str, float]] = {}
    for (role, _), b, a in zip(engines, before, after):
        pool = sums.setdefault(role, {})
        for k in COUNTERS:
            pool[k] = pool.get(k, 0.0) + a.get(k, 0.0) - b.get(k, 0.0)
    out = {}
    for role, d in sums.items():
        xfer_s = d["vllm:nixl_xfer_time_seconds_sum"]
        n_xfer = d["vllm:nixl_xfer_time_seconds_count"]
        kv_bytes = d["vllm:nixl_bytes_transferred_sum"]
        waits = d["sessionkv_sync_load_wait_seconds_count"]
        out[role] = {
            "requests": d["vllm:request_success_total"],
            "queue_mean_s": _ratio(d["vllm:request_queue_time_seconds_sum"],
                                   d["vllm:request_queue_time_seconds_count"]),
            "prefix_hit_rate": _ratio(d["vllm:prefix_cache_hits_total"],
                                      d["vllm:prefix_cache_queries_total"]),
            "kv_bytes": kv_bytes, "kv_transfers": n_xfer,
            "kv_bandwidth_bytes_per_s": _ratio(kv_bytes, xfer_s),
            "kv_transfer_mean_s": _ratio(xfer_s, n_xfer),
            "sync_load_wait_mean_s": _ratio(d["sessionkv_sync_load_wait_seconds_sum"], waits),
        }
    return out


def summarize_step(streams: list, rate: float, warm_s: float, duration_s: float,
                   pool_stats: dict, engine_itl_s: dict) -> dict:
    """One step: what the client measured inside [warm_s, duration_s], and the pools."""
    window = duration_s - warm_s
    victims = [s for s in streams if s.kind == "victim"]
    injected = [s for s in streams if s.kind == "injected" and warm_s <= s.sent_s < duration_s]
    gaps = [g for s in victims for g in s.gaps(warm_s, duration_s)]
    v_ttft = [s.ttft_s for s in victims if warm_s <= s.sent_s and s.ttft_s is not None]
    i_ttft = [s.ttft_s for s in injected if s.ttft_s is not None]
    routes: dict[str, dict[str, int]] = {}
    long_alone: dict[str, int] = {}   # why long prompts went to D alone
    for s in victims + injected:
        if s.route:
            r = routes.setdefault(s.kind, {})
            r[s.route] = r.get(s.route, 0) + 1
        if s.kind == "injected" and s.route == "decode_only" and s.reason:
            why = re.sub(r"\d+", "N", s.reason)
            long_alone[why] = long_alone.get(why, 0) + 1
    return {
        "rate": rate,
        "offered_injected_rps": len(injected) / window,
        "offered_injected_prompt_tok_s": sum(max(s.prompt_tokens, 0) for s in injected) / window,
        "victim_requests_started": sum(warm_s <= s.sent_s < duration_s for s in victims),
        "victim_tokens_per_s": (len(gaps) + len(v_ttft)) / window,
        "victim_itl_s": _pcts(gaps), "victim_gaps": len(gaps),
        "engine_itl_s": engine_itl_s,
        "victim_itl_mean_s": statistics.mean(gaps) if gaps else None,
        "victim_ttft_s": _pcts(v_ttft),
        "injected": len(injected), "injected_ttft_s": _pcts(i_ttft),
        "injected_unfinished": sum(s.unfinished for s in injected),
        "errors": sum(s.error is not None for s in victims + injected),
        "first_error": next((s.error for s in streams if s.error), None),
        "routes": routes, "long_prompts_to_d_alone": long_alone, "pools": pool_stats,
    }


def step_passes(step: dict, ttft_target_s: float, itl_target_s: float) -> bool:
    itl = step["victim_itl_s"]["p99"]
    ttft = step["injected_ttft_s"]["p99"]
    return (step["errors"] == 0 and step["injected_unfinished"] == 0
            and itl is not None and itl <= itl_target_s
            and (step["injected"] == 0 or (ttft is not None and ttft <= ttft_target_s)))


def goodput(steps: dict[str, dict], ttft_target_s: float, itl_target_s: float) -> float:
    """The highest injector rate at which that step and every lower one met both
    targets (0 when the lowest non-zero rate already failed)."""
    best = 0.0
    for step in sorted(steps.values(), key=lambda s: s["rate"]):
        if not step_passes(step, ttft_target_s, itl_target_s):
            break
        best = step["rate"]
    return best


def _itl_p99_under_injection(steps: dict[str, dict]) -> float | None:
    xs = [s["victim_itl_s"]["p99"] for s in steps.values()
          if s["rate"] > 0 and s["victim_itl_s"]["p99"] is not None]
    return statistics.mean(xs) if xs else None


def itl_p99_added(steps: dict[str, dict]) -> dict[str, float | None]:
    """Per injected rate, victims' ITL p99 minus its value with no injection: the
    interference itself, with the arm's own baseline taken out."""
    base = (steps.get("0") or {}).get("victim_itl_s", {}).get("p99")
    out = {}
    for key, s in steps.items():
        p99 = s["victim_itl_s"]["p99"]
        if s["rate"] > 0:
            out[key] = p99 - base if p99 is not None and base is not None else None
    return out


def _deciding_numbers(arms: dict, c: str, d: str, top: float) -> str:
    """The trade, in numbers: victims' ITL p99 (streamed and the engines' own) under
    injection, and long prompts' TTFT p99 at the highest rate."""
    def mean_p99(key: str, field: str) -> str:
        xs = [(s.get(field) or {}).get("p99") for s in arms[key]["steps"].values()
              if s["rate"] > 0]
        xs = [x for x in xs if x is not None]
        return f"{statistics.mean(xs) * 1e3:.0f}" if xs else "-"

    def ttft_top(key: str) -> str:
        step = next((s for s in arms[key]["steps"].values() if s["rate"] == top), None)
        return _ms(step["injected_ttft_s"]["p99"]) if step else "-"
    return (f"Under injection the victims' ITL p99, mean over the injected rates, was "
            f"{mean_p99(c, 'victim_itl_s')} ms co-located ({c}) against "
            f"{mean_p99(d, 'victim_itl_s')} ms P/D ({d}) as streamed, "
            f"{mean_p99(c, 'engine_itl_s')} against {mean_p99(d, 'engine_itl_s')} ms by the "
            f"engines' own count; the long prompts' TTFT p99 at {top:g} req/s was "
            f"{ttft_top(c)} ms against {ttft_top(d)} ms")


def verdict(arms: dict[str, dict], rates: list[float], ttft_target_s: float,
            itl_target_s: float) -> dict:
    """Best co-located arm against best P/D arm, by goodput, then by victims' ITL p99
    averaged over the injected rates."""
    scored = {}
    for key, arm in arms.items():
        steps = arm.get("steps") or {}
        if steps:
            scored[key] = (goodput(steps, ttft_target_s, itl_target_s),
                           _itl_p99_under_injection(steps))

    def best(kind: str):
        keys = [k for k in scored if arms[k]["kind"] == kind]
        if not keys:
            return None
        return max(keys, key=lambda k: (scored[k][0], -(scored[k][1] or float("inf"))))

    c, d = best("coloc"), best("pd")
    out: dict = {"goodput": {k: v[0] for k, v in scored.items()},
           "itl_p99_under_injection_s": {k: v[1] for k, v in scored.items()},
           "itl_p99_added_s": {k: itl_p99_added(arms[k]["steps"]) for k in scored},
           "best_coloc": c, "best_pd": d}
    if c is None or d is None:
        out.update(decision="inconclusive", why="an arm did not run")
        return out
    top = max(rates)
    numbers = _deciding_numbers(arms, c, d, top)
    # An arm that misses the ITL target with no long prompts at all fails for a
    # reason other than prefill interference (on a 2-core machine: CPU starvation of
    # the processes no core is left for); goodput cannot tell the arms apart then.
    for key in (c, d):
        base = (arms[key]["steps"].get("0") or {}).get("victim_itl_s", {}).get("p99")
        if base is not None and base > itl_target_s:
            out.update(decision="inconclusive",
                       why=f"{key} misses the victims' ITL target with no long prompts at "
                           f"all (p99 {base * 1e3:.0f} ms at rate 0, target "
                           f"{itl_target_s * 1e3:.0f} ms), so its failures are not "
                           f"interference from prefill; goodput {scored[c][0]:g} "
                           f"(co-located, {c}) against {scored[d][0]:g} req/s (P/D, {d}). "
                           + numbers)
            return out
    (gc, ic), (gd, idd) = scored[c], scored[d]
    itl_ratio = (ic / idd) if ic and idd else None
    out["itl_p99_ratio_coloc_over_pd"] = itl_ratio
    if gd > gc:
        out.update(decision="disaggregate",
                   why=f"P/D ({d}) met both targets up to {gd:g} req/s of long prompts, "
                       f"co-located ({c}) only up to {gc:g} req/s" + ". " + numbers)
    elif gd < gc:
        out.update(decision="stay co-located",
                   why=f"co-located ({c}) met both targets up to {gc:g} req/s of long "
                       f"prompts, P/D ({d}) only up to {gd:g} req/s" + ". " + numbers)
    else:
        if gc == top:
            where = "every rate swept (sweep higher rates)"
        elif gc == 0:
            where = "no injected rate (relax the targets or sweep lower rates)"
        else:
            where = f"{gc:g} req/s"
        why = f"both met the targets up to {where}"
        if ic and idd:
            why += (f"; victims' ITL p99 under injection, mean over rates: co-located "
                    f"{ic * 1e3:.0f} ms, P/D {idd * 1e3:.0f} ms")
        out.update(decision="inconclusive", why=why + ". " + numbers)
    return out


# ============================================================================ markdown
def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def pcts_ms(d: dict) -> str:
    return "/".join(_ms(d.get(k)) for k in ("p50", "p95", "p99"))


def _pool_cell(pools: dict, key: str, fmt) -> str:
    parts = [f"{role} {fmt(p[key])}" for role, p in sorted(pools.items())
             if p.get(key) is not None]
    return ", ".join(parts) or "-"


def _routes(step: dict) -> str:
    parts = []
    for kind, r in sorted(step.get("routes", {}).items()):
        n = sum(r.values())
        dis = r.get("disaggregated", 0)
        parts.append(f"{kind} {dis}/{n} via P")
    return "; ".join(parts) or "-"


def _proxy_choices(arms: dict) -> list[str]:
    """What the proxy's defaults chose at each rate (conditional disaggregation)."""
    arm = arms.get("pd-defaults")
    if not arm:
        return []
    parts = []
    for step in sorted(arm["steps"].values(), key=lambda s: s["rate"]):
        routes = step.get("routes", {})

        def via_p(kind: str) -> str:
            r = routes.get(kind, {})
            return f"{r.get('disaggregated', 0)}/{sum(r.values())}"
        alone = step.get("long_prompts_to_d_alone") or {}
        why = (" (long prompts to D alone: " + "; ".join(f"{n}x {r}" for r, n in alone.items())
               + ")") if alone else ""
        parts.append(f"at {step['rate']:g}/s long prompts {via_p('injected')} and victims "
                     f"{via_p('victim')} through P{why}")
    return ["What the proxy's defaults chose (the rest went to D alone): "
            + "; ".join(parts) + ".", ""]


def step_table(arms: dict) -> list[str]:
    lines = ["| arm | injector req/s (prompt tok/s) | victims tok/s | victims' ITL "
             "p50/p95/p99 ms | engines' ITL p50/p95/p99 ms | victims' TTFT p50/p99 ms | "
             "long TTFT p50/p95/p99 ms | "
             "long sent (unfinished) | routed through P | queue mean ms | prefix hits | "
             "KV moved MB | KV MB/s | ms per transfer | D's wait for reads ms |",
             "|" + "---|" * 15]
    for key, arm in arms.items():
        for step in sorted((arm.get("steps") or {}).values(), key=lambda s: s["rate"]):
            pools = step["pools"]
            kv = sum(p["kv_bytes"] for p in pools.values())
            lines.append(
                f"| {arm['label']} | {step['offered_injected_rps']:.2f} "
                f"({step['offered_injected_prompt_tok_s']:.0f}) | "
                f"{step['victim_tokens_per_s']:.1f} | {pcts_ms(step['victim_itl_s'])} | "
                f"{pcts_ms(step.get('engine_itl_s') or {})} | "
                f"{_ms(step['victim_ttft_s']['p50'])}/{_ms(step['victim_ttft_s']['p99'])} | "
                f"{pcts_ms(step['injected_ttft_s'])} | {step['injected']} "
                f"({step['injected_unfinished']}) | {_routes(step)} | "
                f"{_pool_cell(pools, 'queue_mean_s', _ms)} | "
                f"{_pool_cell(pools, 'prefix_hit_rate', lambda x: f'{x:.0%}')} | "
                f"{kv / 1e6:.1f} | "
                f"{_pool_cell(pools, 'kv_bandwidth_bytes_per_s', lambda x: f'{x / 1e6:.0f}')} | "
                f"{_pool_cell(pools, 'kv_transfer_mean_s', lambda x: f'{x * 1e3:.1f}')} | "
                f"{_pool_cell(pools, 'sync_load_wait_mean_s', lambda x: f'{x * 1e3:.1f}')} |")
    return lines


def render(results: dict) -> str:
    meta, fair = results["meta"], results["fairness"]
    v = results.get("verdict") or {}
    out = ["# Interference: disaggregated P/D against co-located chunked prefill", "",
           f"Generated by `benchmarks/interference.py` on {meta['date']}; wall "
           f"{meta.get('wall_s', 0):.0f} s.  Command: `{' '.join(meta['argv'])}`", "",
           f"- machine: {meta['machine']}",
           f"- model: {meta['model']}; engines' dtype {meta['dtype']}, max_model_len "
           f"{meta['max_model_len']}, {meta['blocks']} KV blocks of 32 tokens each",
           f"- victims: {meta['victims']} streams of {meta['victim_prompt_tokens']}-token "
           f"prompts, {meta['victim_max_tokens']} tokens each, back to back",
           f"- injector: {meta['injected_prompt_tokens']}-token prompts, "
           f"{meta['injected_max_tokens']} output tokens, at "
           f"{', '.join(f'{r:g}' for r in meta['rates'])} req/s, replayed from "
           f"`{meta['arrivals']}` (sha256 {fair['arrival_sha256'][:12]})",
           f"- each step: {meta['duration_s']:g} s of load, the first {meta['warm_s']:g} s "
           f"(warm-up) not counted; long prompts still running {meta['drain_s']:g} s after "
           "the load stops count as unfinished",
           f"- targets: long prompts' TTFT p99 <= {meta['ttft_target_s'] * 1e3:.0f} ms and "
           f"victims' ITL p99 <= {meta['itl_target_s'] * 1e3:.0f} ms",
           f"- cores: {meta['cores']}", ""]
    if v:
        out += [f"**Verdict: {v['decision']}.** {v['why']}.", ""]
        out += ["| arm | goodput (req/s of long prompts) | victims' ITL p99 under "
                "injection, mean over rates (ms) | ITL p99 added by injection, per rate "
                "(ms) |", "|---|---|---|---|"]
        for key, arm in results["arms"].items():
            added = (v.get("itl_p99_added_s") or {}).get(key) or {}
            out.append(f"| {arm['label']} | {v['goodput'].get(key, '-')} | "
                       f"{_ms(v['itl_p99_under_injection_s'].get(key))} | "
                       + ", ".join(f"{r}/s: {'-' if x is None else f'{x * 1e3:+.0f}'}"
                                   for r, x in added.items()) + " |")
        out.append("")
        out += _proxy_choices(results["arms"])
    out += ["Every latency beside its offered load.  \"routed through P\": requests our "
            "proxy sent P then D (the rest went to D alone, or to a co-located engine); "
            "queue, prefix hits, KV and D's wait for reads per pool from the engines' "
            "counters (`vllm:request_queue_time_seconds`, `vllm:prefix_cache_*`, "
            "`vllm:nixl_*`, `sessionkv_sync_load_wait_seconds`).", ""]
    out += step_table(results["arms"])
    out += ["", "![victims' ITL percentiles against injector rate](interference.png)", ""]
    out += ["## Fairness", "",
            f"- servers per arm: {fair['servers']}",
            "- arrival file per arm (sha256): "
            + ", ".join(f"{k} {d[:12]}" for k, d in fair["arrivals_by_arm"].items()),
            f"- prefix caches: {fair['cache_policy']}",
            "- resolved engine configs (`/server_info`), keys that differ between engines "
            "(knob: what the arms vary; instance: per-server; allowed: named with "
            "`--allow-diff`):", ""]
    out += ["| key | kind | values |", "|---|---|---|"]
    connector_keys = [d for d in fair["config_diffs"]
                      if d["key"].startswith("kv_transfer_config.")]
    for d in fair["config_diffs"]:
        if d["kind"] == "instance" and d["key"] != "env.VLLM_CPU_OMP_THREADS_BIND":
            continue
        if d in connector_keys and d["key"] not in (
                "kv_transfer_config.kv_connector", "kv_transfer_config.kv_role"):
            continue
        vals = "; ".join(f"{k}: `{json.dumps(x)[:80]}`" for k, x in d["values"].items())
        out.append(f"| `{d['key']}` | {d['kind']} | {vals} |")
    n_inst = sum(d["kind"] == "instance" for d in fair["config_diffs"])
    out += ["", f"({n_inst} per-server keys (ports, addresses, ids) and "
            f"{max(0, len(connector_keys) - 2)} more keys of the P/D engines' connector "
            "config left out; all are in the JSON.)", ""]
    if results.get("notes"):
        out += ["## Notes", ""] + [f"- {note}" for note in results["notes"]] + [""]
    if results.get("failures"):
        out += ["", "## Failures", ""] + [f"- {f}" for f in results["failures"]]
    return "\n".join(out)


def plot(json_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, arm in enumerate(data["arms"].values()):
        steps = sorted((arm.get("steps") or {}).values(), key=lambda s: s["rate"])
        if not steps:
            continue
        rates = [s["rate"] for s in steps]
        color = f"C{i}"
        for q, style in (("p50", ":"), ("p95", "--"), ("p99", "-")):
            ys = [s["victim_itl_s"][q] for s in steps]
            ax.plot(rates, [y * 1e3 if y is not None else float("nan") for y in ys],
                    linestyle=style, marker="o", color=color,
                    label=f"{arm['label']} {q}")
        ys = [s["injected_ttft_s"]["p99"] for s in steps]
        ax2.plot(rates, [y * 1e3 if y is not None else float("nan") for y in ys],
                 marker="o", color=color, label=arm["label"])
    meta = data["meta"]
    ax.axhline(meta["itl_target_s"] * 1e3, color="grey", linewidth=0.8)
    ax2.axhline(meta["ttft_target_s"] * 1e3, color="grey", linewidth=0.8)
    ax.set_xlabel("injector rate (long prompts per s)")
    ax.set_ylabel("victims' inter-token latency (ms)")
    ax.set_title("victims' ITL p50 (dotted), p95 (dashed), p99 (solid)")
    ax.legend(fontsize=6)
    ax2.set_xlabel("injector rate (long prompts per s)")
    ax2.set_ylabel("long prompts' TTFT p99 (ms)")
    ax2.set_title("long prompts' TTFT p99 (grey: target)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
