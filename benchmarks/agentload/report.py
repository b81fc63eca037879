"""The agent benchmark's table, headline figures and plots.

Top-level imports are the standard library only: ``plot`` runs under the side venv's
python (matplotlib lives there)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ARM_LABELS = {
    "1-rr": "1 co-located + round robin",
    "2-ours-coloc": "2 co-located + our proxy",
    "3-nixl-rr": "3 stock NIXL P/D + round robin",
    "4-nixl-bidi": "4 stock bidirectional NIXL + conversation proxy",
    "5-vr-rr": "5 vllm-router P/D round_robin",
    "5-vr-cache": "5 vllm-router P/D cache_aware",
    "6-ours-nopull": "6 ours, D->P pulls off",
    "7-ours": "7 ours in full",
    "7-ours-pd": "7 ours, P/D forced on every turn",
    "5-vr-cache-coloc": "5 vllm-router cache_aware (co-located)",
    "8-ours-nohost": "8 ours, short lease, no host tier",
    "8-ours-host": "8 ours, short lease, host tier",
}
ARM_ORDER = list(ARM_LABELS)


def _f(x, fmt: str = "{:.2f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def _ms(x) -> str:
    return _f(x, "{:.0f}") if x is None else f"{x * 1e3:.0f}"


def _sources(s: dict) -> str:
    """Where P's (or each co-located engine's) prompt tokens came from."""
    parts = []
    for name, e in s["engines"].items():
        if name.startswith("D"):
            continue
        ours = e.get("sessionkv")
        if ours:
            parts.append(f"{name}: hit {ours['local_hit']:.0f} / pulled "
                         f"{ours['pulled_from_peer']:.0f} / host {ours['pulled_from_host']:.0f}"
                         f" / computed {ours['recomputed']:.0f}")
        else:
            parts.append(f"{name}: hit {e['local_hit']:.0f} / external {e['external']:.0f}"
                         f" / computed {e['computed']:.0f}")
    d = [e for n, e in s["engines"].items() if n.startswith("D")]
    if d:
        e = d[0]
        host = (e.get("sessionkv") or {}).get("pulled_from_host", 0.0)
        parts.append(f"D: computed {e['computed']:.0f}"
                     + (f" / host {host:.0f}" if host else ""))
    if s.get("routes"):
        parts.append("routes " + ", ".join(f"{k} {v}" for k, v in sorted(s["routes"].items())))
    return "; ".join(parts)


def workload_table(runs: dict, ceiling: dict) -> list[str]:
    lines = ["| arm | steps ok | prompt tok | computed tok | computed/step | reuse x | "
             "share of max | TTFT p50/p99/mean s | ITL p50/p99 ms | req/s | KV MB moved | "
             "KV KB/step | mismatches tok/lp (stripped tok/lp of n) | requests per engine | "
             "prompt-token sources |",
             "|" + "---|" * 15]
    for key in [k for k in ARM_ORDER if k in runs]:
        s = runs[key]
        m = s.get("mismatches") or {}
        mm = (f"{m.get('token', 0)}/{m.get('logprob_only', 0)} "
              f"({m.get('stripped_token', 0)}/{m.get('stripped_logprob_only', 0)} of "
              f"{m.get('stripped_compared', 0)})") if m else "-"
        lines.append(
            f"| {ARM_LABELS[key]} | {s['ok']}/{s['steps']} | {s['prompt_tokens']} | "
            f"{s['computed_tokens']:.0f} | {_f(s['computed_per_step'], '{:.0f}')} | "
            f"{_f(s['reuse_factor'])} | {_f(s['share_of_max'], '{:.1%}')} | "
            f"{_f(s['ttft_p50_s'], '{:.3f}')}/{_f(s['ttft_p99_s'], '{:.3f}')}/"
            f"{_f(s['ttft_mean_s'], '{:.3f}')} | {_ms(s['itl_p50_s'])}/{_ms(s['itl_p99_s'])} | "
            f"{_f(s['offered_rps'])} | {s['bytes'] / 1e6:.1f} | "
            f"{_f(s['bytes_per_step'] / 1e3 if s['bytes_per_step'] is not None else None, '{:.0f}')}"
            f" | {mm} | {' / '.join(f'{x:.0f}' for x in s['requests_per_engine'])} | "
            f"{_sources(s)} |")
    if ceiling:
        lines.append("")
        lines.append(f"Ceiling (from the workload and the reference's answers): "
                     f"{ceiling['reusable_tokens']} of {ceiling['prompt_tokens']} prompt "
                     f"tokens reusable ({ceiling['reusable_share']:.1%}), max reuse "
                     f"x{ceiling['max_reuse_factor']:.2f}; {ceiling['steps']} steps, "
                     f"{ceiling['stripped_steps']} of them strip the previous reasoning.")
    return lines


def probe_lines(probes: dict) -> list[str]:
    lines = []
    for wname, per_arm in probes.items():
        what = (" every step after the first strips the previous reasoning;"
                if wname == "probe-strip" else "")
        lines.append(f"**{wname}** (one session alone, step after step;{what} per step: "
                     "session tokens, KV KB moved, computed prompt tokens; last/second = KV "
                     "bytes of the last step over the second's; equal = token ids and top-5 "
                     "logprobs within 2e-3 of the reference, the e2e tests' comparison):")
        lines.append("")
        lines.append("| arm | session tokens | KV KB per step | computed per step | "
                     "last/second | steps equal to reference |")
        lines.append("|---|---|---|---|---|---|")
        for key in [k for k in ARM_ORDER if k in per_arm]:
            steps = per_arm[key]
            b = [s["bytes"] for s in steps]
            ratio = (b[-1] / b[1]) if len(b) > 2 and b[1] else None
            eq = [s["equal"] for s in steps if s["equal"] is not None]
            lengths = ", ".join(str(s["session_tokens"]) for s in steps)
            kbs = ", ".join(f"{x / 1e3:.0f}" for x in b)
            computed = ", ".join("{:.0f}".format(s["computed"]) for s in steps)
            lines.append(f"| {ARM_LABELS[key]} | {lengths} | {kbs} | {computed} | "
                         f"{_f(ratio)} | {sum(eq)}/{len(eq)} |")
        lines.append("")
    return lines


def _host_tier_headline(host: dict) -> list[str]:
    """Ours with the host tier against ours without it, on the host-tier workload."""
    a, b = host.get("8-ours-host"), host.get("8-ours-nohost")
    if not (a and b):
        return []
    restored = sum((e.get("sessionkv") or {}).get("pulled_from_host", 0.0)
                   for e in a["engines"].values())
    ratio = lambda k: (b[k] / a[k]) if a.get(k) and b.get(k) else None  # noqa: E731
    return [f"- host: with the host tier ours computed {a['computed_tokens']:.0f} prompt "
            f"tokens against {b['computed_tokens']:.0f} without it "
            f"({_f(ratio('computed_tokens'))}x fewer; {restored:.0f} restored from host); "
            f"TTFT p50 {_f(ratio('ttft_p50_s'))}x lower, p99 {_f(ratio('ttft_p99_s'))}x "
            f"lower (without / with)"]


def headlines(results: dict) -> list[str]:
    runs = results.get("runs", {})
    out = []
    for w in ("r1", "r2"):
        r = runs.get(w, {})
        c = results.get("ceilings", {}).get(w)
        if "7-ours" in r and c:
            s = r["7-ours"]
            out.append(f"- {w}: ours in full computed {s['computed_tokens']:.0f} of "
                       f"{s['prompt_tokens']} prompt tokens: reuse x{_f(s['reuse_factor'])}, "
                       f"{_f(s['share_of_max'], '{:.1%}')} of the ceiling's reusable tokens "
                       f"(ceiling x{c['max_reuse_factor']:.2f}).")
        for other in ("3-nixl-rr", "5-vr-rr", "5-vr-cache", "6-ours-nopull", "1-rr"):
            if "7-ours" in r and other in r:
                a, b = r["7-ours"], r[other]
                ratio = lambda k: (b[k] / a[k]) if a.get(k) and b.get(k) else None  # noqa: E731
                out.append(f"  - vs {ARM_LABELS[other]}: computed tokens "
                           f"{a['computed_tokens']:.0f} vs {b['computed_tokens']:.0f}; TTFT p50 "
                           f"{_f(ratio('ttft_p50_s'))}x lower, p99 {_f(ratio('ttft_p99_s'))}x "
                           f"lower (theirs / ours)")
        if w == "r2" and "7-ours" in r:
            p = next((e for n, e in r["7-ours"]["engines"].items() if n.startswith("P")), {})
            pulled = (p.get("sessionkv") or {}).get("pulled_from_peer")
            if pulled is not None:
                out.append(f"  - r2: of ours' prompt tokens on P, {pulled:.0f} came from D->P "
                           f"pulls")
            if "6-ours-nopull" in r:
                saved = r["6-ours-nopull"]["computed_tokens"] - r["7-ours"]["computed_tokens"]
                out.append(f"  - r2: pulls on vs off: {saved:.0f} fewer computed tokens")
        for key in ("7-ours", "6-ours-nopull", "2-ours-coloc"):
            if key in r and decisions(r[key]):
                out.append(f"  - {w} {ARM_LABELS[key]}: {decisions(r[key])}")
    for w, per_arm in results.get("probes", {}).items():
        for key in ("7-ours", "4-nixl-bidi", "3-nixl-rr"):
            steps = per_arm.get(key)
            if not steps or len(steps) < 3:
                continue
            grow = (f"as the session grows {steps[1]['session_tokens']} -> "
                    f"{steps[-1]['session_tokens']} tokens")
            if steps[1]["bytes"]:
                out.append(f"- {w} {ARM_LABELS[key]}: KV bytes last step / second step = "
                           f"{steps[-1]['bytes'] / steps[1]['bytes']:.2f} "
                           f"({steps[1]['bytes'] / 1e3:.0f} KB -> {steps[-1]['bytes'] / 1e3:.0f}"
                           f" KB {grow})")
            else:
                kbs = ", ".join("{:.0f}".format(st["bytes"] / 1e3) for st in steps[1:])
                out.append(f"- {w} {ARM_LABELS[key]}: KV bytes per step after the first: "
                           f"{kbs} KB {grow}")
    strict: dict[str, list[int]] = {}
    for w, per_arm in results.get("probes", {}).items():
        for key, steps in per_arm.items():
            eq = [st["equal"] for st in steps if st["equal"] is not None]
            acc = strict.setdefault(key, [0, 0, 0, 0])
            acc[0] += sum(eq)
            acc[1] += len(eq)
            if w == "probe-strip":
                acc[2] += sum(eq)
                acc[3] += len(eq)
    if strict:
        out.append("- strict correctness (probe sessions, one request at a time, token ids "
                   "and top-5 logprobs within 2e-3 of the reference): " + "; ".join(
                       f"{key} {a[0]}/{a[1]} steps equal ({a[2]}/{a[3]} in the stripping "
                       "session)" for key, a in ((k, strict[k]) for k in ARM_ORDER
                                                 if k in strict)))
    out += _host_tier_headline(runs.get("host", {}))
    sk = runs.get("skew", {})
    for a, b in (("2-ours-coloc", "1-rr"), ("7-ours", "3-nixl-rr")):
        if a in sk and b in sk:
            out.append(f"- skew: {ARM_LABELS[a]} TTFT mean {_f(sk[a]['ttft_mean_s'], '{:.3f}')}"
                       f" s / p99 {_f(sk[a]['ttft_p99_s'], '{:.3f}')} s (requests per engine "
                       f"{sk[a]['requests_per_engine']}) vs {ARM_LABELS[b]} "
                       f"{_f(sk[b]['ttft_mean_s'], '{:.3f}')} s / "
                       f"{_f(sk[b]['ttft_p99_s'], '{:.3f}')} s ({sk[b]['requests_per_engine']})")
    mc = runs.get("mooncake", {})
    if mc:
        c = results.get("meta", {}).get("mooncake_file_ceiling")
        for key, s in mc.items():
            out.append(f"- mooncake: {ARM_LABELS[key]} reused "
                       f"{s['prompt_tokens'] - s['computed_tokens']:.0f} of "
                       f"{s['reusable_tokens']} reusable tokens "
                       f"({_f(s['share_of_max'], '{:.1%}')} of the slice's ceiling; "
                       f"file ceiling {_f(c, '{:.1%}')} of blocks)")
    for w, per_arm in runs.items():
        for key, s in per_arm.items():
            m = s.get("mismatches") or {}
            if m.get("token") or m.get("logprob_only"):
                out.append(f"- mismatches {w}/{key}: {m['token']} steps with token "
                           f"differences, {m['logprob_only']} with logprob-only differences "
                           f"of {m['compared']}; e.g. {m['examples'][:2]}")
    return out


def decisions(s: dict) -> str | None:
    """P's pull-or-recompute decisions over one of our arms' disaggregated steps (the
    ``x-sessionkv-prefill`` accounting each answer carries) and the proxy's route
    reasons, so a run without pulls says why."""
    detail = s.get("step_detail") or {}
    acct = []
    for d in detail.values():
        try:
            acct.append(json.loads(d["prefill"]) if d.get("prefill") else None)
        except ValueError:
            acct.append(None)
    through_p = [a for a in acct if a]
    if not detail or not any(d.get("route") for d in detail.values()):
        return None
    kinds: dict[str, int] = {}
    for a in through_p:
        key = a.get("decision") or "no decision"
        kinds[key] = kinds.get(key, 0) + 1
    reasons: dict[str, int] = {}
    for d in detail.values():
        # The reason's words without its numbers: one count per kind of decision.
        r = re.sub(r"\d+(\.\d+)?", "N", (d.get("reason") or d.get("route") or "?").split(" (")[0])
        reasons[r] = reasons.get(r, 0) + 1
    handles: dict[str, int] = {}
    for d in detail.values():
        if d.get("route") == "disaggregated":
            h = d.get("handle") or "?"
            handles[h] = handles.get(h, 0) + 1
    pulled = sum(a.get("pulled_from_peer_tokens", 0) for a in through_p)
    pulls = [a for a in through_p if a.get("pulled_from_peer_tokens")]
    priced = (f"; priced pull {sum(a.get('priced_pull_ms', 0) for a in pulls):.0f} ms vs "
              f"recompute {sum(a.get('priced_recompute_ms', 0) for a in pulls):.0f} ms, "
              f"measured pull {sum(a.get('pull_ms', 0) for a in pulls):.0f} ms"
              if pulls else "")
    return (f"{len(through_p)} of {len(detail)} steps through P, {len(pulls)} with a D->P pull "
            f"({pulled} tokens{priced}); P's decisions: "
            + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
            + "; D's session handle on those: "
            + (", ".join(f"{k} {v}" for k, v in sorted(handles.items())) or "-")
            + "; route reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))


def rounds_lines(results: dict) -> list[str]:
    """Every round's TTFT and computed tokens per arm (``--rounds``), round 1 first."""
    extra = results.get("rounds") or {}
    if not extra:
        return []
    lines = ["| workload | arm | round | computed tok | TTFT p50/p99/mean s | steps ok |",
             "|---|---|---|---|---|---|"]
    rounds = {"1": results.get("runs", {}), **extra}
    for wname in results.get("runs", {}):
        for key in ARM_ORDER:
            for rno, runs in sorted(rounds.items(), key=lambda kv: int(kv[0])):
                s = runs.get(wname, {}).get(key)
                if s:
                    lines.append(f"| {wname} | {ARM_LABELS[key]} | {rno} | "
                                 f"{s['computed_tokens']:.0f} | {_f(s['ttft_p50_s'], '{:.3f}')}/"
                                 f"{_f(s['ttft_p99_s'], '{:.3f}')}/"
                                 f"{_f(s['ttft_mean_s'], '{:.3f}')} | {s['ok']}/{s['steps']} |")
    return lines


