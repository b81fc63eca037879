"""One arm's run of one workload, turned into the numbers the report shows."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from sessionkv_bench.stats import pct

from sessionkv_bench.arms import engine_counters
from sessionkv_bench.client import accounting
from sessionkv_bench.metrics import delta, scrape
from agentload.client import StepResult
from agentload.workload import Ceiling, OutputKey, Workload

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers import Generation, compare  # noqa: E402  (the e2e tests' comparison)

LOCAL_COMPUTE = "vllm:prompt_tokens_by_source_total{local_compute}"
LOCAL_HIT = "vllm:prompt_tokens_by_source_total{local_cache_hit}"
EXTERNAL = "vllm:prompt_tokens_by_source_total{external_kv_transfer}"
OURS = "sessionkv_prompt_tokens_total"
OUR_SOURCES = ("local_hit", "pulled_from_peer", "pulled_from_host", "recomputed",
               "refused_by_verification")
BYTES = "vllm:nixl_bytes_transferred_sum"
REQUESTS = "vllm:request_success_total"


def mismatches(workload: Workload, results: dict[OutputKey, StepResult],
               reference: dict[OutputKey, StepResult]) -> dict:
    """Steps whose token ids, or only top-5 logprobs, differ from the reference."""
    out = {"compared": 0, "token": 0, "logprob_only": 0, "stripped_compared": 0,
           "stripped_token": 0, "stripped_logprob_only": 0, "max_logprob_diff": 0.0,
           "examples": []}
    for key, res in results.items():
        ref = reference.get(key)
        if res.error or ref is None or ref.error:
            continue
        sid, k = key
        stripped = workload.session(sid).steps[k].strip_reasoning
        cmp = compare(Generation(res.token_ids, res.top_logprobs, ""),
                      Generation(ref.token_ids, ref.top_logprobs, ""))
        out["compared"] += 1
        out["stripped_compared"] += stripped
        if cmp.max_logprob_diff != float("inf"):
            out["max_logprob_diff"] = max(out["max_logprob_diff"], cmp.max_logprob_diff)
        if cmp.token_mismatches:
            out["token"] += 1
            out["stripped_token"] += stripped
        elif not cmp.equal:
            out["logprob_only"] += 1
            out["stripped_logprob_only"] += stripped
        if not cmp.equal and len(out["examples"]) < 5:
            out["examples"].append(f"{sid}/{k}{' (stripped)' if stripped else ''}: {cmp}")
    return out


def client_computed(res: StepResult, role_of_cached: str) -> int | None:
    """Prompt tokens the prefilling engine computed for this step, where the answer
    says: our proxy's ``x-sessionkv-prefill`` header (P's accounting; a decode-only
    step computes on D what D lacked), else the co-located engine's usage details."""
    head = res.headers.get("x-sessionkv-prefill")
    if head:
        acc = accounting(head)
        return None if "unparsed" in acc else int(acc.get("recomputed_tokens", 0))
    if role_of_cached == "coloc" and res.cached_tokens is not None:
        return res.prompt_tokens - res.cached_tokens
    return None


def summarize(workload: Workload, results: dict[OutputKey, StepResult],
              reference: dict[OutputKey, StepResult] | None, ceil: Ceiling,
              before: list[dict], after: list[dict], engines: list[tuple[str, str]],
              wall_s: float) -> dict:
    ok = {k: r for k, r in results.items() if r.error is None}
    d = [delta(a, b) for a, b in zip(after, before)]
    computed = sum(x.get(LOCAL_COMPUTE, 0.0) for x in d)
    prompt = sum(r.prompt_tokens for r in ok.values())
    reusable = sum(ceil.per_request[k][1] for k in ok if k in ceil.per_request)
    ttft = [r.ttft_s for r in ok.values() if r.ttft_s is not None]
    itl = [x for r in ok.values() for x in r.itl_s]
    by_role = {}
    for (role, url), x in zip(engines, d):
        entry = {"url": url, "requests": x.get(REQUESTS, 0.0),
                 "computed": x.get(LOCAL_COMPUTE, 0.0), "local_hit": x.get(LOCAL_HIT, 0.0),
                 "external": x.get(EXTERNAL, 0.0), "bytes": x.get(BYTES, 0.0)}
        ours = {s: x.get(f"{OURS}{{{s}}}", 0.0) for s in OUR_SOURCES}
        if any(ours.values()):
            entry["sessionkv"] = ours
        by_role[f"{role}{len([r for r in by_role if r.startswith(role)])}"] = entry
    per_step_client: dict[int, list[int]] = {}
    for (sid, k), r in ok.items():
        role = engines[0][0]
        c = client_computed(r, role)
        if c is not None:
            per_step_client.setdefault(k, []).append(c)
    return {
        "steps": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results.values() if r.error), None),
        "prompt_tokens": prompt, "computed_tokens": computed,
        "computed_per_step": computed / len(ok) if ok else None,
        "reuse_factor": prompt / computed if computed else None,
        "reusable_tokens": reusable,
        "max_reuse_factor": prompt / (prompt - reusable) if prompt > reusable else None,
        "share_of_max": (prompt - computed) / reusable if reusable else None,
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
        "ttft_mean_s": statistics.mean(ttft) if ttft else None,
        "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
        "wall_s": wall_s, "offered_rps": len(ok) / wall_s if wall_s else None,
        "prompt_tokens_per_s": prompt / wall_s if wall_s else None,
        "bytes": sum(x.get(BYTES, 0.0) for x in d),
        "bytes_per_step": sum(x.get(BYTES, 0.0) for x in d) / len(ok) if ok else None,
        "engines": by_role,
        "requests_per_engine": [e["requests"] for e in by_role.values()],
        "mismatches": mismatches(workload, results, reference) if reference else None,
        "client_computed_by_step": {str(k): statistics.mean(v)
                                    for k, v in sorted(per_step_client.items())},
    }


def run_probe(workload: Workload, url: str, model: str, run, reference_outputs: dict,
              reference: dict[OutputKey, StepResult] | None, settle_s: float = 0.6) -> list:
    """One session, step after step, alone: the engines' counters around every step
    give its KV bytes moved and its computed prompt tokens against its length."""
    import requests

    sid = workload.sessions[0].sid
    out = []
    for k, step in enumerate(workload.sessions[0].steps):
        prompt = workload.prompt(sid, k, reference_outputs)
        before = engine_counters(run)
        body = {"model": model, "prompt": prompt, "max_tokens": step.max_tokens,
                "temperature": 0, "ignore_eos": True, "logprobs": 5,
                "return_token_ids": True}
        resp = requests.post(url + "/v1/completions", json=body,
                             headers={"X-Session-ID": sid}, timeout=600)
        time.sleep(settle_s)
        after = engine_counters(run)
        d = [delta(a, b) for a, b in zip(after, before)]
        entry = {"step": k, "session_tokens": len(prompt),
                 "bytes": sum(x.get(BYTES, 0.0) for x in d),
                 "computed": sum(x.get(LOCAL_COMPUTE, 0.0) for x in d),
                 "status": resp.status_code, "equal": None}
        if resp.status_code == 200 and reference:
            choice = resp.json()["choices"][0]
            tops = [sorted(t.values(), reverse=True)
                    for t in (choice.get("logprobs") or {}).get("top_logprobs") or []]
            ref = reference[(sid, k)]
            entry["equal"] = compare(Generation(choice.get("token_ids") or [], tops, ""),
                                     Generation(ref.token_ids, ref.top_logprobs, "")).equal
        out.append(entry)
    return out


def scrape_all(urls: list[str]) -> list[dict]:
    return [scrape(u) for u in urls]
