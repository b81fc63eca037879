"""The chat-text mode's report: the text ceiling, re-tokenization, one table per
regime, its comparisons with the other arms and the plots.

Top-level imports are the standard library only: ``plot`` runs under the side venv's
python (matplotlib lives there)."""

from __future__ import annotations

import json
from pathlib import Path

from agentload.report import ARM_LABELS, ARM_ORDER, _f, _ms, _sources


def _ratio(runs: dict, theirs: str, key: str) -> float | None:
    a, b = runs.get("7-ours", {}).get(key), runs.get(theirs, {}).get(key)
    return b / a if a and b else None


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def forced_pd_split(s: dict) -> str:
    """Where the forced P/D arm's TTFT went, from its step detail: P's time as the
    proxy saw it (``x-sessionkv-prefill-ms``), the rest up to the first token (the
    hand-off to D, D's pull of P's KV and D's first step), and P's pulls from D."""
    rows = [d for d in (s.get("step_detail") or {}).values()
            if d.get("route") == "disaggregated" and d.get("ttft_s") and d.get("prefill_ms")]
    if not rows:
        return "no streamed disaggregated turn with P's time"
    p_ms = [float(d["prefill_ms"]) for d in rows]
    after = [d["ttft_s"] * 1e3 - float(d["prefill_ms"]) for d in rows]
    pulls = []
    for d in rows:
        acct = json.loads(d["prefill"]) if d.get("prefill") else {}
        if acct.get("pulled_from_peer_tokens"):
            pulls.append(acct.get("pull_ms", 0.0))
    ttft = [d["ttft_s"] * 1e3 for d in rows]
    return (f"{len(rows)} streamed disaggregated turns: TTFT median {_median(ttft):.0f} ms = "
            f"P's answer {_median(p_ms):.0f} ms (median; its queue, prefill and pulls) + "
            f"{_median(after):.0f} ms from P's answer to D's first token (median; max "
            f"{max(after):.0f}); {len(pulls)} of them pulled from D, pull_ms median "
            f"{_f(_median(pulls), '{:.0f}')}")


def ceiling_lines(c: dict) -> list[str]:
    r = c["retokenization"]
    return [
        f"Text ceiling (the rendered prompts against every earlier request's prompt and "
        f"generated ids, whole blocks): {c['reusable_tokens']} of {c['prompt_tokens']} prompt "
        f"tokens reusable ({c['reusable_share']:.1%}, max reuse x{c['max_reuse_factor']:.2f});"
        f" {c['steps']} turns ({c['streamed_steps']} streamed; {c['trimmed_steps']} trim and "
        f"{c['dropped_steps']} drop the first line of the previous answer); answers "
        f"{c['answer_tokens']} tokens, {c['answers_ended_on_eos']} ended on EOS; longest "
        f"prompt {c['longest_prompt_tokens']} tokens.",
        "",
        f"Re-tokenization: of {r['turns']} turns that re-send the previous answer whole, "
        f"{r['diverged']} rendered it to ids other than those generated; "
        f"{r['lost_tokens']} of {r['ideal_tokens']} tokens lost "
        f"({r['lost_share_of_ideal']:.1%} of what those turns would share with the held "
        "KV had the answer come back as its own ids)"
        + (f"; e.g. {'; '.join(r['examples'][:2])}" if r["examples"] else "") + "."]