def render(results: dict) -> str:
    meta = results["meta"]
    pre = meta.get("prefill") or {}
    lines = [f"# Agent workload benchmark ({meta['date']}"
             f"{', --quick smoke run' if meta.get('quick') else ''})", "",
             f"- machine: {meta['machine']}; vLLM {meta.get('vllm')} (CPU)",
             f"- model: {meta['model']}, engines in {meta.get('dtype', 'bfloat16')}; prefill of {pre.get('tokens', '?')} distinct tokens: "
             f"{_f(pre.get('engine_s_per_1k'), '{:.3f}')} s per 1,000 tokens (engine's "
             f"prefill-time histogram), {_f(pre.get('client_s_per_1k'), '{:.3f}')} s (client)",
             f"- KV: P {meta['p_blocks']} blocks, D {meta['d_blocks']} blocks, each co-located "
             f"engine {meta['coloc_blocks']} blocks (32 tokens a block); two engines per arm"
             + (f"; the host-tier arms (8-*): D {meta['host_arms']['d_blocks']} blocks, "
                f"session lease {meta['host_arms']['lease_s']:g} s, host tier "
                f"{meta['host_arms']['host_tier_bytes'] / 2**20:.0f} MiB on each engine of "
                "arm 8-ours-host" if meta.get("host_arms") else ""),
             f"- cluster order: {', '.join(results.get('order', []))} (the co-located pair "
             "first: it serves the reference); arms sharing a cluster in a shuffled order per "
             f"workload and round ({meta.get('rounds', 1)} round(s)), every cache reset before "
             f"each; an arm's run is cut after {meta.get('run_cap_s', '-')} s"
             + (f"; external engines for {', '.join(meta['external'])}"
                if meta.get("external") else ""),
             "- cores: " + (f"each arm's engines' model threads on cores "
                            f"{', '.join(meta['engine_cores'])} (VLLM_CPU_OMP_THREADS_BIND, "
                            "in start order), except the stock NIXL clusters' (stock, "
                            "bidi): their NIXL worker moves the model thread to the last core "
                            "itself, so they keep vLLM's binding and both of their engines "
                            "compute on that one core. That is stock vLLM on CPU, not a choice "
                            "of this bench, and it slows arms 3 and 4; arm 5 (vllm-router on "
                            "our engines, a core each) is the like-for-like P/D comparison"
                            if meta.get("engine_cores")
                            else "vLLM's own binding"),
             f"- our connector's recompute price from the measured prefill: "
             f"{json.dumps(meta.get('ours_cost'))}",
             f"- wall time {meta.get('wall_s', 0):.0f} s", ""]
    for name, desc in meta.get("workloads", {}).items():
        lines.append(f"- **{name}**: {desc}")
    lines += ["", "## Headlines", ""] + headlines(results)
    for wname, runs in results.get("runs", {}).items():
        lines += ["", f"## {wname}", ""]
        lines += workload_table(runs, results.get("ceilings", {}).get(wname))
    if results.get("rounds"):
        lines += ["", "## Every round (--rounds)", ""] + rounds_lines(results)
    if results.get("probes"):
        lines += ["", "## KV bytes and computed tokens per step (probe sessions)", ""]
        lines += probe_lines(results["probes"])
    lines += ["", "## How to read it", "",
              "- computed tok: prompt tokens the engines computed, summed over both engines "
              "of the arm, from `vllm:prompt_tokens_by_source_total{source=\"local_compute\"}`"
              " deltas; reuse x = prompt tokens / computed; share of max = (prompt - computed)"
              " / the ceiling's reusable tokens for the steps that succeeded. The ceiling "
              "counts whole blocks, a prefix cache's unit; a D->P pull also brings D's "
              "partial last block, so ours can pass 100% by up to 31 tokens a step.",
              "- prompt-token sources: P's (or each co-located engine's) tokens: ours from "
              "`sessionkv_prompt_tokens_total{source}` (hit = P's own prefix cache, pulled = "
              "D->P, host = host tier, computed), stock from vLLM's `local_cache_hit` / "
              "`external_kv_transfer` / `local_compute`; D: tokens D computed.",
              "- TTFT / ITL from the client's streamed chunks. Arm 4's proxy must ask D for a "
              "non-streamed answer (vLLM 0.32 returns D's handle only there), so its TTFT is "
              "the whole request.",
              "- mismatches (concurrent runs): steps whose token ids (tok) or only top-5 "
              "logprobs (lp, beyond 2e-3) differ from the co-located reference at temperature"
              " 0; in brackets the steps that stripped the previous reasoning. The engines "
              "run in float32 (`--dtype`): in bfloat16 on this CPU build the answers moved "
              "with batch composition and with where a prefix-cache hit split the prompt (up"
              " to 0.38 in logprob for plain co-located vLLM against its own reference), "
              "which would hide wrong KV in noise; arm 1 (plain co-located vLLM, no KV "
              "transfer) is the noise floor of these columns. The probe sessions are the "
              "strict check: one request at a time, as in the e2e tests.",
              "- KV MB moved: `vllm:nixl_bytes_transferred_sum` deltas on both engines.",
              "- steps ok: an arm's run is cut after the time cap above; its unfinished "
              "steps count as not ok, and its computed tokens include the work those did.",
              "- GPU engines and a real model: `--model --gpus` launches them, `--external "
              "FILE` uses engines already running (the file format, the engines' required "
              "options and `--rounds` are in `benchmarks/agent_workload.py`'s docstring).",
              "- requests per engine: `vllm:request_success_total` deltas (a P/D request "
              "counts on P and on D; a request ours serves on one engine counts once)."]
    for key, cmd in sorted(results.get("commands", {}).items()):
        lines.append(f"- `{key}`: `{cmd}`")
    for f in results.get("failures", []):
        lines.append(f"- FAILED: {f}")
    return "\n".join(lines)


