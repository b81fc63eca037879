"""The client: runs a workload's sessions against one arm, token ids or chat text.

Each step is the request its workload builds (``Workload.request``: a streamed
``/v1/completions`` of token ids; ``ChatWorkload.request``: a chat turn in text,
streamed or not), with the session id in ``X-Session-ID``.  Answers are read with the
benchmarks' one SSE parser (``sessionkv_bench.client.sse_chunks``); TTFT and the gaps
between chunks come from streamed answers, a non-streamed one has only its end-to-end
time.  Sessions run concurrently (at most ``max_concurrency`` requests in flight), each
waiting for its previous step (a sub-agent for its parent's spawn step), its start
offset and its tool delays.  In the reference run the answers build the history; in
an arm the reference's do, so every arm sends the same prompts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from agentload.workload import OutputKey, Workload
from sessionkv_bench.client import sse_chunks

SESSION_HEADER = "X-Session-ID"
NOT_FINISHED = "not finished within the run's time cap"
ROUTE_HEADERS = ("x-sessionkv-route", "x-sessionkv-route-reason", "x-sessionkv-prefill",
                 "x-sessionkv-handle", "x-sessionkv-prefill-ms",
                 "x-sessionkv-prefill-engine", "x-sessionkv-decode-engine")


@dataclass
class StepResult:
    key: OutputKey
    prompt_tokens: int
    sent_s: float                      # from the run's start
    token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    cached_tokens: int | None = None   # usage.prompt_tokens_details, where the engine tells
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    text: str = ""                     # the answer's text (chat)
    prompt_token_ids: list[int] | None = None   # the prompt sent, or the engine rendered


def _tops(logprobs: dict | None) -> list[list[float]]:
    """Top logprobs per generated token, highest first: completions give a dict per
    token, chat a ``content`` list of entries."""
    lp = logprobs or {}
    if "content" in lp:
        return [sorted((e["logprob"] for e in c.get("top_logprobs") or []), reverse=True)
                for c in lp["content"] or []]
    return [sorted(t.values(), reverse=True) if isinstance(t, dict)
            else sorted((e["logprob"] for e in t), reverse=True)
            for t in lp.get("top_logprobs") or []]


def _take(res: StepResult, obj: dict, started: float, last: list) -> None:
    """One answer (non-streamed) or one chunk of a streamed one into ``res``."""
    if obj.get("prompt_token_ids") is not None:
        res.prompt_token_ids = obj["prompt_token_ids"]
    details = (obj.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        res.cached_tokens = int(details["cached_tokens"])
    for choice in obj.get("choices") or []:
        res.text += ((choice.get("delta") or choice.get("message") or {}).get("content")
                     or choice.get("text") or "")
        ids = choice.get("token_ids") or []
        if not ids:
            continue
        now = time.perf_counter()
        if not last:
            res.ttft_s = now - started
        else:
            res.itl_s += [(now - last[0]) / len(ids)] * len(ids)
        last[:] = [now]
        res.token_ids += ids
        res.top_logprobs += _tops(choice.get("logprobs"))


async def send(http, url: str, body: dict, sid: str, res: StepResult) -> None:
    """One request; its answer, headers and timings into ``res`` (``error`` when it
    failed)."""
    started, last = time.perf_counter(), []
    try:
        async with http.post(url, json=body, headers={SESSION_HEADER: sid}) as resp:
            res.headers = {h: resp.headers[h] for h in ROUTE_HEADERS if h in resp.headers}
            if resp.status != 200:
                res.error = f"{resp.status}: {(await resp.text())[:300]}"
                return
            if body.get("stream"):
                async for chunk in sse_chunks(resp):
                    _take(res, chunk, started, last)
            else:
                _take(res, await resp.json(), started, last)
                res.ttft_s = None   # a non-streamed answer has no first token
                res.itl_s = []
            res.e2e_s = time.perf_counter() - started
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError) as exc:
        res.error = repr(exc)[:300]


async def run_workload(workload: Workload, target: Callable[[str], str], model: str, *,
                       reference: dict[OutputKey, StepResult] | None = None,
                       max_concurrency: int = 64, timeout_s: float = 900.0,
                       cap_s: float | None = None) -> dict[OutputKey, StepResult]:
    """Run every session; ``target(session id)`` is the base URL its requests go to.
    Without ``reference`` the answers build the history (the reference run); with it
    the reference's do, and a step's prompt is the reference's.  After ``cap_s``
    seconds the requests still running are cancelled and the steps not finished are
    returned as errors (``NOT_FINISHED``)."""
    answers: dict[OutputKey, object] = {}
    done = {key: asyncio.Event() for key in workload.keys()}
    results: dict[OutputKey, StepResult] = {}
    sem = asyncio.Semaphore(max_concurrency)
    t0 = time.perf_counter()

    async def run_session(http, sid: str) -> None:
        s = workload.session(sid)
        try:
            for k, step in enumerate(s.steps):
                for dep in workload.dependencies(sid, k):
                    await done[dep].wait()
                    if dep not in answers:
                        return   # a step it builds on failed: its history cannot be built
                wait = (s.start_s - (time.perf_counter() - t0) if k == 0 else 0) + step.delay_s
                if wait > 0:
                    await asyncio.sleep(wait)
                path, body = workload.request(sid, k, answers, model)
                async with sem:
                    res = StepResult((sid, k), 0, time.perf_counter() - t0,
                                     prompt_token_ids=body.get("prompt"))
                    await send(http, target(sid) + path, body, sid, res)
                ref = reference[(sid, k)] if reference is not None else None
                res.prompt_tokens = len((ref or res).prompt_token_ids or [])
                results[(sid, k)] = res
                # An arm goes on with the reference's answer whatever its own was.
                answer = workload.answer(sid, k, ref) if ref is not None else (
                    workload.answer(sid, k, res) if res.error is None else None)
                if answer is None:
                    res.error = res.error or "incomplete answer (ids, or the rendered prompt)"
                    return
                answers[(sid, k)] = answer
                done[(sid, k)].set()
        finally:
            for k in range(len(s.steps)):
                done[(sid, k)].set()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        try:
            await asyncio.wait_for(
                asyncio.gather(*(run_session(http, s.sid) for s in workload.sessions)),
                timeout=cap_s)
        except asyncio.TimeoutError:
            for key in workload.keys():
                if key not in results:
                    results[key] = StepResult(key, 0, cap_s or 0.0, error=NOT_FINISHED)
    return results


def run(workload: Workload, target: Callable[[str], str], model: str, **kw
        ) -> dict[OutputKey, StepResult]:
    return asyncio.run(run_workload(workload, target, model, **kw))


def run_one(url: str, path: str, body: dict, sid: str) -> StepResult:
    """One request alone (the probes)."""
    async def one() -> StepResult:
        res = StepResult((sid, 0), len(body.get("prompt") or []), 0.0,
                         prompt_token_ids=body.get("prompt"))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            await send(http, url + path, body, sid, res)
        return res

    return asyncio.run(one())