def workload_table(runs: dict) -> list[str]:
    lines = ["| arm | turns ok | prompt tok | computed tok | share of ceiling | TTFT p50/p99 s "
             "(streamed n) | ITL p50/p99 ms | e2e p50 s | KV MB moved | mismatches tok/lp/"
             "text (edited turns tok/lp of n) | requests per engine | prompt-token sources |",
             "|" + "---|" * 12]
    for key in [k for k in ARM_ORDER if k in runs]:
        s = runs[key]
        m = s.get("mismatches") or {}
        mm = (f"{m.get('token', 0)}/{m.get('logprob_only', 0)}/{s.get('text_mismatches', 0)} "
              f"({m.get('stripped_token', 0)}/{m.get('stripped_logprob_only', 0)} of "
              f"{m.get('stripped_compared', 0)})") if m else "-"
        lines.append(
            f"| {ARM_LABELS[key]} | {s['ok']}/{s['steps']} | {s['prompt_tokens']} | "
            f"{s['computed_tokens']:.0f} | {_f(s['share_of_max'], '{:.1%}')} | "
            f"{_f(s['ttft_p50_s'], '{:.3f}')}/{_f(s['ttft_p99_s'], '{:.3f}')} "
            f"({s.get('streamed_ok', '-')}) | {_ms(s['itl_p50_s'])}/{_ms(s['itl_p99_s'])} | "
            f"{_f(s.get('e2e_p50_s'), '{:.2f}')} | {s['bytes'] / 1e6:.1f} | {mm} | "
            f"{' / '.join(f'{x:.0f}' for x in s['requests_per_engine'])} | {_sources(s)} |")
    return lines


def pooled(results: dict, wname: str, arm: str) -> dict | None:
    """An arm's TTFT and e2e samples over every round of a workload (the first run and
    ``--rounds``' later ones), with their p50 and p99; None when it ran once."""
    from sessionkv_bench.stats import pct

    runs = [results.get("runs", {}).get(wname, {}).get(arm)]
    runs += [r.get(wname, {}).get(arm) for r in results.get("rounds", {}).values()]
    runs = [r for r in runs if r and "ttft_samples_s" in r]
    if len(runs) < 2:
        return None
    out = {"rounds": len(runs)}
    for key in ("ttft", "e2e"):
        xs = sorted(x for r in runs for x in r[f"{key}_samples_s"])
        out[f"{key}_n"] = len(xs)
        out[f"{key}_p50_s"] = pct(xs, 0.5)
        out[f"{key}_p99_s"] = pct(xs, 0.99)
    return out


def _pooled_lines(results: dict) -> list[str]:
    """Ours forced P/D against vllm-router's P/D arms, pooled over every round."""
    ours = pooled(results, "chat", "7-ours-pd")
    if ours is None:
        return []
    out = []
    for other in ("5-vr-rr", "5-vr-cache"):
        theirs = pooled(results, "chat", other)
        if theirs is None:
            continue
        out.append(_forced_pd_line(f"chat, pooled over {ours['rounds']} rounds: "
                                   f"{ours['ttft_n']} / {theirs['ttft_n']} streamed turns",
                                   other, ours, theirs))
    return out


def _forced_pd_line(scope: str, other: str, ours: dict, theirs: dict) -> str:
    """Ours forced P/D against one vllm-router arm, TTFT and
    latency p50/p99 as theirs over ours (a run's summary or ``pooled``'s figures)."""
    def vs(key: str, fmt: str) -> str:
        a, b = ours.get(key), theirs.get(key)
        return f"{_f(a, fmt)} vs {_f(b, fmt)} s = {_f(b / a if a and b else None)}"

    return (f"- ({scope}) {ARM_LABELS['7-ours-pd']} vs {ARM_LABELS[other]} "
            f"(theirs / ours): TTFT p50 {vs('ttft_p50_s', '{:.3f}')}; p99 "
            f"{vs('ttft_p99_s', '{:.3f}')}; latency (e2e) p50 {vs('e2e_p50_s', '{:.2f}')}, "
            f"p99 {vs('e2e_p99_s', '{:.2f}')}")


