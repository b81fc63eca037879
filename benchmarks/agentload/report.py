"""The agent benchmark's report, both clients: headlines, one table per workload, the
probes, every round, and the plots.  Written by ``sessionkv_bench.report.write``.

Top-level imports are the standard library only: ``plot`` runs under the side venv's
python (matplotlib lives there)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from sessionkv_bench import report
from sessionkv_bench.client import accounting as _json
from sessionkv_bench.stats import pct

# Ours against the arms it is compared with, where both ran a workload.
PAIRS = {"7-ours": ("3-nixl-rr", "4-nixl-bidi", "5-vr-rr", "5-vr-cache", "6-ours-nopull",
                    "1-rr", "2-ours-coloc"),
         "7-ours-pd": ("5-vr-rr", "5-vr-cache"), "8-ours-host": ("8-ours-nohost",),
         "2-ours-coloc": ("1-rr", "5-vr-cache-coloc"),
         "9-ours": ("9-ours-age", "9-vr-cache", "9-coloc")}


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _labels() -> tuple[dict[str, str], list[str]]:
    from sessionkv_bench.arms import ARMS

    return {a.key: a.label for a in ARMS}, [a.key for a in ARMS]


def _sources(s: dict) -> str:
    """Where P's (or each co-located engine's) prompt tokens came from; D's computed."""
    parts = []
    for name, e in s["engines"].items():
        ours = e.get("sessionkv") or {}
        if name.startswith("D"):
            host = ours.get("pulled_from_host", 0.0)
            parts.append(f"D: computed {e['computed']:.0f}" + (f" / host {host:.0f}" if host
                                                                else ""))
        elif ours:
            parts.append(f"{name}: hit {ours['local_hit']:.0f} / pulled "
                         f"{ours['pulled_from_peer']:.0f} / host {ours['pulled_from_host']:.0f}"
                         f" / computed {ours['recomputed']:.0f}")
        else:
            parts.append(f"{name}: hit {e['local_hit']:.0f} / external {e['external']:.0f}"
                         f" / computed {e['computed']:.0f}")
    if s.get("routes"):
        parts.append("routes " + ", ".join(f"{k} {v}" for k, v in sorted(s["routes"].items())))
    return "; ".join(parts)


def workload_table(runs: dict) -> list[str]:
    labels, order = _labels()
    rows = []
    for key in [k for k in order if k in runs]:
        s = runs[key]
        m = s.get("mismatches") or {}
        rows.append([
            labels[key], f"{s['ok']}/{s['steps']}", s["prompt_tokens"],
            f"{s['computed_tokens']:.0f}", _f(s["reuse_factor"]),
            _f(s["share_of_max"], "{:.1%}"),
            f"{_f(s['ttft_p50_s'], '{:.3f}')}/{_f(s['ttft_p99_s'], '{:.3f}')}/"
            f"{_f(s['ttft_mean_s'], '{:.3f}')} ({s.get('streamed_ok', '-')})",
            f"{report.ms(s['itl_p50_s'])}/{report.ms(s['itl_p99_s'])}", _f(s.get("e2e_p50_s")),
            f"{s['bytes'] / 1e6:.1f}", " / ".join(f"{v:.0f}" for v in s["tiers"].values())
            if "tiers" in s else "-",
            f"{m.get('token', 0)}/{m.get('logprob_only', 0)}/{s.get('text_mismatches', '-')} "
            f"({m.get('stripped_token', 0)}/{m.get('stripped_logprob_only', 0)} of "
            f"{m.get('stripped_compared', 0)})",
            " / ".join(f"{x:.0f}" for x in s["requests_per_engine"]), _sources(s)])
    return report.table(
        ["arm", "steps ok", "prompt tok", "computed tok", "reuse x", "share of ceiling",
         "TTFT p50/p99/mean s (streamed n)", "ITL p50/p99 ms", "e2e p50 s", "KV MB moved",
         "refused claims / host restored / disk promoted blocks",
         "mismatches tok/lp/text (edited steps tok/lp of n)", "requests per engine",
         "prompt-token sources"], rows)


