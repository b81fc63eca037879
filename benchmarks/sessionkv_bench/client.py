"""The benchmarks' HTTP client side: the one SSE parser, the accounting header, prompts of
token ids.  Standard library only: the side venv's python imports the benchmarks (for
their figures)."""

from __future__ import annotations

import json


def accounting(value: str | dict | None) -> dict:
    """Our proxy's accounting header (``x-sessionkv-prefill`` / ``-decode``: JSON) as a
    dict: {} when absent, ``{"unparsed": value}`` when it is not JSON; a dict as is."""
    if isinstance(value, dict) or not value:
        return value or {}
    try:
        return json.loads(value)
    except ValueError:
        return {"unparsed": value}


async def sse_chunks(resp):
    """The JSON chunks of an OpenAI streamed answer (an aiohttp response), in order."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        yield json.loads(line[5:])


def completion_bodies(model: str, n: int, prompt_len: int, max_tokens: int, seed: int
                      ) -> list[dict]:
    """``n`` distinct streamed completions of token-id prompts (no prefix shared)."""
    bodies = []
    for i in range(n):
        ids = [(seed * 7919 + i * 131 + j * 17) % 900 + 20 for j in range(prompt_len)]
        bodies.append({"model": model, "prompt": ids, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True})
    return bodies