def comparisons(results: dict) -> list[str]:
    runs = results.get("runs", {})
    out = []
    for w in ("chat", "chat_long"):
        s = runs.get(w, {}).get("7-ours")
        if not s:
            continue
        m = s["mismatches"] or {}
        wrong = m.get("token", 0) + m.get("logprob_only", 0)
        out.append(f"- ({w}) ours in full reused {_f(s['share_of_max'], '{:.1%}')} of "
                   f"the text ceiling; answers that differ from the co-located server: "
                   f"{wrong} by token ids or top-5 logprobs, {s.get('text_mismatches', 0)} by "
                   f"text, of {m.get('compared', 0)}; {s['ok']}/{s['steps']} turns answered.")
    long_runs = runs.get("chat_long", {})
    if "7-ours" in long_runs:
        for other in ("5-vr-cache", "3-nixl-rr"):
            if other not in long_runs:
                out.append(f"- (chat_long) {ARM_LABELS[other]} not run")
                continue
            p50, p99 = _ratio(long_runs, other, "ttft_p50_s"), _ratio(long_runs, other,
                                                                     "ttft_p99_s")
            o = long_runs[other]
            out.append(f"- (chat_long) vs {ARM_LABELS[other]}: TTFT p50 "
                       f"{_f(long_runs['7-ours']['ttft_p50_s'], '{:.3f}')} s vs "
                       f"{_f(o['ttft_p50_s'], '{:.3f}')} s = {_f(p50)}x lower; p99 "
                       f"{_f(long_runs['7-ours']['ttft_p99_s'], '{:.3f}')} s vs "
                       f"{_f(o['ttft_p99_s'], '{:.3f}')} s = {_f(p99)}x"
                       + (f"; their run: {o['ok']}/{o['steps']} turns answered within the "
                          f"cap, {o.get('not_finished', 0)} cut" if o["ok"] < o["steps"]
                          else ""))
    short = runs.get("chat", {})
    if "7-ours-pd" in short:
        o = short["7-ours-pd"]
        for other in ("5-vr-rr", "5-vr-cache"):
            if other not in short:
                continue
            out.append(_forced_pd_line("chat", other, o, short[other]))
        out.append(f"- (chat) where {ARM_LABELS['7-ours-pd']}'s time went: "
                   f"{forced_pd_split(o)}")
    return out + _pooled_lines(results)