def ceiling_lines(c: dict) -> list[str]:
    out = [f"Ceiling (the prompts as sent or rendered, against every earlier request's "
           f"prompt and generated ids, whole blocks): {c['reusable_tokens']} of "
           f"{c['prompt_tokens']} prompt tokens reusable ({c['reusable_share']:.1%}), max "
           f"reuse x{c['max_reuse_factor']:.2f}; {c['steps']} steps, {c['stripped_steps']} "
           "of them edit (strip) the previous answer."]
    r = c.get("retokenization")
    if r:
        out += ["", f"Chat turns: {c['streamed_steps']} streamed; {c['trimmed_steps']} trim "
                f"and {c['dropped_steps']} drop the first line of the previous answer; "
                f"answers {c['answer_tokens']} tokens, {c['answers_ended_on_eos']} ended on "
                f"EOS; longest prompt {c['longest_prompt_tokens']} tokens.", "",
                f"Re-tokenization: of {r['turns']} turns that re-send the previous answer "
                f"whole, {r['diverged']} rendered it to ids other than those generated; "
                f"{r['lost_tokens']} of {r['ideal_tokens']} tokens lost "
                f"({r['lost_share_of_ideal']:.1%} of what those turns would share with the "
                "held KV had the answer come back as its own ids)"
                + (f"; e.g. {'; '.join(r['examples'][:2])}" if r["examples"] else "") + "."]
    return out


def pooled(results: dict, wname: str, arm: str) -> dict | None:
    """An arm's TTFT and e2e samples over every round of a workload (the first run and
    ``--rounds``' later ones), with their p50 and p99; None when it ran once."""
    runs = [results.get("runs", {}).get(wname, {}).get(arm)]
    runs += [r.get(wname, {}).get(arm) for r in results.get("rounds", {}).values()]
    runs = [r for r in runs if r and "ttft_samples_s" in r]
    if len(runs) < 2:
        return None
    out = {"rounds": len(runs)}
    for key in ("ttft", "e2e"):
        xs = sorted(x for r in runs for x in r[f"{key}_samples_s"])
        out[f"{key}_n"] = len(xs)
        out[f"{key}_p50_s"], out[f"{key}_p99_s"] = pct(xs, 0.5), pct(xs, 0.99)
    return out


def vs_line(scope: str, ours: str, other: str, a: dict, b: dict) -> str:
    """Ours against another arm, theirs over ours (a run's summary or ``pooled``'s)."""
    labels, _ = _labels()

    def vs(key: str, fmt: str = "{:.3f}") -> str:
        x, y = a.get(key), b.get(key)
        return f"{_f(x, fmt)} vs {_f(y, fmt)} s = {_f(y / x if x and y else None)}"

    return (f"- ({scope}) {labels[ours]} vs {labels[other]} (theirs / ours): "
            + (f"computed tokens {a['computed_tokens']:.0f} vs {b['computed_tokens']:.0f}; "
               if "computed_tokens" in a else "")
            + f"TTFT p50 {vs('ttft_p50_s')}; p99 {vs('ttft_p99_s')}"
            + (f"; mean {vs('ttft_mean_s')}" if "ttft_mean_s" in a else "")
            + (f"; latency (e2e) p50 {vs('e2e_p50_s', '{:.2f}')}, p99 {vs('e2e_p99_s', '{:.2f}')}"
               if a.get("e2e_p50_s") else "")
            + (f"; theirs: {b['ok']}/{b['steps']} steps answered within the cap, "
               f"{b.get('not_finished', 0)} cut" if b.get("ok", 1) < b.get("steps", 1) else ""))


