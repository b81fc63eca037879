"""One arm's run of one workload, turned into the numbers the report shows; the probes."""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from agentload.client import NOT_FINISHED, StepResult, run_one
from agentload.workload import Ceiling, OutputKey, Workload
from sessionkv_bench.arms import engine_counters
from sessionkv_bench.metrics import counter_sum, delta
from sessionkv_bench.stats import pct

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers import Generation, compare  # noqa: E402  (the e2e tests' comparison)

LOCAL_COMPUTE = "vllm:prompt_tokens_by_source_total{source=local_compute}"
LOCAL_HIT = "vllm:prompt_tokens_by_source_total{source=local_cache_hit}"
EXTERNAL = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
OURS = "sessionkv_prompt_tokens_total"
OUR_SOURCES = ("local_hit", "pulled_from_peer", "pulled_from_host", "recomputed",
               "refused_by_verification")
BYTES = "vllm:nixl_bytes_transferred_sum"
REQUESTS = "vllm:request_success_total"
TIERS = {"refused_claims": "sessionkv_guard_claims_total{outcome=refused}",   # by the holder
         "host_restored_blocks": "sessionkv_host_restored_blocks_total",
         "disk_promoted_blocks": "sessionkv_disk_promoted_blocks_total"}


def equal(res: StepResult, ref: StepResult):
    """The e2e tests' comparison: token ids, and top-5 logprobs within 2e-3."""
    return compare(Generation(res.token_ids, res.top_logprobs, ""),
                   Generation(ref.token_ids, ref.top_logprobs, ""))


def mismatches(workload: Workload, results: dict[OutputKey, StepResult],
               reference: dict[OutputKey, StepResult]) -> dict:
    """Steps whose token ids, or only top-5 logprobs, differ from the reference; the
    steps that edited (stripped) the previous answer counted apart too."""
    out = {"compared": 0, "token": 0, "logprob_only": 0, "stripped_compared": 0,
           "stripped_token": 0, "stripped_logprob_only": 0, "max_logprob_diff": 0.0,
           "examples": []}
    for (sid, k), res in results.items():
        ref = reference.get((sid, k))
        if res.error or ref is None or ref.error:
            continue
        stripped = workload.session(sid).steps[k].strip_reasoning
        cmp = equal(res, ref)
        out["compared"] += 1
        out["stripped_compared"] += stripped
        if cmp.max_logprob_diff != float("inf"):
            out["max_logprob_diff"] = max(out["max_logprob_diff"], cmp.max_logprob_diff)
        kind = "token" if cmp.token_mismatches else None if cmp.equal else "logprob_only"
        if kind:
            out[kind] += 1
            out["stripped_" + kind] += stripped
            if len(out["examples"]) < 5:
                out["examples"].append(f"{sid}/{k}{' (stripped)' if stripped else ''}: {cmp}")
    return out