def render(results: dict) -> str:
    meta = results["meta"]
    pre = meta.get("prefill") or {}
    lines = [f"# Agent workload benchmark in chat text ({meta['date']}"
             f"{', --quick smoke run' if meta.get('quick') else ''})", "",
             f"- commit {meta.get('commit', '?')}; machine: {meta['machine']}; vLLM "
             f"{meta.get('vllm')} (CPU)",
             f"- command: `{meta.get('command', '?')}`",
             f"- model: {meta['model']}; every regime's engines in {meta['dtype']} "
             f"(equality is judged in float32){'; eager' if meta.get('enforce_eager') else ''}"
             f"; prefill of {pre.get('tokens', '?')} distinct tokens: "
             f"{_f(pre.get('engine_s_per_1k'), '{:.3f}')} s per 1,000 tokens (engine), "
             f"{_f(pre.get('client_s_per_1k'), '{:.3f}')} s (client)",
             f"- KV: P {meta['p_blocks']} blocks, D {meta['d_blocks']} blocks, each co-located "
             f"engine {meta['coloc_blocks']} blocks (32 tokens a block); two engines per arm; "
             f"max_model_len {meta['max_model_len']}",
             f"- cluster order: {', '.join(results.get('order', []))} (the co-located pair "
             "first: it serves the reference); arms sharing a cluster in a shuffled order, "
             f"every cache reset before each; an arm's run is cut after "
             f"{meta.get('run_cap_s', '-')} s",
             f"- cores: model threads on cores {', '.join(meta.get('engine_cores') or []) or '-'}"
             " (VLLM_CPU_OMP_THREADS_BIND, in start order), except the stock NIXL cluster's: "
             "its NIXL worker moves the model thread to the last core itself, so both of its "
             "engines compute on one core (stock vLLM on CPU; arm 5 on our engines is the "
             "like-for-like P/D comparison)",
             f"- our connector's prices: {json.dumps(meta.get('ours_cost'))}",
             f"- wall time {meta.get('wall_s', 0):.0f} s", ""]
    for name, desc in meta.get("workloads", {}).items():
        lines.append(f"- **{name}**: {desc}")
    lines += ["", "## Comparisons", ""] + comparisons(results)
    for wname, runs in results.get("runs", {}).items():
        lines += ["", f"## {wname}", ""]
        if wname in results.get("ceilings", {}):
            lines += ceiling_lines(results["ceilings"][wname]) + [""]
        lines += workload_table(runs)
        for key in [k for k in ARM_ORDER if k in runs]:
            s = runs[key]
            m = s.get("mismatches") or {}
            if m.get("examples") or s.get("text_mismatch_examples"):
                lines.append(f"- {key} differences: {m.get('examples', [])[:2]} "
                             f"{s.get('text_mismatch_examples', [])[:2]}")
            if s["ok"] < s["steps"]:
                lines.append(f"- {key}: {s['steps'] - s['ok']} turns not answered "
                             f"({s.get('not_finished', 0)} cut at the cap); first error: "
                             f"{s.get('first_error')}")
    lines += ["", "## How to read it", "",
              "- The client sends OpenAI chat messages in text to `/v1/chat/completions` "
              "(system prompt, tools in the request, task, answers kept as text, tool results "
              "as user text), the session id in `X-Session-ID` and `prompt_cache_key`. The "
              "co-located reference run fixes every answer; every arm then sends the messages "
              "the reference's answers give, so all arms render the same prompts.",
              "- share of ceiling: (prompt - computed) / the text ceiling's reusable tokens, "
              "computed from `vllm:prompt_tokens_by_source_total{source=\"local_compute\"}` "
              "deltas summed over both engines. The ceiling counts whole blocks; a D->P pull "
              "also brings D's partial last block, so ours can pass 100% by up to 31 tokens a"
              " turn.",
              "- TTFT / ITL from the streamed turns' chunks (n in brackets); e2e over every "
              "turn.",
              "- mismatches: turns whose token ids (tok), or only top-5 logprobs beyond 2e-3 "
              "(lp), or answer text differ from the reference at temperature 0; in brackets "
              "the turns that edited the previous answer. Arm 1 (plain co-located vLLM) is "
              "the noise floor.",
              "- KV MB moved: `vllm:nixl_bytes_transferred_sum` deltas on both engines.",
              "- turns ok: a run is cut after the cap; unfinished turns count as not ok."]
    for f in results.get("failures", []):
        lines.append(f"- FAILED: {f}")
    return "\n".join(lines)


def plot(json_path: str, out_dir: str, stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    runs = data.get("runs", {})
    fig, axes = plt.subplots(1, max(1, len(runs)), figsize=(5.5 * max(1, len(runs)), 4.5),
                             squeeze=False)
    for ax, (wname, per_arm) in zip(axes[0], runs.items()):
        keys = [k for k in ARM_ORDER if k in per_arm]
        x = range(len(keys))
        for j, (q, label) in enumerate((("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "p99"))):
            ax.bar([i + 0.4 * j for i in x], [per_arm[k][q] or 0 for k in keys], width=0.4,
                   label=label)
        ax.set_xticks([i + 0.2 for i in x], keys, rotation=45, fontsize=7, ha="right")
        ax.set_ylabel("TTFT (s, log scale)")
        ax.set_yscale("log")
        ax.set_title(f"{wname}: TTFT of streamed turns")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out_dir) / f"{stem}_ttft.png", dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(1, max(1, len(runs)), figsize=(5.5 * max(1, len(runs)), 4.5),
                             squeeze=False)
    for ax, (wname, per_arm) in zip(axes[0], runs.items()):
        keys = [k for k in ARM_ORDER if k in per_arm]
        ax.bar(range(len(keys)), [100 * (per_arm[k]["share_of_max"] or 0) for k in keys])
        ax.axhline(90, linestyle="--", linewidth=1, color="grey")
        ax.set_xticks(range(len(keys)), keys, rotation=45, fontsize=7, ha="right")
        ax.set_ylabel("% of the text ceiling reused")
        ax.set_title(wname)
    fig.tight_layout()
    fig.savefig(Path(out_dir) / f"{stem}_reuse.png", dpi=100)
    plt.close(fig)
