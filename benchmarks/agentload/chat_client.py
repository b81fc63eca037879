"""The chat client: runs a chat workload's sessions against one arm, in text.

Every turn is a ``/v1/chat/completions`` request as agent clients send it: the
messages, the tools in the request (``tool_choice: none``: the model answers in
text), temperature 0, the session id in the ``X-Session-ID`` header and in
``prompt_cache_key``; streamed or not as the turn says.  It also asks for what the
comparison needs: ``logprobs`` with the top 5 and ``return_token_ids`` (the generated
ids, and the prompt the engine rendered).  TTFT and the gaps between chunks come from
streamed turns; a non-streamed turn has only its end-to-end time.

Sessions run concurrently as in the token-id client: each waits for its previous
turn (a sub-agent for its parent's spawn turn), its start offset and its tool delays.
In the reference run the answers build the history; in an arm the reference's do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from agentload.chat import ChatWorkload
from agentload.client import ROUTE_HEADERS, SESSION_HEADER, StepResult, run_sessions, \
    wait_for_turn
from agentload.workload import OutputKey
from sessionkv_bench.client import sse_chunks


def request_body(workload: ChatWorkload, model: str, messages: list[dict], max_tokens: int,
                 stream: bool, sid: str) -> dict:
    body = {"model": model, "messages": messages, "tools": workload.tools,
            "tool_choice": "none", "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": 5, "return_token_ids": True,
            "prompt_cache_key": sid, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _tops(logprobs: dict | None) -> list[list[float]]:
    return [sorted((e["logprob"] for e in c.get("top_logprobs") or []), reverse=True)
            for c in (logprobs or {}).get("content") or []]


def _usage(res: StepResult, usage: dict | None) -> None:
    details = (usage or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        res.cached_tokens = int(details["cached_tokens"])


async def _send(http, url: str, body: dict, headers: dict, res: StepResult,
                started: float) -> None:
    import aiohttp

    try:
        async with http.post(url, json=body, headers=headers) as resp:
            res.headers = {h: resp.headers[h] for h in ROUTE_HEADERS if h in resp.headers}
            if resp.status != 200:
                res.error = f"{resp.status}: {(await resp.text())[:300]}"
                return
            if not body["stream"]:
                out = await resp.json()
                choice = out["choices"][0]
                res.token_ids = list(choice.get("token_ids") or [])
                res.top_logprobs = _tops(choice.get("logprobs"))
                res.text = (choice.get("message") or {}).get("content") or ""
                res.prompt_token_ids = out.get("prompt_token_ids")
                _usage(res, out.get("usage"))
                res.e2e_s = time.perf_counter() - started
                return
            last = None
            text: list[str] = []
            async for chunk in sse_chunks(resp):
                if chunk.get("prompt_token_ids") is not None:
                    res.prompt_token_ids = chunk["prompt_token_ids"]
                _usage(res, chunk.get("usage"))
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    text.append((choice.get("delta") or {}).get("content") or "")
                    if not ids:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - started
                    else:
                        res.itl_s += [(now - last) / len(ids)] * len(ids)
                    last = now
                    res.token_ids += ids
                    res.top_logprobs += _tops(choice.get("logprobs"))
            res.text = "".join(text)
            res.e2e_s = time.perf_counter() - started
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError) as exc:
        res.error = repr(exc)[:300]


async def run_workload(workload: ChatWorkload, target: Callable[[str], str], model: str, *,
                       reference: dict[OutputKey, StepResult] | None = None,
                       max_concurrency: int = 64, timeout_s: float = 900.0,
                       cap_s: float | None = None) -> dict[OutputKey, StepResult]:
    """Run every session; ``target(session id)`` is the base URL its requests go to.
    Without ``reference`` the answers build the history (the reference run); with it,
    the reference's answers do and a step's prompt length is the reference's."""
    answers: dict[OutputKey, str] = {}
    done = {key: asyncio.Event() for key in workload.keys()}
    results: dict[OutputKey, StepResult] = {}
    sem = asyncio.Semaphore(max_concurrency)
    t0 = time.perf_counter()

    async def run_session(http, sid: str) -> None:
        s = workload.session(sid)
        try:
            for k, turn in enumerate(s.steps):
                if not await wait_for_turn(workload, done, answers, sid, k, t0):
                    return
                body = request_body(workload, model, workload.messages(sid, k, answers),
                                    turn.max_tokens, turn.stream, sid)
                async with sem:
                    started = time.perf_counter()
                    res = StepResult((sid, k), 0, started - t0)
                    await _send(http, target(sid) + "/v1/chat/completions", body,
                                {SESSION_HEADER: sid}, res, started)
                ref = reference[(sid, k)] if reference is not None else None
                res.prompt_tokens = (len(ref.prompt_token_ids) if ref is not None
                                     else len(res.prompt_token_ids or []))
                results[(sid, k)] = res
                if ref is not None:
                    answers[(sid, k)] = ref.text
                elif res.error is None and res.token_ids and res.prompt_token_ids:
                    answers[(sid, k)] = res.text
                else:
                    if res.error is None:
                        res.error = "no token ids or prompt token ids in the answer"
                    return
                done[(sid, k)].set()
        finally:
            for k in range(len(s.steps)):
                done[(sid, k)].set()

    await run_sessions(workload, run_session, results, timeout_s=timeout_s, cap_s=cap_s)
    return results


def run(workload: ChatWorkload, target: Callable[[str], str], model: str, **kw
        ) -> dict[OutputKey, StepResult]:
    return asyncio.run(run_workload(workload, target, model, **kw))