def decisions(s: dict) -> str | None:
    """P's pull-or-recompute decisions over one of our arms' steps (the
    ``x-sessionkv-prefill`` accounting each answer carries) and the proxy's route
    reasons, so a run without pulls says why."""
    detail = s.get("step_detail") or {}
    if not any(d.get("route") for d in detail.values()):
        return None
    through_p = [a for a in (_json(d.get("prefill")) for d in detail.values()) if a]
    kinds = Counter(a.get("decision") or "no decision" for a in through_p)
    # The reason's words without its numbers: one count per kind of decision.
    reasons = Counter(re.sub(r"\d+(\.\d+)?", "N", (d.get("reason") or d.get("route") or "?")
                             .split(" (")[0]) for d in detail.values())
    handles = Counter(d.get("handle") or "?" for d in detail.values()
                      if d.get("route") == "disaggregated")
    pulls = [a for a in through_p if a.get("pulled_from_peer_tokens")]
    priced = (f"; priced pull {sum(a.get('priced_pull_ms', 0) for a in pulls):.0f} ms vs "
              f"recompute {sum(a.get('priced_recompute_ms', 0) for a in pulls):.0f} ms, "
              f"measured pull {sum(a.get('pull_ms', 0) for a in pulls):.0f} ms" if pulls else "")
    counts = lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"  # noqa: E731
    return (f"{len(through_p)} of {len(detail)} steps through P, {len(pulls)} with a D->P pull "
            f"({sum(a['pulled_from_peer_tokens'] for a in pulls)} tokens{priced}); P's "
            f"decisions: {counts(kinds)}; D's session handle on those: {counts(handles)}; "
            f"route reasons: {counts(reasons)}")


def forced_pd_split(s: dict) -> str:
    """Where the forced P/D arm's TTFT went: P's time as the proxy saw it
    (``x-sessionkv-prefill-ms``), the rest up to the first token (the hand-off to D,
    D's pull of P's KV and D's first step), and P's pulls from D."""
    rows = [d for d in (s.get("step_detail") or {}).values()
            if d.get("route") == "disaggregated" and d.get("ttft_s") and d.get("prefill_ms")]
    if not rows:
        return "no streamed disaggregated turn with P's time"
    p_ms = [float(d["prefill_ms"]) for d in rows]
    after = [d["ttft_s"] * 1e3 - float(d["prefill_ms"]) for d in rows]
    pulls = [_json(d.get("prefill")).get("pull_ms", 0.0) for d in rows
             if _json(d.get("prefill")).get("pulled_from_peer_tokens")]
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    return (f"{len(rows)} streamed disaggregated turns: TTFT median "
            f"{med([d['ttft_s'] * 1e3 for d in rows]):.0f} ms = P's answer {med(p_ms):.0f} ms "
            f"(median; its queue, prefill and pulls) + {med(after):.0f} ms from P's answer to "
            f"D's first token (median; max {max(after):.0f}); {len(pulls)} of them pulled from"
            f" D, pull_ms median {_f(med(pulls), '{:.0f}')}")