def summarize(workload: Workload, results: dict[OutputKey, StepResult],
              reference: dict[OutputKey, StepResult], ceil: Ceiling, before: list[dict],
              after: list[dict], engines: list[tuple[str, str]], wall_s: float) -> dict:
    ok = {k: r for k, r in results.items() if r.error is None}
    d = [delta(a, b) for a, b in zip(after, before)]
    computed = sum(x.get(LOCAL_COMPUTE, 0.0) for x in d)
    moved = sum(x.get(BYTES, 0.0) for x in d)
    prompt = sum(r.prompt_tokens for r in ok.values())
    reusable = sum(ceil.per_request[k][1] for k in ok if k in ceil.per_request)
    ttft = sorted(r.ttft_s for r in ok.values() if r.ttft_s is not None)
    e2e = sorted(r.e2e_s for r in ok.values() if r.e2e_s is not None)
    itl = [x for r in ok.values() for x in r.itl_s]
    by_role: dict[str, dict] = {}
    for (role, url), x in zip(engines, d):
        entry = {"url": url, "requests": counter_sum(x, REQUESTS),
                 "computed": x.get(LOCAL_COMPUTE, 0.0), "local_hit": x.get(LOCAL_HIT, 0.0),
                 "external": x.get(EXTERNAL, 0.0), "bytes": x.get(BYTES, 0.0),
                 **{k: x.get(name, 0.0) for k, name in TIERS.items()}}
        ours = {s: x.get(f"{OURS}{{source={s}}}", 0.0) for s in OUR_SOURCES}
        if any(ours.values()):
            entry["sessionkv"] = ours
        by_role[f"{role}{sum(r.startswith(role) for r in by_role)}"] = entry
    routes = Counter(r.headers["x-sessionkv-route"] for r in results.values()
                     if r.headers.get("x-sessionkv-route"))
    text = [k for k, r in ok.items() if r.text != reference[k].text]
    return {
        "steps": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results.values() if r.error), None),
        "not_finished": sum(r.error == NOT_FINISHED for r in results.values()),
        "prompt_tokens": prompt, "computed_tokens": computed,
        "computed_per_step": computed / len(ok) if ok else None,
        "reuse_factor": prompt / computed if computed else None, "reusable_tokens": reusable,
        "max_reuse_factor": prompt / (prompt - reusable) if prompt > reusable else None,
        "share_of_max": (prompt - computed) / reusable if reusable else None,
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
        "ttft_mean_s": statistics.mean(ttft) if ttft else None,
        "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
        "e2e_p50_s": pct(e2e, 0.5), "e2e_p99_s": pct(e2e, 0.99),
        # Every round keeps its samples, so --rounds can pool them (report.pooled).
        "ttft_samples_s": ttft, "e2e_samples_s": e2e, "wall_s": wall_s,
        "bytes": moved, "bytes_per_step": moved / len(ok) if ok else None,
        "engines": by_role, "requests_per_engine": [e["requests"] for e in by_role.values()],
        "tiers": {k: sum(e[k] for e in by_role.values()) for k in TIERS},
        "mismatches": mismatches(workload, results, reference), "text_mismatches": len(text),
        "text_mismatch_examples": [f"{sid}/{k}: {ok[(sid, k)].text[:80]!r} vs "
                                   f"{reference[(sid, k)].text[:80]!r}" for sid, k in text[:3]],
        "rendered_differently": sum(r.prompt_token_ids != reference[k].prompt_token_ids
                                    for k, r in ok.items() if r.prompt_token_ids is not None),
        "streamed_ok": sum(r.ttft_s is not None for r in ok.values()), "routes": dict(routes),
        "step_detail": {f"{sid}/{k}": {
            "prompt": r.prompt_tokens, "sent_s": round(r.sent_s, 3), "ttft_s": r.ttft_s,
            "e2e_s": r.e2e_s, "hot": workload.session(sid).hot,
            "route": r.headers.get("x-sessionkv-route"),
            "reason": r.headers.get("x-sessionkv-route-reason"),
            "handle": r.headers.get("x-sessionkv-handle"),
            "prefill": r.headers.get("x-sessionkv-prefill"),
            "prefill_ms": r.headers.get("x-sessionkv-prefill-ms"),
            "error": r.error} for (sid, k), r in results.items()},
    }


def run_probe(workload: Workload, url: str, model: str, run,
              reference: dict[OutputKey, StepResult], settle_s: float = 0.6) -> list:
    """One session, step after step, alone: the engines' counters around every step
    give its KV bytes moved and its computed prompt tokens against its length."""
    sid = workload.sessions[0].sid
    answers = {k: workload.answer(*k, r) for k, r in reference.items()}
    out = []
    for k in range(len(workload.sessions[0].steps)):
        path, body = workload.request(sid, k, answers, model)
        before = engine_counters(run)
        res = run_one(url, path, body, sid)
        time.sleep(settle_s)
        d = [delta(a, b) for a, b in zip(engine_counters(run), before)]
        out.append({"step": k, "session_tokens": len(body["prompt"]),
                    "bytes": sum(x.get(BYTES, 0.0) for x in d),
                    "computed": sum(x.get(LOCAL_COMPUTE, 0.0) for x in d),
                    "status": 200 if res.error is None else res.error[:3],
                    "equal": equal(res, reference[(sid, k)]).equal
                    if res.error is None else None})
    return out
