"""The streaming client: runs a workload's sessions against one arm.

Every step is a ``/v1/completions`` request with token ids, temperature 0,
``ignore_eos``, ``logprobs=5`` and ``return_token_ids``, streamed; TTFT and the gaps
between chunks are taken from the stream.  Sessions run concurrently (at most
``max_concurrency`` requests in flight), each waiting for its previous step (and a
sub-agent for its parent's spawn step), its start offset and its tool delays.

In the reference run the history is built from the answers themselves; in an arm
from the reference's answers, so every arm sends the same prompts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
    text: str = ""                     # chat mode: the answer's text
    prompt_token_ids: list[int] | None = None   # chat mode: the prompt the engine rendered


def _sorted_top(entry) -> list[float]:
    if isinstance(entry, dict):
        return sorted(entry.values(), reverse=True)
    return sorted((e["logprob"] for e in entry), reverse=True)


async def _send(session, url: str, body: dict, headers: dict, res: StepResult,
                started: float) -> None:
    import aiohttp

    try:
        async with session.post(url, json=body, headers=headers) as resp:
            res.headers = {h: resp.headers[h] for h in ROUTE_HEADERS if h in resp.headers}
            if resp.status != 200:
                res.error = f"{resp.status}: {(await resp.text())[:300]}"
                return
            last = None
            async for chunk in sse_chunks(resp):
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = int(details["cached_tokens"])
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if not ids:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - started
                    else:
                        res.itl_s += [(now - last) / len(ids)] * len(ids)
                    last = now
                    res.token_ids += ids
                    lp = choice.get("logprobs") or {}
                    res.top_logprobs += [_sorted_top(t) for t in lp.get("top_logprobs") or []]
            res.e2e_s = time.perf_counter() - started
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        res.error = repr(exc)[:300]


async def run_workload(workload: Workload, target: Callable[[str], str], model: str, *,
                       reference: dict[OutputKey, list[int]] | None = None,
                       max_concurrency: int = 64, timeout_s: float = 900.0,
                       session_header: str = SESSION_HEADER,
                       on_step: Callable[[StepResult], None] | None = None,
                       cap_s: float | None = None
                       ) -> dict[OutputKey, StepResult]:
    """Run every session; ``target(session id)`` is the base URL its requests go to.
    Without ``reference`` the answers build the history (the reference run).  After
    ``cap_s`` seconds the requests still running are cancelled and the steps not
    finished are returned as errors (``NOT_FINISHED``)."""
    outputs: dict[OutputKey, list[int]] = {}
    done = {key: asyncio.Event() for key in workload.keys()}
    results: dict[OutputKey, StepResult] = {}
    sem = asyncio.Semaphore(max_concurrency)
    t0 = time.perf_counter()

    async def run_session(http, sid: str) -> None:
        s = workload.session(sid)
        try:
            for k, step in enumerate(s.steps):
                if not await wait_for_turn(workload, done, outputs, sid, k, t0):
                    return
                prompt = workload.prompt(sid, k, outputs)
                body = {"model": model, "prompt": prompt, "max_tokens": step.max_tokens,
                        "temperature": 0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}, "logprobs": 5,
                        "return_token_ids": True}
                async with sem:
                    started = time.perf_counter()
                    res = StepResult((sid, k), len(prompt), started - t0)
                    await _send(http, target(sid) + "/v1/completions", body,
                                {session_header: sid}, res, started)
                results[(sid, k)] = res
                if on_step is not None:
                    on_step(res)
                if reference is not None:
                    outputs[(sid, k)] = reference[(sid, k)]
                elif res.error is None and len(res.token_ids) == step.max_tokens:
                    outputs[(sid, k)] = res.token_ids
                else:
                    return
                done[(sid, k)].set()
        finally:
            for k in range(len(s.steps)):
                done[(sid, k)].set()

    await run_sessions(workload, run_session, results, timeout_s=timeout_s, cap_s=cap_s)
    return results


async def wait_for_turn(workload, done: dict[OutputKey, asyncio.Event], answered: dict,
                        sid: str, k: int, t0: float) -> bool:
    """Wait until turn ``k`` of session ``sid`` may be sent (both clients): the turns it
    builds on answered, the session's start offset for its first turn, the turn's tool
    delay.  False when a turn it builds on failed: its history cannot be built."""
    for dep in workload.dependencies(sid, k):
        await done[dep].wait()
        if dep not in answered:
            return False
    s = workload.session(sid)
    if k == 0:
        wait = s.start_s - (time.perf_counter() - t0)
        if wait > 0:
            await asyncio.sleep(wait)
    if s.steps[k].delay_s:
        await asyncio.sleep(s.steps[k].delay_s)
    return True


async def run_sessions(workload, run_session: Callable, results: dict[OutputKey, StepResult],
                       *, timeout_s: float, cap_s: float | None) -> None:
    """Every session's ``run_session(http, sid)`` at once over one HTTP session (both
    clients, token ids and chat); after ``cap_s`` seconds the requests still running
    are cancelled and each step not in ``results`` is recorded as ``NOT_FINISHED``."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        try:
            await asyncio.wait_for(
                asyncio.gather(*(run_session(http, s.sid) for s in workload.sessions)),
                timeout=cap_s)
        except asyncio.TimeoutError:
            for key in workload.keys():
                if key not in results:
                    results[key] = StepResult(key, 0, cap_s or 0.0, error=NOT_FINISHED)


def run(workload: Workload, target: Callable[[str], str], model: str, **kw
        ) -> dict[OutputKey, StepResult]:
    return asyncio.run(run_workload(workload, target, model, **kw))