def probe_lines(probes: dict) -> tuple[list[str], list[str]]:
    """The probes' tables and their headlines (KV bytes as a session grows, strict
    correctness)."""
    labels, order = _labels()
    lines, heads, strict = [], [], {}
    for wname, per_arm in probes.items():
        what = " every step after the first strips the previous reasoning;" \
            if wname == "probe-strip" else ""
        lines += [f"**{wname}** (one session alone, step after step;{what} per step: session "
                  "tokens, KV KB moved, computed prompt tokens; last/second = KV bytes of the "
                  "last step over the second's; equal = the e2e tests' comparison with the "
                  "reference):", ""]
        rows = []
        for key in [k for k in order if k in per_arm]:
            steps = per_arm[key]
            b = [s["bytes"] for s in steps]
            eq = [s["equal"] for s in steps if s["equal"] is not None]
            acc = strict.setdefault(key, [0, 0, 0, 0])
            acc[0:2] = acc[0] + sum(eq), acc[1] + len(eq)
            if wname == "probe-strip":
                acc[2:4] = acc[2] + sum(eq), acc[3] + len(eq)
            rows.append([labels[key], ", ".join(str(s["session_tokens"]) for s in steps),
                         ", ".join(f"{x / 1e3:.0f}" for x in b),
                         ", ".join(f"{s['computed']:.0f}" for s in steps),
                         _f(b[-1] / b[1] if len(b) > 2 and b[1] else None),
                         f"{sum(eq)}/{len(eq)}"])
            if key in ("7-ours", "4-nixl-bidi", "3-nixl-rr") and len(steps) >= 3:
                grow = f"as the session grows {steps[1]['session_tokens']} -> " \
                       f"{steps[-1]['session_tokens']} tokens"
                heads.append(f"- {wname} {labels[key]}: KV bytes last step / second step = "
                             f"{b[-1] / b[1]:.2f} ({b[1] / 1e3:.0f} KB -> {b[-1] / 1e3:.0f} KB "
                             f"{grow})" if b[1] else f"- {wname} {labels[key]}: KV bytes per "
                             f"step after the first: {', '.join(f'{x / 1e3:.0f}' for x in b[1:])}"
                             f" KB {grow}")
        lines += report.table(["arm", "session tokens", "KV KB per step", "computed per step",
                               "last/second", "steps equal to reference"], rows) + [""]
    if strict:
        heads.append("- strict correctness (probe sessions, one request at a time, token ids "
                     "and top-5 logprobs within 2e-3 of the reference): " + "; ".join(
                         f"{k} {a[0]}/{a[1]} steps equal ({a[2]}/{a[3]} in the stripping "
                         "session)" for k, a in ((k, strict[k]) for k in order if k in strict)))
    return lines, heads


def headlines(results: dict) -> list[str]:
    labels, _ = _labels()
    out = []
    for w, r in results.get("runs", {}).items():
        c = results.get("ceilings", {}).get(w)
        for s in (r.get(k) for k in ("7-ours", "9-ours") if c and k in r):
            m = s["mismatches"]
            out.append(f"- ({w}) ours in full computed {s['computed_tokens']:.0f} of "
                       f"{s['prompt_tokens']} prompt tokens: reuse x{_f(s['reuse_factor'])}, "
                       f"{_f(s['share_of_max'], '{:.1%}')} of the ceiling's reusable tokens "
                       f"(ceiling x{c['max_reuse_factor']:.2f}); answers that differ from the "
                       f"co-located reference: {m['token']} by token ids, {m['logprob_only']} "
                       f"by top-5 logprobs only, {s.get('text_mismatches', 0)} by text, of "
                       f"{m['compared']}; {s['ok']}/{s['steps']} steps answered.")
        for ours, others in PAIRS.items():
            for other in (o for o in others if ours in r and o in r):
                out.append(vs_line(w, ours, other, r[ours], r[other]))
                a, b = pooled(results, w, ours), pooled(results, w, other)
                if a and b:
                    out.append(vs_line(f"{w}, pooled over {a['rounds']} rounds: {a['ttft_n']}"
                                       f" / {b['ttft_n']} streamed steps", ours, other, a, b))
        if w == "chat_pressure":
            out += pressure_lines(r)
        for key in ("7-ours", "7-ours-pd", "6-ours-nopull", "2-ours-coloc", "9-ours",
                    "9-ours-age"):
            if key in r and decisions(r[key]):
                out.append(f"  - ({w}) {labels[key]}: {decisions(r[key])}")
        if "7-ours-pd" in r:
            out.append(f"- ({w}) where {labels['7-ours-pd']}'s time went: "
                       f"{forced_pd_split(r['7-ours-pd'])}")
        if w == "mooncake":
            fc = results["meta"].get("mooncake_file_ceiling")
            out += [f"- mooncake: {labels[k]} reused "
                    f"{s['prompt_tokens'] - s['computed_tokens']:.0f} of {s['reusable_tokens']}"
                    f" reusable tokens ({_f(s['share_of_max'], '{:.1%}')} of the slice's "
                    f"ceiling; file ceiling {_f(fc, '{:.1%}')} of blocks)"
                    for k, s in r.items()]
        for key, s in r.items():
            m = s.get("mismatches") or {}
            if m.get("token") or m.get("logprob_only") or s.get("text_mismatches"):
                out.append(f"- mismatches {w}/{key}: {m['token']} steps with token "
                           f"differences, {m['logprob_only']} with logprob-only differences, "
                           f"{s.get('text_mismatches', 0)} by text, of {m['compared']}; e.g. "
                           f"{m['examples'][:2]} {s.get('text_mismatch_examples', [])[:2]}")
    return out + probe_lines(results.get("probes", {}))[1]


