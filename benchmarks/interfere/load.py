"""The load of one step: victims and injector against one arm, for ``duration_s``.

* Victims: ``victims`` streams, each sending short prompts one after the other
  (streamed, ``ignore_eos``); each request's chunk arrival times are kept.
* Injector: long prompts replayed from an arrival file (JSONL, one request a line:
  ``{"t_s": 0.0, "prompt": [ids] | "text", "max_tokens": 8}``).  A step at rate
  ``r`` replays the file's requests in order with their times scaled by
  ``file_rate / r``; the steps take consecutive slices of the file (ascending
  rates), so every arm sees the same prompts at the same times at each rate, no step
  repeats an earlier step's prompt, and an operator can replay traffic of their own.

Prompts are token ids, so no arm tokenizes and the prefix cache sees the same blocks.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from sessionkv_bench.client import sse_chunks

# Token ids drawn for synthetic prompts: above the tiny tokenizer's specials and
# inside any real vocabulary.
TOKEN_LO, TOKEN_HI = 16, 1000


class Arrival(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    t_s: float
    prompt: list[int] | str
    max_tokens: int = 8


def write_arrivals(path: Path, n: int, rate_per_s: float, prompt_tokens: int,
                   max_tokens: int, seed: int = 0) -> Path:
    """``n`` distinct prompts of ``prompt_tokens`` random ids at a constant rate."""
    rng = random.Random(seed)
    lines = [msgspec.json.encode(Arrival(
        round(i / rate_per_s, 6), [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(prompt_tokens)],
        max_tokens)).decode() for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_arrivals(path: Path) -> list[Arrival]:
    """The file's requests in time order; a bad line is refused naming its number."""
    out = []
    for no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(msgspec.json.decode(line, type=Arrival))
        except msgspec.ValidationError as exc:
            raise ValueError(f"{path}:{no}: {exc}") from None
    if len(out) < 2:
        raise ValueError(f"{path}: at least two arrivals are needed to know its rate")
    return sorted(out, key=lambda a: a.t_s)


def file_rate(arrivals: list[Arrival]) -> float:
    """The file's mean arrival rate, requests per second."""
    span = arrivals[-1].t_s - arrivals[0].t_s
    if span <= 0:
        raise ValueError("arrival file: every request at the same time has no rate")
    return (len(arrivals) - 1) / span


def schedule(arrivals: list[Arrival], rate_per_s: float, duration_s: float,
             start: int = 0) -> list[tuple[float, Arrival]]:
    """(send time from the step's start, request) at ``rate_per_s``, within
    ``duration_s``, from the file's request ``start`` on; rate 0 sends nothing."""
    if rate_per_s <= 0:
        return []
    scale = file_rate(arrivals) / rate_per_s
    rest = arrivals[start:]
    if not rest:
        raise ValueError(f"the arrival file has no request left after {start}: give a "
                         "longer file")
    t0 = rest[0].t_s
    out = [((a.t_s - t0) * scale, a) for a in rest]
    kept = [x for x in out if x[0] < duration_s]
    if len(kept) == len(out) and out[-1][0] + 1 / rate_per_s < duration_s:
        raise ValueError(f"the arrival file runs out at {out[-1][0]:.1f} s of a "
                         f"{duration_s:.0f} s step at {rate_per_s} req/s (from request "
                         f"{start}): give a longer file")
    return kept


def step_starts(arrivals: list[Arrival], rates: list[float], duration_s: float
                ) -> dict[float, int]:
    """Where each rate's step starts in the file: the steps take consecutive slices,
    so no step repeats a prompt an earlier step sent (a router that remembers where it
    sent a prompt would otherwise carry it from one step into the next)."""
    out, start = {}, 0
    for rate in sorted(rates):
        out[rate] = start
        start += len(schedule(arrivals, rate, duration_s, start))
    return out


def victim_prompt(seed: int, victim: int, index: int, tokens: int) -> list[int]:
    rng = random.Random(f"{seed}-{victim}-{index}")
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(tokens)]


@dataclass
class Stream:
    """One streamed request; times in seconds from the step's start."""

    kind: str                    # victim | injected
    prompt_tokens: int
    sent_s: float
    chunk_s: list[float] = field(default_factory=list)   # chunks carrying tokens
    route: str | None = None     # our proxy's x-sessionkv-route
    reason: str | None = None    # and its x-sessionkv-route-reason
    error: str | None = None
    unfinished: bool = False     # an injection with no first token by the drain's end

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else None

    def gaps(self, start_s: float, end_s: float) -> list[float]:
        """Gaps between consecutive chunks, both inside [start_s, end_s]."""
        c = self.chunk_s
        return [b - a for a, b in zip(c, c[1:]) if a >= start_s and b <= end_s]


async def _stream(http, url: str, body: dict, s: Stream, t0: float) -> None:
    import aiohttp

    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            s.route = resp.headers.get("x-sessionkv-route")
            s.reason = resp.headers.get("x-sessionkv-route-reason")
            if resp.status != 200:
                s.error = f"{resp.status}: {(await resp.text())[:300]}"
                return
            async for chunk in sse_chunks(resp):
                if any(c.get("token_ids") for c in chunk.get("choices") or []):
                    s.chunk_s.append(time.perf_counter() - t0)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        s.error = repr(exc)[:300]


def _body(model: str, prompt, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}


async def run_step(url: str, model: str, injections: list[tuple[float, Arrival]], *,
                   victims: int, victim_prompt_tokens: int, victim_max_tokens: int,
                   duration_s: float, drain_s: float, seed: int = 0) -> list[Stream]:
    """Victims from 0 to ``duration_s`` (then cancelled: what they streamed is kept),
    the injections at their times; injections still running ``drain_s`` after
    ``duration_s`` are cancelled; those with no first token are ``unfinished``."""
    import aiohttp

    streams: list[Stream] = []
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    async def victim(v: int) -> None:
        i = 0
        while now() < duration_s:
            s = Stream("victim", victim_prompt_tokens, now())
            streams.append(s)
            await _stream(http, url, _body(model, victim_prompt(seed, v, i,
                                                                victim_prompt_tokens),
                                           victim_max_tokens), s, t0)
            i += 1
            if s.error:
                await asyncio.sleep(0.1)   # a failing arm: do not spin

    async def inject(at_s: float, a: Arrival) -> None:
        await asyncio.sleep(max(0.0, at_s - now()))
        n = len(a.prompt) if isinstance(a.prompt, list) else -1
        s = Stream("injected", n, now())
        streams.append(s)
        await _stream(http, url, _body(model, a.prompt, a.max_tokens), s, t0)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=duration_s + drain_s + 60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        vic = [asyncio.create_task(victim(v)) for v in range(victims)]
        inj = [asyncio.create_task(inject(t, a)) for t, a in injections]
        await asyncio.sleep(max(0.0, duration_s - now()))
        for task in vic:
            task.cancel()
        if inj:
            await asyncio.wait(inj, timeout=max(0.1, duration_s + drain_s - now()))
        for task in inj:
            task.cancel()
        await asyncio.gather(*vic, *inj, return_exceptions=True)
    for s in streams:
        if s.kind == "injected" and s.error is None and not s.chunk_s:
            s.unfinished = True
    return streams