def plot(json_path: str, out_dir: str, stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    out = Path(out_dir)
    # 1. Computed prompt tokens per step, per probe session and arm.
    probes = data.get("probes", {})
    fig, axes = plt.subplots(1, max(1, len(probes)), figsize=(6 * max(1, len(probes)), 4.5),
                             squeeze=False)
    for ax, (wname, per_arm) in zip(axes[0], probes.items()):
        for key in [k for k in ARM_ORDER if k in per_arm]:
            steps = per_arm[key]
            i = ARM_ORDER.index(key)
            ax.plot([s["step"] for s in steps], [s["computed"] for s in steps],
                    marker="os^vD<>px"[i % 9], linestyle=("-", "--", ":", "-.")[i % 4],
                    label=ARM_LABELS[key])
        ax.set_xlabel("step of the session")
        ax.set_ylabel("prompt tokens computed (engine counters)")
        ax.set_title(f"{wname}: computed tokens per step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}_computed_per_step.png", dpi=100)
    plt.close(fig)
    # 2. TTFT percentiles per arm, per workload.
    runs = data.get("runs", {})
    fig, axes = plt.subplots(1, max(1, len(runs)), figsize=(5 * max(1, len(runs)), 4.5),
                             squeeze=False)
    for ax, (wname, per_arm) in zip(axes[0], runs.items()):
        keys = [k for k in ARM_ORDER if k in per_arm]
        x = range(len(keys))
        for j, (q, label) in enumerate((("ttft_p50_s", "p50"), ("ttft_p99_s", "p99"))):
            ax.bar([i + 0.4 * j for i in x], [per_arm[k][q] or 0 for k in keys], width=0.4,
                   label=label)
        ax.set_xticks([i + 0.2 for i in x], [k for k in keys], rotation=45, fontsize=7,
                      ha="right")
        ax.set_ylabel("TTFT (s, log scale)")
        ax.set_yscale("log")
        ax.set_title(wname)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}_ttft.png", dpi=100)
    plt.close(fig)
    # 3. KV bytes per step against the session's length.
    fig, axes = plt.subplots(1, max(1, len(probes)), figsize=(6 * max(1, len(probes)), 4.5),
                             squeeze=False)
    for ax, (wname, per_arm) in zip(axes[0], probes.items()):
        for key in [k for k in ARM_ORDER if k in per_arm]:
            steps = per_arm[key]
            if any(s["bytes"] for s in steps):
                i = ARM_ORDER.index(key)
                ax.plot([s["session_tokens"] for s in steps], [s["bytes"] / 1e3 for s in steps],
                        marker="os^vD<>px"[i % 9], linestyle=("-", "--", ":", "-.")[i % 4],
                        label=ARM_LABELS[key])
        ax.set_xlabel("session length (prompt tokens)")
        ax.set_ylabel("KV moved in the step (KB, NIXL counters)")
        ax.set_title(f"{wname}: KV bytes per step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}_bytes_per_step.png", dpi=100)
    plt.close(fig)