def pressure_lines(r: dict) -> list[str]:
    """Issue 47's must-show 1 on chat_pressure against the unlimited-memory ceiling (the
    reuse ceiling over the rendered prompts: every earlier request's KV kept)."""
    ours, vr = r.get("9-ours") or {}, r.get("9-vr-cache") or {}
    x = vr.get("ttft_p50_s") and ours.get("ttft_p50_s") and vr["ttft_p50_s"] / ours["ttft_p50_s"]
    shares = ", ".join(f"{k} {_f(s['share_of_max'], '{:.1%}')}" for k, s in r.items())
    return [f"- (chat_pressure) must-show 1: share of the unlimited-memory ceiling's reused "
            "tokens (the ceiling below: every earlier request's prompt and answer kept) "
            f"{shares} (9-ours >= 90%: {(ours.get('share_of_max') or 0) >= 0.9}); TTFT "
            f"p50 9-vr-cache / 9-ours = {_f(x or None)} (>= 2: {(x or 0) >= 2}); answers "
            "differing from the co-located reference by token ids or text: " + ", ".join(
                f"{k} {s['mismatches']['token'] + s['text_mismatches']}" for k, s in r.items())
            + ". vLLM's own offloading alone (`OffloadingConnector`) is no arm: its worker "
            "raises on the CPU build (docs/tiers.md)."]


def rounds_lines(results: dict) -> list[str]:
    """Every round's TTFT and computed tokens per arm (``--rounds``), round 1 first."""
    labels, order = _labels()
    rounds = {"1": results.get("runs", {}), **results.get("rounds", {})}
    rows = [[w, labels[key], rno, f"{s['computed_tokens']:.0f}",
             f"{_f(s['ttft_p50_s'], '{:.3f}')}/{_f(s['ttft_p99_s'], '{:.3f}')}/"
             f"{_f(s['ttft_mean_s'], '{:.3f}')}", f"{s['ok']}/{s['steps']}"]
            for w in results.get("runs", {}) for key in order
            for rno, runs in sorted(rounds.items(), key=lambda kv: int(kv[0]))
            for s in [runs.get(w, {}).get(key)] if s]
    return report.table(["workload", "arm", "round", "computed tok", "TTFT p50/p99/mean s",
                         "steps ok"], rows)


