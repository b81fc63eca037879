"""The one way a request reaches an engine: send with retry, under a load guard,
then relay the engine's answer to the client.

:meth:`EngineSender.sending` tries the engine it is given and, when a connection
fails before any answer began, the next engine of the same pool (up to
``connect_retries`` more).  While a request is at an engine, :func:`load_guard`
counts it in that engine's in-flight load (the policy's load terms) and takes it
off however the request ends.  The engine that answered is returned with the
answer: a retry moves the request, and the caller learns where to, from the value.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec

from sessionkv_proxy import handoff
from sessionkv_proxy.route_types import Role
from sessionkv_proxy.engines import Engine, EnginePool
from sessionkv_proxy.errors import ApiError
from sessionkv_proxy.metrics import ProxyMetrics
from sessionkv_proxy.server import Request, Response
from sessionkv_proxy.upstream import UpstreamConnectError, UpstreamPool, UpstreamResponse

__all__ = ["Answer", "EngineSender", "EngineUnreachable", "Load", "PrefillUnreachable",
           "Sent", "load_guard"]

logger = logging.getLogger("sessionkv_proxy.relay")

_ENGINE_HEADER = {role: f"x-sessionkv-{role.value}-engine" for role in Role}
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive",
                          "date", "server", "content-encoding"})


class EngineUnreachable(Exception):
    """A connection-level failure: safe to retry on another worker."""


class PrefillUnreachable(Exception):
    """No P could be reached (each one tried failed to connect): the request goes to
    D alone, as co-located, which is always correct; only the P/D split is lost."""


@dataclass(frozen=True, slots=True)
class Load:
    """What a request adds to an engine's in-flight load while it runs (the policy's
    load terms): on D the KV it holds and the work it still has to do for it (its
    uncached prompt, its outputs), on P the prompt it prefills; on either, the prompt
    tokens the engine computes for it."""

    decode_tokens: int = 0
    prefill_tokens: int = 0
    decode_work_tokens: int = 0
    prefill_work_tokens: float = 0.0


@contextmanager
def load_guard(engine: Engine, load: Load) -> Iterator[None]:
    """Count the request in ``engine``'s load for the duration of the block."""
    engine.active_requests += 1
    engine.active_decode_tokens += load.decode_tokens
    engine.active_prefill_tokens += load.prefill_tokens
    engine.active_decode_work_tokens += load.decode_work_tokens
    engine.active_prefill_work_tokens += load.prefill_work_tokens
    try:
        yield
    finally:
        engine.active_requests -= 1
        engine.active_decode_tokens -= load.decode_tokens
        engine.active_prefill_tokens -= load.prefill_tokens
        engine.active_decode_work_tokens -= load.decode_work_tokens
        engine.active_prefill_work_tokens -= load.prefill_work_tokens


@dataclass(frozen=True, slots=True)
class Sent:
    """An engine's answer under way: status and headers in, the body not yet read."""

    engine: Engine
    response: UpstreamResponse


@dataclass(frozen=True, slots=True)
class Answer:
    """An engine's answer as relayed: the whole response (None when it was streamed
    to the client already), the engine's status, its kv_transfer_params
    (non-streaming answers only) and the engine that gave it."""

    response: Response | None
    status: int
    params: dict[str, Any] | None
    engine: Engine