def render(results: dict) -> str:
    # (Reports written before the run recorded its commit and command: their argv.)
    argv = results["meta"].get("argv", ["benchmarks/agent_workload.py"])
    meta = {"commit": "not recorded", "command": " ".join(["python", *argv])} | results["meta"]
    pre = meta.get("prefill") or {}
    chat = meta.get("client") == "chat"
    lines = report.head(f"Agent workload benchmark{' in chat text' if chat else ''}"
                        f"{' (--quick smoke run)' if meta.get('quick') else ''}", meta) + [
        f"- vLLM {meta.get('vllm')} (CPU); model: {meta['model']}, engines in "
        f"{meta['dtype']}{', eager' if meta.get('enforce_eager') else ''}; prefill of "
        f"{pre.get('tokens', '?')} distinct tokens: {_f(pre.get('engine_s_per_1k'), '{:.3f}')}"
        f" s per 1,000 tokens (engine's prefill-time histogram), "
        f"{_f(pre.get('client_s_per_1k'), '{:.3f}')} s (client)",
        f"- KV: P {meta['p_blocks']} blocks, D {meta['d_blocks']} blocks, each co-located "
        f"engine {meta['coloc_blocks']} blocks (32 tokens a block); two engines per arm; "
        f"max_model_len {meta['max_model_len']}"
        + (f"; the host-tier arms (8-*): D {meta['host_arms']['d_blocks']} blocks, session "
           f"lease {meta['host_arms']['lease_s']:g} s, host tier "
           f"{meta['host_arms']['host_tier_bytes'] / 2**20:.0f} MiB on each engine of arm "
           "8-ours-host" if meta.get("host_arms") else "")
        + ("; the pressure arms (9-*, KV in blocks and bytes): " + ", ".join(
            f"{k} {v:,.{0 if isinstance(v, int) else 2}f}" for k, v in meta["pressure"].items())
           if meta.get("pressure") else ""),
        f"- cluster order: {', '.join(results.get('order', []))} (the co-located pair first: "
        "it serves the reference); the arms sharing a cluster in a shuffled order, reversed "
        f"every other round ({meta.get('rounds', 1)} round(s)), every cache reset before "
        f"each; an arm's run is cut after {meta.get('run_cap_s', '-')} s"
        + (f"; external engines for {', '.join(meta['external'])}" if meta.get("external")
           else ""),
        "- cores: " + (f"each arm's engines' model threads on cores "
                       f"{', '.join(meta['engine_cores'])} (VLLM_CPU_OMP_THREADS_BIND, in start "
                       "order), except the stock NIXL clusters' (stock, bidi): their NIXL "
                       "worker moves the model thread to the last core itself, so both of "
                       "their engines compute on that one core (stock vLLM on CPU; arm 5, "
                       "vllm-router on our engines, is the like-for-like P/D comparison)"
                       if meta.get("engine_cores") else "vLLM's own binding"),
        f"- our connector's prices: {json.dumps(meta.get('ours_cost'))}",
        f"- wall time {meta.get('wall_s', 0):.0f} s", ""]
    lines += [f"- **{name}**: {desc}" for name, desc in meta.get("workloads", {}).items()]
    lines += ["", "## Comparisons" if chat else "## Headlines", ""] + headlines(results)
    for wname, runs in results.get("runs", {}).items():
        lines += ["", f"## {wname}", ""]
        if wname in results.get("ceilings", {}):
            lines += ceiling_lines(results["ceilings"][wname]) + [""]
        lines += workload_table(runs)
        lines += [f"- {k}: {s['steps'] - s['ok']} steps not answered ({s['not_finished']} cut "
                  f"at the cap); first error: {s['first_error']}" for k, s in runs.items()
                  if s["ok"] < s["steps"]]
    if results.get("rounds"):
        lines += ["", "## Every round (--rounds)", ""] + rounds_lines(results)
    if results.get("probes"):
        lines += ["", "## KV bytes and computed tokens per step (probe sessions)", ""]
        lines += probe_lines(results["probes"])[0]
    lines += [
        "", "## How to read it", "",
        "- The client sends " + ("OpenAI chat messages in text to `/v1/chat/completions` "
                                 "(system prompt, tools in the request, answers kept as "
                                 "text, tool results as user text)" if chat else
                                 "token-id prompts to `/v1/completions`")
        + ", the session id in `X-Session-ID`, temperature 0. The co-located reference run "
        "fixes every answer; every arm then sends the prompts the reference's answers give.",
        "- computed tok: prompt tokens the engines computed, summed over both engines of the "
        "arm (`vllm:prompt_tokens_by_source_total{source=\"local_compute\"}` deltas); reuse x "
        "= prompt / computed; share of ceiling = (prompt - computed) / the ceiling's reusable "
        "tokens for the steps that succeeded. The ceiling counts whole blocks; a D->P pull "
        "also brings D's partial last block, so ours can pass 100% by up to 31 tokens a step.",
        "- prompt-token sources: ours from `sessionkv_prompt_tokens_total{source}` (hit = P's "
        "own prefix cache, pulled = D->P, host = host tier, computed), stock from vLLM's "
        "`local_cache_hit` / `external_kv_transfer` / `local_compute`; D: tokens D computed.",
        "- TTFT / ITL from the streamed answers' chunks (n in brackets), e2e over every step. "
        "Arm 4's proxy asks D for a non-streamed answer, so its TTFT is the whole request.",
        "- mismatches: steps whose token ids (tok), only top-5 logprobs beyond 2e-3 (lp), or "
        "text differ from the co-located reference; in brackets the steps that edited the "
        "previous answer. Engines in float32 (`--dtype`): in bfloat16 on this CPU build "
        "answers move with batch composition. Arm 1 (plain co-located vLLM) is the noise "
        "floor; the probe sessions (one request at a time) are the strict check.",
        "- KV MB moved: `vllm:nixl_bytes_transferred_sum` deltas on both engines; requests per "
        "engine: `vllm:request_success_total` deltas (a P/D request counts on P and on D); "
        "refused claims / host restored / disk promoted blocks: deltas of `sessionkv_guard_"
        "claims_total{outcome=\"refused\"}` (claims on held blocks their holder refused), `"
        "sessionkv_host_restored_blocks_total`, `sessionkv_disk_promoted_blocks_total` (disk ->"
        " host reads, then restored from the host tier), both engines.",
        "- steps ok: a run is cut after the cap; unfinished steps count as not ok."]
    lines += [f"- `{key}`: `{cmd}`" for key, cmd in sorted(results.get("commands", {}).items())]
    return "\n".join(lines + [f"- FAILED: {f}" for f in results.get("failures", [])])


def plot(json_path: str, out_dir: str, stem: str) -> None:
    """``stem``_ttft.png and _reuse.png per workload; with probes, _computed_per_step.png
    and _bytes_per_step.png against the session's steps and length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    runs, probes = data.get("runs", {}), data.get("probes", {})

    def figure(name: str, panels: dict, draw) -> None:
        if not panels:
            return
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
        for ax, (wname, per_arm) in zip(axes[0], panels.items()):
            draw(ax, wname, per_arm)
            ax.legend(fontsize=7) if ax.get_legend_handles_labels()[0] else None
        fig.tight_layout()
        fig.savefig(Path(out_dir) / f"{stem}_{name}.png", dpi=100)
        plt.close(fig)

    def bars(keys_of, value, ylabel, log=False):
        def draw(ax, wname, per_arm):
            keys = sorted(per_arm)
            for j, (k, lab) in enumerate(keys_of):
                ax.bar([i + 0.8 / len(keys_of) * j for i in range(len(keys))],
                       [value(per_arm[a], k) or 0 for a in keys], width=0.8 / len(keys_of),
                       label=lab)
            ax.set_xticks([i + 0.4 - 0.4 / len(keys_of) for i in range(len(keys))], keys,
                          rotation=45, fontsize=7, ha="right")
            ax.set_ylabel(ylabel)
            ax.set_yscale("log" if log else "linear")
            ax.set_title(wname)
        return draw

    def lines(x, y, xlabel, ylabel):
        def draw(ax, wname, per_arm):
            for i, (key, steps) in enumerate(sorted(per_arm.items())):
                ax.plot([x(s) for s in steps], [y(s) for s in steps], marker="os^vD<>px"[i % 9],
                        linestyle=("-", "--", ":", "-.")[i % 4], label=key)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_title(wname)
        return draw

    figure("ttft", runs, bars((("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")),
                              lambda s, k: s[k], "TTFT (s, log scale)", log=True))
    figure("reuse", runs, bars((("share_of_max", "share"),), lambda s, k: 100 * (s[k] or 0),
                               "% of the ceiling reused"))
    figure("tiers", {w: r for w, r in runs.items() if w == "chat_pressure"}, bars([(k, k.replace(
        "_", " ")) for k in ("refused_claims", "host_restored_blocks", "disk_promoted_blocks")],
        lambda s, k: s["tiers"][k], "count over the run"))
    figure("computed_per_step", probes, lines(lambda s: s["step"], lambda s: s["computed"],
                                              "step of the session", "prompt tokens computed"))
    figure("bytes_per_step", probes, lines(lambda s: s["session_tokens"],
                                           lambda s: s["bytes"] / 1e3,
                                           "session length (prompt tokens)",
                                           "KV moved in the step (KB)"))