class EngineSender:
    """Sends to the engines, with retry and load guard, and relays their answers."""

    def __init__(self, *, upstream: UpstreamPool, pool: EnginePool,
                 alternative: Callable[[Role, set[str]], Engine | None],
                 metrics: ProxyMetrics, connect_retries: int, request_timeout_s: float,
                 return_kv_transfer_params: bool) -> None:
        self._upstream = upstream
        self._pool = pool
        self._alternative = alternative
        self._metrics = metrics
        self._connect_retries = connect_retries
        self._request_timeout_s = request_timeout_s
        self._return_params = return_kv_transfer_params

    async def post(self, engine: Engine, path: str, payload: bytes, request_id: str
                   ) -> UpstreamResponse:
        """POST to one engine, no retry; the status and headers are in, the body is
        not yet read.  :class:`EngineUnreachable` when no answer began."""
        try:
            resp = await self._upstream.post(engine.url, path, payload,
                                             {"X-Request-Id": request_id})
        except UpstreamConnectError as exc:
            self._pool.mark_failure(engine)
            raise EngineUnreachable(f"{engine.url}: {exc}") from exc
        except asyncio.TimeoutError:
            self._metrics.errors.labels("upstream_timeout").inc()
            raise ApiError(504, f"engine {engine.url} did not answer within "
                           f"{self._request_timeout_s:g}s", type_="server_error") from None
        self._pool.mark_success(engine)
        return resp

    @asynccontextmanager
    async def sending(self, role: Role, engine: Engine, path: str, payload: bytes,
                      request_id: str, load: Load,
                      on_engine: Callable[[Engine], None] | None = None
                      ) -> AsyncIterator[Sent]:
        """Send to ``engine``, or to the next of its pool while connections fail; the
        answer's engine holds ``load`` until the block ends.  ``on_engine`` hears of
        each engine tried, before it is tried."""
        tried: set[str] = set()
        for attempt in range(self._connect_retries + 1):
            if on_engine is not None:
                on_engine(engine)
            tried.add(engine.url)
            with load_guard(engine, load):
                try:
                    response = await self.post(engine, path, payload, request_id)
                except EngineUnreachable as exc:
                    engine = self._next_after_connect_failure(role, engine, tried, attempt,
                                                              request_id, exc)
                    continue
                try:
                    yield Sent(engine, response)
                finally:
                    response.release()
                return

    def _next_after_connect_failure(self, role: Role, failed: Engine, tried: set[str],
                                    attempt: int, request_id: str, exc: BaseException
                                    ) -> Engine:
        """Count and log a connection failure; the next worker of ``role`` to try.
        When none is left or the retries are spent: for P,
        :class:`PrefillUnreachable` (D serves the request alone); for D, a 502."""
        logger.warning("%s connect failed request_id=%s engine=%s: %r", role.value,
                       request_id, failed.url, exc)
        self._metrics.errors.labels(f"{role.value}_connect").inc()
        nxt = self._alternative(role, tried)
        if nxt is None or attempt == self._connect_retries:
            if role is Role.PREFILL:
                raise PrefillUnreachable() from None
            raise ApiError(502, f"no {role.value} engine reachable") from None
        self._metrics.retries.labels(role.value).inc()
        return nxt

    async def answer(self, request: Request, role: Role, engine: Engine, path: str,
                     payload: bytes, request_id: str, load: Load,
                     extra_headers: dict[str, str], stream: bool,
                     relay_after: asyncio.Future | None = None,
                     on_engine: Callable[[Engine], None] | None = None) -> Answer:
        """Send the request to the engine that answers it (D, or P for a prefill-only
        request) and relay that answer, once ``relay_after`` (if given) is done.

        A stream starts earlier if its first chunk comes first: D holding an early-decode
        request answers only once it has P's parameters, which P's connector pushes to
        it before P's own answer reaches the proxy.  Waiting for P's answer there held
        every token D had streamed meanwhile and sent them at once (a short answer
        whole, with no gap between its tokens), and the first token no earlier than
        P's answer.  Such a stream goes without the headers that answer would add
        (``extra_headers`` as they stand when it starts)."""
        async with self.sending(role, engine, path, payload, request_id, load,
                                on_engine) as sent:
            first = None
            if relay_after is not None:
                if stream and sent.response.status == 200:
                    first = asyncio.ensure_future(sent.response.next_chunk())
                    await _first_done(first, relay_after)
                else:
                    # vLLM sends a stream's head at once: wait for the headers to come.
                    await relay_after
            headers = [(k, v) for k, v in sent.response.headers.items()
                       if k.lower() not in _HOP_HEADERS]
            headers += extra_headers.items()
            headers.append((_ENGINE_HEADER[role], sent.engine.url))
            if not stream or sent.response.status != 200:
                return await self._whole(sent, headers)
            await self._stream(request, role, sent, headers, request_id, first)
            return Answer(None, 200, None, sent.engine)

    async def _whole(self, sent: Sent, headers: list[tuple[str, str]]) -> Answer:
        status = sent.response.status
        data = await sent.response.read()
        params = None
        # Only D's own end-of-turn answer carries them; skip decoding the rest.
        if status == 200 and b'"kv_transfer_params"' in data:
            try:
                out, params = handoff.decode_answer(data)
            except msgspec.DecodeError:
                out, params = None, None
            acct = handoff.accounting_header(params)
            if acct:
                headers.append(("x-sessionkv-decode", acct))
            if params and not self._return_params:
                data = handoff.strip_answer(out)
        return Answer(Response(status, data, headers, content_type=None), status, params,
                      sent.engine)

    async def _stream(self, request: Request, role: Role, sent: Sent,
                      headers: list[tuple[str, str]], request_id: str,
                      first: asyncio.Future | None = None) -> None:
        """Relay the answer's chunks; ``first``, when given, is the read of its first
        chunk, already under way.  One loop over the reads (no iterator between):
        a stream pays it per token."""
        await request.start_stream(200, headers)
        engine = sent.engine
        response = sent.response
        try:
            chunk = await (first if first is not None else response.next_chunk())
            while chunk:
                engine.alive(time.monotonic())
                if chunk.endswith(b"data: [DONE]\n\n"):
                    request.stream_done = True   # the client may close once it has it
                await request.write(chunk)
                chunk = await response.next_chunk()
        except (ConnectionResetError, asyncio.TimeoutError) as exc:
            # Either side may end it; only the engine's side is an error of ours.  The
            # server cuts the client's connection so a broken stream never looks whole.
            if not request.client_gone:
                self._metrics.errors.labels(f"{role.value}_stream_broken").inc()
                logger.warning("%s stream broke request_id=%s engine=%s: %r", role.value,
                               request_id, engine.url, exc)
            raise ConnectionResetError("stream ended early") from exc
        await request.end_stream()   # before the session is stored: the client is done
        request.stream_done = True


async def _first_done(first: asyncio.Future, other: asyncio.Future) -> None:
    """Wait until ``first`` or ``other`` is done; if cancelled meanwhile, ``first``
    (a read of the engine's stream) is cancelled too."""
    try:
        await asyncio.wait((first, other), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        first.cancel()
        raise
