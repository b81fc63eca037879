"""The HTTP layer: an OpenAI-compatible front for disaggregated vLLM pools.

A request goes either P then D (P prefills with ``max_tokens=1`` and hands its KV to
D over NIXL; D decodes and streams), or straight to D when the policy finds the
uncached part small, or only to P when there is nothing to decode (at most one new
token).  Streams are passed through byte for byte.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_sessionkv.wire.early_decode import EarlyDecodeSender, new_early_decode_id
from vllm_sessionkv.wire.protocol import (
    EarlyDecodePush,
    PayloadError,
    SessionPayload,
    handle_expired,
    handle_from_params,
    payload_from_params,
    with_payload,
)
from vllm_sessionkv.wire.redis_keys import RedisKeys

from sessionkv_proxy import admin
from sessionkv_proxy.chat_template import PROBES as CHAT_PROBES
from sessionkv_proxy.chat_template import REQUEST_TEMPLATE_PROBE
from sessionkv_proxy.config import ProxyConfig, Role
from sessionkv_proxy.consumer import EngineSource, KVEventConsumer
from sessionkv_proxy.engines import Engine, EnginePool
from sessionkv_proxy.errors import ApiError, error_response
from sessionkv_proxy.handle_subscriber import HandleSubscribers
from sessionkv_proxy.index.base import KVIndex
from sessionkv_proxy.index.memory import MemoryIndex
from sessionkv_proxy.metrics import ProxyMetrics
from sessionkv_proxy.redis_link import LinkState, RedisLink, make_redis_client
from sessionkv_proxy.policy import Mode, RouteReason
from sessionkv_proxy.router import DEFAULT_OUTPUT_ESTIMATE, RoutePlan, Router
from sessionkv_proxy.server import HttpServer, Request, Response
from sessionkv_proxy.sessions import SessionRecord, valid_session_id
from sessionkv_proxy.tokenizer import PROBES, first_mismatch
from sessionkv_proxy.upstream import UpstreamConnectError, UpstreamPool, UpstreamResponse

__all__ = ["ProxyApp", "ProxyState", "create_app", "serve"]

logger = logging.getLogger("sessionkv_proxy.app")

_json = msgspec.json.Encoder()
_body_decoder = msgspec.json.Decoder()
# Request ids: a per-process random prefix and a counter (uuid4 per request costs more
# than the rest of the routing decision).
_REQUEST_ID_PREFIX = f"skv-{os.urandom(6).hex()}-"
_request_counter = itertools.count()
# Fields a P request must not carry: it generates one token, never streams.
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")
_ENGINE_HEADER = {role: f"x-sessionkv-{role.value}-engine" for role in Role}
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive",
                          "date", "server", "content-encoding"})


@dataclass
class ProxyState:
    config: ProxyConfig
    pool: EnginePool
    index: KVIndex
    metrics: ProxyMetrics
    http: aiohttp.ClientSession | None = None  # control plane: scrape, tokenize, models
    upstream: UpstreamPool | None = None  # the request hot path
    router: Router | None = None
    consumer: KVEventConsumer | None = None
    redis: RedisLink | None = None  # shared index, sessions and published handles
    early: EarlyDecodeSender | None = None  # P's parameters to Ds that hold requests
    handles: HandleSubscribers | None = None  # Ds' handle channels (no Redis needed)
    model_ids: frozenset[str] = frozenset()
    models_body: bytes = b""


# --------------------------------------------------------------------------- input
def _read_json(request: Request) -> dict[str, Any]:
    # The server has already refused bodies over max_body_bytes with a 413.
    try:
        body = _body_decoder.decode(request.body)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


# vLLM reads a request with pydantic in lax mode: "5" and 5.0 are a max_tokens of 5,
# "true" and 1 a stream of True, and no model is its served model.  The proxy reads
# the fields it acts on the same way, so that a request vLLM serves is served through
# the proxy too, and means the same to both.
_LAX_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_LAX_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_LAX_INT = re.compile(r"\s*([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?\s*", re.ASCII)


def _lax_bool(value: Any) -> bool | None:
    if value is None or value.__class__ is bool:
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in _LAX_TRUE:
            return True
        if lowered in _LAX_FALSE:
            return False
    raise ValueError(value)


def _lax_int(value: Any) -> int | None:
    if value is None or value.__class__ is int:
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _LAX_INT.fullmatch(value)
        if match:
            return int(match.group(1))
    raise ValueError(value)


_MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def _validate(body: dict[str, Any], is_chat: bool, state: ProxyState) -> None:
    """Refuse what vLLM would refuse on the fields the proxy reads; normalize those
    fields in ``body`` to what vLLM reads them as."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if model is not None and state.model_ids and model not in state.model_ids:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                       type_="NotFoundError", code="model_not_found")
    if is_chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "'messages' must be a non-empty list of objects",
                           param="messages")
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise ApiError(400, "'prompt' must be a string or a non-empty list",
                           param="prompt")
    if "stream" in body:
        try:
            body["stream"] = _lax_bool(body["stream"])
        except ValueError:
            raise ApiError(400, "'stream' must be a boolean", param="stream") from None
    for key in ("max_tokens", "max_completion_tokens", "n"):
        if key not in body:
            continue
        try:
            value = body[key] = _lax_int(body[key])
            valid = value is None or value >= 0
        except ValueError:
            valid = False
        if not valid:
            raise ApiError(400, f"'{key}' must be a non-negative integer", param=key)
    salt = body.get("cache_salt")
    if salt is not None:
        # The tenant: hashed into the router's keys and the session's store key.
        # vLLM refuses the same (``validate_cache_salt`` in 0.32's
        # entrypoints/generate/base/protocol.py), before pydantic would coerce it.
        if not isinstance(salt, str) or not salt:
            raise ApiError(400, "'cache_salt' must be a non-empty string",
                           param="cache_salt")
        if len(salt) > _MAX_CACHE_SALT_CHARS or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
            raise ApiError(400, f"'cache_salt' must be at most {_MAX_CACHE_SALT_CHARS} "
                           "characters and must not contain '@', '/', '\\', or NUL",
                           param="cache_salt")
    xargs = body.get("vllm_xargs")
    if "kv_transfer_params" in body or (isinstance(xargs, dict)
                                        and "kv_transfer_params" in xargs):
        # vLLM also reads it from vllm_xargs: that door is closed the same way.
        raise ApiError(400, "'kv_transfer_params' is set by the proxy, not the client",
                       param="kv_transfer_params")


def _session_id(request: Request, body: dict[str, Any], state: ProxyState) -> str | None:
    """The conversation this request continues: the body's prompt_cache_key, the
    configured session headers in order, then the body's session_id."""
    source, value = "prompt_cache_key", body.get("prompt_cache_key")
    if value is None:
        headers = request.headers
        for source in state.config.session_headers:
            value = headers.get(source)
            if value is not None:
                break
        else:
            source, value = "session_id", body.get("session_id")
    if value is None:
        return None
    if not valid_session_id(value, state.config.max_session_id_chars):
        raise ApiError(400, f"invalid session id in {source}: must be 1-"
                       f"{state.config.max_session_id_chars} characters of "
                       "[A-Za-z0-9._:@/+=-]", param=source)
    return value


# --------------------------------------------------------------------------- upstream
class _Upstream(Exception):
    """A connection-level failure: safe to retry on another worker."""


class _PrefillUnreachable(Exception):
    """No P could be reached (each one tried failed to connect): the request goes to
    D alone, as co-located, which is always correct; only the P/D split is lost."""


async def _send(state: ProxyState, engine: Engine, path: str, payload: bytes,
                request_id: str) -> UpstreamResponse:
    """POST to an engine; the status and headers are in, the body is not yet read."""
    assert state.upstream is not None
    try:
        resp = await state.upstream.post(engine.url, path, payload,
                                         {"X-Request-Id": request_id})
    except UpstreamConnectError as exc:
        state.pool.mark_failure(engine)
        raise _Upstream(f"{engine.url}: {exc}") from exc
    except asyncio.TimeoutError:
        state.metrics.errors.labels("upstream_timeout").inc()
        raise ApiError(504, f"engine {engine.url} did not answer within "
                       f"{state.config.request_timeout_s:g}s", type_="server_error") from None
    state.pool.mark_success(engine)
    return resp


def _next_after_connect_failure(state: ProxyState, role: Role, failed: Engine,
                                tried: set[str], attempt: int, request_id: str,
                                exc: BaseException) -> Engine:
    """Count and log a connection failure; the next worker of ``role`` to try.  When
    none is left or the retries are spent: for P, :class:`_PrefillUnreachable` (D
    serves the request alone); for D, a 502."""
    assert state.router is not None
    logger.warning("%s connect failed request_id=%s engine=%s: %r", role.value,
                   request_id, failed.url, exc)
    state.metrics.errors.labels(f"{role.value}_connect").inc()
    nxt = state.router.alternative(role, tried)
    if nxt is None or attempt == state.config.connect_retries:
        if role is Role.PREFILL:
            raise _PrefillUnreachable() from None
        raise ApiError(502, f"no {role.value} engine reachable") from None
    state.metrics.retries.labels(role.value).inc()
    return nxt


async def _prefill(state: ProxyState, plan: RoutePlan, path: str, body: dict[str, Any],
                   is_chat: bool, request_id: str,
                   early_push: dict[str, str] | None = None) -> dict[str, Any]:
    """Run P; return its kv_transfer_params for D.  ``early_push`` ({"endpoint",
    "id"}) asks P's connector to push them to the D holding the request itself."""
    p_body = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    p_body["max_tokens"] = 1
    if is_chat and "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    p_body["stream"] = False
    params = plan.prefill_params
    if early_push is not None or not state.config.first_token_handoff:
        # (The router's own parameters: a payload it wrote or a handle it read.)
        ours = payload_from_params(params)
        if early_push is not None:
            ours = msgspec.structs.replace(ours, early_decode_push=EarlyDecodePush(**early_push))
        if not state.config.first_token_handoff:
            ours = msgspec.structs.replace(ours, first_token=False)
        params = with_payload(params, ours)
    p_body["kv_transfer_params"] = params
    engine = plan.prefill
    assert engine is not None and state.router is not None
    tried: set[str] = set()
    prefill_load = _Load(1, 0, plan.prompt_tokens, 0)
    payload = _json.encode(p_body)
    for attempt in range(state.config.connect_retries + 1):
        current = engine
        tried.add(current.url)
        _add_load(current, prefill_load)
        try:
            resp = await _send(state, current, path, payload, request_id)
            status, data = resp.status, await resp.read()
            break
        except _Upstream as exc:
            # The handle names D's blocks, valid for any P: keep it.
            engine = _next_after_connect_failure(state, Role.PREFILL, current, tried,
                                                 attempt, request_id, exc)
            plan.prefill = engine
        finally:
            _add_load(current, prefill_load.negated())
    if status != 200:
        raise _PassThrough(status, data)
    out = msgspec.json.decode(data)
    params = out.get("kv_transfer_params") if isinstance(out, dict) else None
    if not isinstance(params, dict):
        state.metrics.errors.labels("prefill_no_params").inc()
        raise ApiError(502, f"prefill engine {engine.url} returned no kv_transfer_params; "
                       "is it running SessionKVConnector with kv_role kv_producer?")
    return params


class _PassThrough(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(status)
        self.status = status
        self.body = body


def _accounting_header(params: dict[str, Any] | None) -> str | None:
    try:
        acct = payload_from_params(params).accounting
    except PayloadError:
        return None
    return msgspec.json.encode(acct).decode() if acct is not None else None


async def _answer(state: ProxyState, request: Request, plan: RoutePlan, role: Role,
                  path: str, body: dict[str, Any], request_id: str,
                  extra_headers: dict[str, str], relay_after: asyncio.Future | None = None,
                  body_unchanged: bool = False
                  ) -> tuple[Response | None, int, dict[str, Any] | None]:
    """Send the request to the engine that answers it (D, or P for a prefill-only
    request) and relay that answer, once ``relay_after`` (if given) is done.  Returns
    the whole response (None when it was streamed to the client here), the engine's
    status and its kv params (non-streaming only)."""
    assert state.router is not None
    stream = bool(body.get("stream"))
    engine = plan.decode if role is Role.DECODE else plan.prefill
    assert engine is not None
    tried: set[str] = set()
    # The client's own bytes when the proxy changed nothing: no re-encoding.
    payload = request.body if body_unchanged else _json.encode(body)
    # What this request adds to the policy's load terms while it runs: on D the KV it
    # holds, on P the prompt it prefills.
    # On D also the work it still has to do for it (its uncached prompt, its outputs).
    if role is Role.DECODE:
        load = _Load(1, plan.prompt_tokens + (plan.max_output_tokens or DEFAULT_OUTPUT_ESTIMATE),
                     0, plan.decode_work_tokens)
    else:
        load = _Load(1, 0, plan.prompt_tokens, 0)
    for attempt in range(state.config.connect_retries + 1):
        tried.add(engine.url)
        _add_load(engine, load)
        try:
            upstream = await _send(state, engine, path, payload, request_id)
        except BaseException as exc:
            _add_load(engine, load.negated())
            if not isinstance(exc, _Upstream):
                raise
            engine = _next_after_connect_failure(state, role, engine, tried,
                                                 attempt, request_id, exc)
            if role is Role.DECODE:
                plan.decode = engine
            else:
                plan.prefill = engine
            continue
        break
    try:
        if relay_after is not None:
            # vLLM sends a stream's head at once: wait for the headers still to come.
            await relay_after
        headers = [(k, v) for k, v in upstream.headers.items()
                   if k.lower() not in _HOP_HEADERS]
        headers += extra_headers.items()
        headers.append((_ENGINE_HEADER[role], engine.url))
        if not stream or upstream.status != 200:
            data = await upstream.read()
            params = None
            # Only D's own end-of-turn answer carries them; skip decoding the rest.
            if upstream.status == 200 and b'"kv_transfer_params"' in data:
                try:
                    out = msgspec.json.decode(data)
                    params = out.get("kv_transfer_params") if isinstance(out, dict) else None
                except msgspec.DecodeError:
                    params = None
                acct = _accounting_header(params)
                if acct:
                    headers.append(("x-sessionkv-decode", acct))
                if params and not state.config.return_kv_transfer_params:
                    # D's handle (engine id, NIXL address, blocks, hash chain, session
                    # and tenant) is the proxy's business; the client sees what a
                    # plain vLLM server sends.
                    out["kv_transfer_params"] = None
                    data = _json.encode(out)
            return (Response(upstream.status, data, headers, content_type=None),
                    upstream.status, params)
        await request.start_stream(200, headers)
        try:
            async for chunk in upstream.iter_chunks():
                engine.alive(time.monotonic())
                if chunk.endswith(b"data: [DONE]\n\n"):
                    request.stream_done = True   # the client may close once it has it
                await request.write(chunk)
        except (ConnectionResetError, asyncio.TimeoutError) as exc:
            # Either side may end it; only the engine's side is an error of ours.  The
            # server cuts the client's connection so a broken stream never looks whole.
            if not request.client_gone:
                state.metrics.errors.labels(f"{role.value}_stream_broken").inc()
                logger.warning("%s stream broke request_id=%s engine=%s: %r", role.value,
                               request_id, engine.url, exc)
            raise ConnectionResetError("stream ended early") from exc
        await request.end_stream()   # before the session is stored: the client is done
        request.stream_done = True
        return None, 200, None
    finally:
        _add_load(engine, load.negated())
        upstream.release()


def _request_id(request: Request) -> str:
    return request.headers.get("x-request-id") or \
        f"{_REQUEST_ID_PREFIX}{next(_request_counter)}"


class _Load(NamedTuple):
    """What a request adds to an engine's in-flight load while it runs: the policy's
    load terms."""

    requests: int
    decode_tokens: int
    prefill_tokens: int
    decode_work_tokens: int

    def negated(self) -> "_Load":
        return _Load(*(-v for v in self))


def _add_load(engine: Engine, load: _Load) -> None:
    engine.active_requests += load.requests
    engine.active_decode_tokens += load.decode_tokens
    engine.active_prefill_tokens += load.prefill_tokens
    engine.active_decode_work_tokens += load.decode_work_tokens


# --------------------------------------------------------------------------- handlers
async def _generate(state: ProxyState, request: Request, path: str, is_chat: bool
                    ) -> Response | None:
    """Route and answer one generation request.  Counting its outcome is the
    caller's (``_counted``), so that every way out is counted once."""
    # The phase timings only feed the debug log.
    debug = logger.isEnabledFor(logging.DEBUG)
    started = time.perf_counter() if debug else 0.0
    request_id = _request_id(request)
    try:
        body = _read_json(request)
        _validate(body, is_chat, state)
        session_id = _session_id(request, body, state)
        assert state.router is not None
        plan = await state.router.plan(body, is_chat, session_id)
    except ApiError as err:
        return error_response(err)

    plan_done = time.perf_counter() if debug else 0.0
    prefill_s = 0.0
    if plan.degraded:
        state.metrics.degraded.labels(plan.degraded).inc()
    state.metrics.count_route(plan.mode, plan.reason, plan.handle_outcome,
                              plan.terms.get("decision_s", 0.0), len(plan.prompt_keys))
    if debug:
        logger.debug(
            "route request_id=%s session_id=%s mode=%s reason=%s prefill=%s decode=%s "
            "handle=%s terms=%s", request_id, session_id, plan.mode.value, plan.reason.value,
            plan.prefill.url if plan.prefill else "-", plan.decode.url, plan.handle_outcome,
            json.dumps(plan.terms, default=str, separators=(",", ":")))

    # The body sent on: the client's, less prompt_cache_key, with the session id.
    # Untouched (and not copied) when neither is there and the request goes to one
    # engine; P then D, or a session, get their own copy to add parameters to.
    body_unchanged = not session_id and "prompt_cache_key" not in body
    if body_unchanged and plan.mode is not Mode.DISAGGREGATED:
        d_body = body
    else:
        d_body = dict(body)
        d_body.pop("prompt_cache_key", None)
        if session_id:
            d_body["session_id"] = session_id
    extra_headers = {"x-sessionkv-route": plan.mode.value,
                     "x-sessionkv-request-id": request_id}
    if session_id:
        extra_headers["x-sessionkv-handle"] = plan.handle_outcome
    if "detail" in plan.terms:
        extra_headers["x-sessionkv-route-reason"] = plan.terms["detail"]
    decode_started = time.perf_counter() if debug else 0.0
    try:
        try:
            if plan.mode is Mode.DISAGGREGATED:
                response, status, d_params, prefill_s = await _disaggregated(
                    state, request, plan, path, d_body, is_chat, request_id, session_id,
                    extra_headers)
            else:
                if session_id and plan.mode is Mode.DECODE_ONLY:
                    # D keeps this turn for the next P pull only if it knows the session.
                    d_body["kv_transfer_params"] = with_payload(
                        None, SessionPayload(session_id=session_id))
                role = Role.PREFILL if plan.mode is Mode.PREFILL_ONLY else Role.DECODE
                response, status, d_params = await _answer(
                    state, request, plan, role, path, d_body, request_id, extra_headers,
                    body_unchanged=body_unchanged)
        except _PrefillUnreachable:
            response, status, d_params = await _decode_alone(
                state, request, plan, path, d_body, request_id, session_id, extra_headers)
    except ApiError as err:
        return error_response(err)
    except _PassThrough as exc:
        return Response(exc.status, exc.body)

    # A prefill-only turn leaves the session where it was: its D (and any handle
    # there) still serves the next turn, and P's copy is in the index.
    if session_id and plan.mode is not Mode.PREFILL_ONLY:
        await _remember_session(state, plan, session_id, body, d_params)
    if debug:
        done = time.perf_counter()
        logger.debug("done request_id=%s in %.1f ms: plan %.1f ms, prefill %.1f ms, "
                     "prefill and decode %.1f ms", request_id, (done - started) * 1e3,
                     (plan_done - started) * 1e3, prefill_s * 1e3,
                     (done - decode_started) * 1e3)
    return response


async def _disaggregated(state: ProxyState, request: Request, plan: RoutePlan, path: str,
                         d_body: dict[str, Any], is_chat: bool, request_id: str,
                         session_id: str | None, extra_headers: dict[str, str]
                         ) -> tuple[Response | None, int, dict[str, Any] | None, float]:
    """P, then D with P's parameters; returns ``_answer``'s triple and P's seconds.

    With early decode (D has an early-decode socket) D's request goes out first,
    naming an id instead of P's parameters: D parses and queues it while P prefills,
    and holds it until the parameters are pushed under that id."""
    if plan.restore_tokens:
        await _restore_on_decode(state, plan, d_body, session_id, request_id)
    early = state.early
    endpoint = plan.decode.config.early_decode if early is not None else None
    decode_task = None
    if endpoint:
        early_id = new_early_decode_id()
        ours = SessionPayload(early_decode_id=early_id, session_id=session_id or None)
        prefill_done = asyncio.get_running_loop().create_future()
        decode_task = asyncio.ensure_future(_answer(
            state, request, plan, Role.DECODE, path,
            {**d_body, "kv_transfer_params": with_payload(None, ours)}, request_id,
            extra_headers, relay_after=prefill_done))
    started = time.perf_counter()
    try:
        p_params = await _prefill(
            state, plan, path, d_body, is_chat, request_id,
            {"endpoint": endpoint, "id": early_id} if decode_task is not None else None)
    except BaseException:
        if decode_task is not None:
            await _cancel(decode_task)   # D's engine aborts the held request
        raise
    prefill_s = time.perf_counter() - started
    # D's answer is not relayed before this, so its headers carry them.
    acct = _accounting_header(p_params)
    if acct:
        extra_headers["x-sessionkv-prefill"] = acct
    extra_headers["x-sessionkv-prefill-engine"] = plan.prefill.url
    if decode_task is not None:
        prefill_done.set_result(None)
        # P's connector pushed them itself when it could reach D; else push them here.
        # A retry may have moved the request to another D: push to the one holding it.
        holder = plan.decode.config.early_decode
        pushed_by_p = holder == endpoint and _pushed_by_prefill(p_params)
        if decode_task.done() or pushed_by_p or (
                holder and early.send(holder, early_id, p_params)):
            return (*await decode_task, prefill_s)
        state.metrics.errors.labels("early_decode_push").inc()
        await _cancel(decode_task)
    d_body["kv_transfer_params"] = p_params
    return (*await _answer(state, request, plan, Role.DECODE, path, d_body, request_id,
                           extra_headers), prefill_s)


async def _decode_alone(state: ProxyState, request: Request, plan: RoutePlan, path: str,
                        d_body: dict[str, Any], request_id: str, session_id: str | None,
                        extra_headers: dict[str, str]
                        ) -> tuple[Response | None, int, dict[str, Any] | None]:
    """The request P could not take, sent to D alone (D prefills it itself, as
    co-located): a P pool that cannot be reached costs speed, never the request.
    Nothing of P's was sent to D (an early-decode request D held was cancelled)."""
    logger.warning("no prefill engine reachable request_id=%s; decode only on %s",
                   request_id, plan.decode.url)
    state.metrics.errors.labels("prefill_unreachable").inc()
    plan.mode, plan.prefill = Mode.DECODE_ONLY, None
    if session_id:
        d_body["kv_transfer_params"] = with_payload(None, SessionPayload(session_id=session_id))
    else:
        d_body.pop("kv_transfer_params", None)
    extra_headers["x-sessionkv-route"] = Mode.DECODE_ONLY.value
    extra_headers["x-sessionkv-route-reason"] = "no prefill engine reachable; decode only"
    return await _answer(state, request, plan, Role.DECODE, path, d_body, request_id,
                         extra_headers)


async def _restore_on_decode(state: ProxyState, plan: RoutePlan, body: dict[str, Any],
                             session_id: str | None, request_id: str) -> None:
    """Have D restore the prompt's prefix from its host tier, for P to pull.

    D is sent that prefix as a one-token session turn: its connector restores the
    blocks from host (priced against recomputing them, as for any turn), holds them
    under a fresh lease and answers with their handle, which P's parameters then
    carry; P verifies and prices the pull as for any handle.  Any failure costs speed
    only: P then prefills without the handle."""
    ids = plan.prompt_token_ids or []
    # D computes at least the last token it is sent: one past the restored prefix.
    upto = min(plan.restore_tokens, len(ids) - 1)
    if upto <= 0 or not session_id:
        return
    restore_body: dict[str, Any] = {
        "model": body.get("model"), "prompt": ids[:upto + 1], "max_tokens": 1,
        "temperature": 0.0, "stream": False, "session_id": session_id,
        "kv_transfer_params": with_payload(None, SessionPayload(session_id=session_id))}
    if plan.tenant is not None:
        restore_body["cache_salt"] = plan.tenant
    outcome = "failed"
    try:
        resp = await _send(state, plan.decode, "/v1/completions", _json.encode(restore_body),
                           f"{request_id}-restore")
        data = await resp.read()
        if resp.status == 200:
            params = msgspec.json.decode(data).get("kv_transfer_params")
            if params and params.get("do_remote_decode"):
                handle = handle_from_params(params)
                # A lease shorter than the margin gives a handle P would refuse.
                if handle_expired(handle.expires_at_unix_s, time.time(),
                                  state.router.params.handle_expiry_margin_s):
                    outcome = "expired"
                    if not plan.decode.restore_handles_expire:
                        plan.decode.restore_handles_expire = True
                        logger.warning(
                            "host-tier restores on %s stop: its handles expire within the "
                            "proxy's handle_expiry_margin_s (%.0f s); its session_lease_s "
                            "must be longer for P to pull restored KV", plan.decode.url,
                            state.router.params.handle_expiry_margin_s)
                else:
                    plan.prefill_params = handle.prefill_params()
                    outcome = "handle"
    except (_Upstream, ApiError, PayloadError, msgspec.DecodeError, AttributeError) as exc:
        logger.warning("host-tier restore request_id=%s engine=%s failed: %r", request_id,
                       plan.decode.url, exc)
    state.metrics.host_tier_restores.labels(outcome).inc()


def _pushed_by_prefill(p_params: dict[str, Any]) -> bool:
    try:
        return payload_from_params(p_params).early_decode_pushed
    except PayloadError:
        return False


async def _cancel(task: asyncio.Future) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _remember_session(state: ProxyState, plan: RoutePlan, session_id: str,
                            body: dict[str, Any], d_params: dict[str, Any] | None) -> None:
    assert state.router is not None
    handle = None
    if d_params and d_params.get("do_remote_decode"):
        try:
            handle = handle_from_params(d_params)
        except PayloadError as exc:   # a D speaking another protocol version
            logger.warning("session %s: D's handle not stored: %s", session_id, exc)
    try:
        record = SessionRecord(
            session_id=session_id,
            last_decode=plan.decode.url,
            handle=handle,
            prompt_keys=plan.prompt_keys,
            tenant=plan.tenant)
        state.router.save_session_later(record)   # behind the answer, not before it
    except Exception as exc:  # the answer is already out; a lost record costs speed only
        state.metrics.errors.labels("session_store").inc()
        logger.warning("session %s not stored: %r", session_id, exc)


async def _counted(state: ProxyState, request: Request, *, endpoint: str, path: str,
                   is_chat: bool) -> Response | None:
    """``_generate``, with every outcome counted in ``requests_total``: the status
    answered, 499 for a client that left before its answer was complete, 502 for an
    engine stream that broke, 500 (and ``errors{kind="internal"}``) for a bug."""
    status = 500
    try:
        response = await _generate(state, request, path, is_chat)
        status = response.status if response is not None else 200
        return response
    except ApiError as err:
        response = error_response(err)
        status = response.status
        return response
    except RecursionError:  # a body nested deeper than a step of ours can walk
        response = error_response(ApiError(400, "request body is nested too deeply"))
        status = 400
        return response
    except (ConnectionResetError, BrokenPipeError):
        status = 200 if request.stream_done else 499 if request.client_gone else 502
        raise
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception:
        state.metrics.errors.labels("internal").inc()
        raise
    finally:
        state.metrics.count_request(endpoint, status)


async def models(state: ProxyState, request: Request) -> Response:
    if not state.models_body:
        await _discover_models(state)
    if not state.models_body:
        return error_response(ApiError(503, "no engine answered /v1/models"))
    return Response(200, state.models_body)


async def forward_to_decode(state: ProxyState, request: Request) -> Response:
    """Model-level utilities (``/tokenize``, ``/detokenize``): every engine serves the
    same model, so a D answers them as it would directly, through the same send,
    retry and relay as a decode-only request."""
    assert state.router is not None
    engine = state.router.alternative(Role.DECODE, set())
    if engine is None:
        raise ApiError(503, "no decode engine available", type_="server_error")
    plan = RoutePlan(Mode.DECODE_ONLY, None, engine, RouteReason.MODEL_UTILITY)
    response, _, _ = await _answer(state, request, plan, Role.DECODE, request.path, {},
                                   _request_id(request), {}, body_unchanged=True)
    assert response is not None  # never streamed
    return response


# An event stream whose newest batch arrived later than this after it was published
# makes /health say "degraded": the index lags the engines.
_EVENT_LAG_DEGRADED_S = 5.0


def health_report(state: ProxyState) -> tuple[int, dict[str, Any]]:
    """What /health answers: 200 while the proxy can serve (a decode engine takes
    requests), 503 otherwise; ``status`` is "degraded" with each problem named when
    it serves with less than it should (an engine out, Redis down, events lagging)."""
    now = time.monotonic()
    problems: list[str] = []
    engines = []
    for e in state.pool.engines:
        engine_state = "up" if e.available else "stalled" if e.healthy else "unreachable"
        if engine_state != "up":
            problems.append(f"{e.role.value} engine {e.url} {engine_state}")
        engines.append({"url": e.url, "role": e.role.value, "state": engine_state,
                        "in_flight": e.active_requests,
                        "last_answer_s_ago": round(now - e.last_alive_s, 1)})
    available = {role.value: sum(e.available for e in state.pool.by_role(role))
                 for role in Role}
    report: dict[str, Any] = {"healthy": available, "engines": engines}
    if state.redis is not None:
        report["redis"] = state.redis.health()
        if state.redis.state is not LinkState.UP:
            problems.append(f"redis {state.redis.state.value}: routing from this "
                            "replica's own index and sessions")
    if state.consumer is not None:
        events = {}
        for engine, stats in state.consumer.stats().items():
            events[engine] = {"last_lag_s": round(stats.last_lag_s, 3),
                              "batches_lost": stats.batches_lost,
                              "index_errors": stats.index_errors,
                              "dropped": dict(stats.dropped_by_reason)}
            if stats.last_lag_s > _EVENT_LAG_DEGRADED_S:
                problems.append(f"kv events of {engine} lag {stats.last_lag_s:.1f} s")
        report["events"] = events
        report["block_size"] = state.router.block_size.report()
        problems.extend(state.router.block_size.problems())
    if state.handles is not None:
        report["handle_channel"], channel_problems = state.handles.health()
        problems += channel_problems
    serving = available["decode"] > 0
    report["status"] = "unavailable" if not serving else "degraded" if problems else "ok"
    report["problems"] = problems
    return (200 if serving else 503), report


async def health(state: ProxyState, request: Request) -> Response:
    status, report = health_report(state)
    return Response(status, _json.encode(report))


async def metrics(state: ProxyState, request: Request) -> Response:
    try:
        state.metrics.index_blocks.set(await state.index.size())
    except Exception:
        state.metrics.errors.labels("index_size").inc()
    if state.consumer is not None:
        for engine, stats in state.consumer.stats().items():
            state.metrics.event_lag_s.labels(engine).set(stats.last_lag_s)
            state.metrics.events.labels(engine).set(stats.events_applied)
            state.metrics.replays.labels(engine).set(stats.replays)
            state.metrics.resets.labels(engine).set(stats.resets)
            state.metrics.undecodable.labels(engine).set(stats.batches_undecodable)
            for reason, count in stats.dropped_by_reason.items():
                state.metrics.dropped.labels(engine, reason).set(count)
    for engine in state.pool.engines:
        state.metrics.in_flight.labels(engine.url).set(engine.active_requests)
        state.metrics.engine_available.labels(engine.url).set(1 if engine.available else 0)
    if state.redis is not None:
        state.metrics.redis_up.set(1 if state.redis.available else 0)
    return Response(200, generate_latest(state.metrics.registry),
                    content_type=CONTENT_TYPE_LATEST)


# --------------------------------------------------------------------------- lifecycle
async def _discover_models(state: ProxyState) -> None:
    assert state.http is not None
    for engine in state.pool.by_role(Role.DECODE) + state.pool.by_role(Role.PREFILL):
        try:
            async with state.http.get(engine.url + "/v1/models",
                                      timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    continue
                data = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            continue
        out = msgspec.json.decode(data)
        ids = {m.get("id") for m in out.get("data", []) if isinstance(m, dict)}
        state.model_ids = frozenset(i for i in ids if isinstance(i, str))
        state.models_body = data
        return


async def _check_local_tokenizer(state: ProxyState) -> None:
    """Compare the local tokenizer with an engine's /tokenize on a few probes, then
    the local chat template on a few conversations.  A match lets the router use
    them; a mismatch would make every index lookup miss, so the engine's /tokenize
    serves (for completions, or for chat alone) for the rest of the process life.
    When no engine answers there is no verdict, and a later request tries again."""
    router = state.router
    assert router is not None
    local = router.local_tokenizer
    if local is None:
        return
    if not router.local_tokenizer_ok:
        cases = [(p, special) for special in (True, False) for p in PROBES]

        async def engine_ids(case: tuple[str, bool]) -> list[int] | None:
            return await router.prompt_token_ids(
                {"prompt": case[0], "add_special_tokens": case[1]}, False, engine_only=True)

        try:
            # One probe first: an unreachable engine costs one timeout, not one per probe.
            theirs = [await engine_ids(cases[0])]
            if theirs[0] is not None:
                theirs += await asyncio.gather(*map(engine_ids, cases[1:]))
        except ApiError as exc:
            theirs = [None]
            logger.warning("local tokenizer check: an engine refused a probe: %s",
                           exc.message)
        if any(ids is None for ids in theirs):
            logger.info("local tokenizer check: no engine answered /tokenize; trying again "
                        "on a later request, the engine tokenizes until then")
            return
        bad = first_mismatch(cases, [local.encode(p, special) for p, special in cases], theirs)
        if bad is not None:
            router.local_tokenizer = router.local_chat = None
            state.metrics.errors.labels("local_tokenizer_mismatch").inc()
            logger.error("local tokenizer %s differs from the engine's /tokenize on probe %r "
                         "(add_special_tokens=%s); the engine tokenizes from now on",
                         local.path, bad[0], bad[1])
            return
        router.local_tokenizer_ok = True
        logger.info("local tokenizer %s matches the engine on %d probes; completions "
                    "prompts are tokenized in the proxy", local.path, len(cases))
    if router.local_chat is not None and not router.local_chat_ok:
        await _check_local_chat(state)


async def _check_local_chat(state: ProxyState) -> None:
    """The chat probes: each conversation's ids from the local template against the
    engine's /tokenize with ``messages`` (both refusing a probe counts as agreeing).
    Then whether the engines accept a request's own chat_template and render it the
    same; until seen, such requests go to /tokenize."""
    router = state.router
    assert router is not None and router.local_chat is not None
    chat = router.local_chat

    async def engine_outcome(body: dict[str, Any]) -> list[int] | str | None:
        try:
            return await router.prompt_token_ids(dict(body), True, engine_only=True)
        except ApiError:
            return "refused"

    def local_outcome(body: dict[str, Any], request_templates: bool) -> list[int] | str:
        try:
            return chat.ids(dict(body), request_templates)
        except Exception:
            return "refused"

    theirs = await asyncio.gather(*map(engine_outcome, CHAT_PROBES))
    if any(ids is None for ids in theirs):
        logger.info("local chat template check: no engine answered /tokenize; trying "
                    "again on a later request, the engine tokenizes chat until then")
        return
    ours = [local_outcome(body, False) for body in CHAT_PROBES]
    bad = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if bad is not None or all(ids == "refused" for ids in theirs):
        router.local_chat = None
        state.metrics.errors.labels("local_chat_template_mismatch").inc()
        probe = 0 if bad is None else bad
        logger.error("local chat template of %s differs from the engine's /tokenize on "
                     "probe %d %s (local: %s, engine: %s); the engine tokenizes chat "
                     "prompts from now on", chat.model_dir, probe,
                     json.dumps(CHAT_PROBES[probe], ensure_ascii=False)[:300],
                     str(ours[probe])[:200], str(theirs[probe])[:200])
        return
    template_ids = await engine_outcome(REQUEST_TEMPLATE_PROBE)
    router.request_templates_ok = (isinstance(template_ids, list) and template_ids
                                   == local_outcome(REQUEST_TEMPLATE_PROBE, True))
    router.local_chat_ok = True
    logger.info("local chat template of %s matches the engine on %d conversations; chat "
                "prompts are tokenized in the proxy (a request's own chat_template: %s)",
                chat.model_dir, len(CHAT_PROBES),
                "in the proxy" if router.request_templates_ok else "by the engine")


async def _wait_connected(sender: EarlyDecodeSender, endpoints: list[str],
                          timeout_s: float) -> None:
    """Give the early-decode sockets up to ``timeout_s`` to connect, so that the first
    requests' pushes find them up (a push that finds no connection costs a second D
    request after P); a D that is not up yet is connected to later."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not all(sender.connected(e) for e in endpoints):
        if loop.time() >= deadline:
            logger.warning("early decode: not connected yet to %s",
                           [e for e in endpoints if not sender.connected(e)])
            return
        await asyncio.sleep(0.01)


def _make_index(config: ProxyConfig, metrics: ProxyMetrics
                ) -> tuple[KVIndex, RedisLink | None]:
    """The index (and the Redis link it and the published handles share): in-process,
    or Redis with the in-process copy to fall back on."""
    local = MemoryIndex(max_blocks_per_slot=config.index.max_blocks_per_engine,
                        max_handles=config.index.max_published_handles)
    if config.index.backend != "redis":
        return local, None
    from sessionkv_proxy.index.fallback import FallbackIndex
    from sessionkv_proxy.index.redis import RedisIndex

    cfg = config.index
    keys = RedisKeys(cfg.redis_namespace)
    link = RedisLink(make_redis_client(cfg.redis_url, max_connections=cfg.redis_max_connections,
                                       timeout_s=cfg.redis_timeout_s),
                     timeout_s=cfg.redis_timeout_s, failures_to_open=cfg.redis_failures_to_open,
                     retry_interval_s=cfg.redis_retry_interval_s,
                     on_error=lambda kind: metrics.errors.labels(kind).inc(),
                     home_key=keys.engines)
    remote = RedisIndex(link.client, namespace=keys.namespace,
                        max_blocks_per_slot=cfg.max_blocks_per_engine)
    index = FallbackIndex(remote, local, link, engines=[e.url for e in config.engines],
                          on_fallback=lambda op: metrics.redis_fallbacks.labels(op).inc(),
                          on_republish=metrics.redis_republishes.inc)
    return index, link


def _server_error(status: int, message: str) -> Response:
    return error_response(ApiError(status, message))


class ProxyApp:
    """The proxy's state, its routes and their lifecycle (start, then stop)."""

    def __init__(self, config: ProxyConfig, index: KVIndex | None = None) -> None:
        counters = ProxyMetrics(redis=index is None and config.index.backend == "redis")
        link = None
        if index is None:
            index, link = _make_index(config, counters)
        self.state = ProxyState(config=config, pool=EnginePool.from_configs(config.engines),
                                index=index, metrics=counters, redis=link)
        self._background: list[asyncio.Task] = []
        state = self.state

        def bind(handler):
            async def bound(request: Request):
                try:
                    return await handler(state, request)
                except ApiError as err:
                    return error_response(err)
            return bound

        # The generation endpoints are bound without a wrapper: ``_counted`` answers
        # every error itself, and a frame less is less CPU on every request.
        self.server = HttpServer(
            {"/v1/completions": {"POST": functools.partial(
                _counted, state, endpoint="completions", path="/v1/completions",
                is_chat=False)},
             "/v1/chat/completions": {"POST": functools.partial(
                 _counted, state, endpoint="chat", path="/v1/chat/completions",
                 is_chat=True)},
             "/v1/models": {"GET": bind(models)},
             "/tokenize": {"POST": bind(forward_to_decode)},
             "/detokenize": {"POST": bind(forward_to_decode)},
             "/admin/reset": {"POST": bind(admin.reset)},
             "/health": {"GET": bind(health)},
             "/metrics": {"GET": bind(metrics)}},
            error_response=_server_error, max_body_bytes=config.max_body_bytes,
            limits=config.front)

    async def start(self) -> None:
        """Open the clients, the index consumer and the scraper, then listen."""
        state = self.state
        config = state.config
        # This session scrapes /metrics and discovers models.  Its DNS answers live
        # 10 s (aiohttp's default): after an engine pod restarts with a new IP, its
        # scrapes go to the old address (refused ones count against its health) only
        # until the cached answer expires (it was 300 s).  The request path resolves
        # on each new connection.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=10, keepalive_timeout=60)
        state.http = aiohttp.ClientSession(
            connector=connector, json_serialize=lambda o: _json.encode(o).decode(),
            timeout=aiohttp.ClientTimeout(total=config.request_timeout_s,
                                          sock_connect=config.connect_timeout_s))
        state.upstream = UpstreamPool(connect_timeout_s=config.connect_timeout_s,
                                      request_timeout_s=config.request_timeout_s)
        state.router = Router(config, state.pool, state.index, state.upstream)
        state.router.on_write_error = lambda kind: state.metrics.errors.labels(kind).inc()
        early_endpoints = [e.early_decode for e in config.decode if e.early_decode]
        if early_endpoints:
            state.early = EarlyDecodeSender(early_endpoints)
            await _wait_connected(state.early, early_endpoints,
                                  min(2.0, config.connect_timeout_s))
        sources = [EngineSource(engine=e.url, endpoint=e.kv_events,
                                replay_endpoint=e.kv_events_replay, topic=e.kv_events_topic)
                   for e in config.engines if e.kv_events]
        if sources:
            state.consumer = KVEventConsumer(sources, state.index,
                                             block_size=state.router.block_size)
            state.consumer.start()
        channels = {e.url: e.handle_channel for e in config.decode if e.handle_channel}
        if channels:
            state.handles = HandleSubscribers(channels, state.index)
            state.metrics.registry.register(state.handles.collector())
            state.handles.start()
        await _discover_models(state)
        if state.router.local_tokenizer is not None:
            state.router.check_local_tokenizer = lambda: _check_local_tokenizer(state)
            await _check_local_tokenizer(state)
        self._background.append(asyncio.create_task(state.pool.scrape_forever(
            state.http, config.metrics_scrape_interval_s, config.metrics_scrape_timeout_s,
            on_slow=lambda e: state.metrics.errors.labels("metrics_scrape_slow").inc(),
            stall_s=config.engine_stall_s,
            on_stall=lambda e: state.metrics.errors.labels("engine_stalled").inc()),
            name="metrics-scraper"))
        maintain = getattr(state.index, "maintain", None)
        if maintain is not None:
            self._background.append(asyncio.create_task(maintain(), name="index-upkeep"))
        await self.server.start(config.host, config.port)
        logger.info("proxy ready on %s:%d: %d prefill, %d decode engines, index=%s, "
                    "policy=%s", config.host, config.port, len(config.prefill),
                    len(config.decode), config.index.backend, config.routing.policy)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop accepting, finish in-flight requests up to ``grace_s``, close all."""
        state = self.state
        await self.server.stop(grace_s)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if state.consumer is not None:
            await state.consumer.stop()
        if state.handles is not None:
            await state.handles.stop()
        if state.router is not None:
            try:   # the writes behind the last requests
                await asyncio.wait_for(state.router.flush(), 10.0)
            except asyncio.TimeoutError:
                logger.warning("writes behind requests not finished at stop")
        if state.http is not None:
            await state.http.close()
        if state.upstream is not None:
            await state.upstream.close()
        if state.early is not None:
            state.early.close()
        await state.index.close()
        if state.redis is not None:
            await state.redis.aclose()


def create_app(config: ProxyConfig, index: KVIndex | None = None) -> ProxyApp:
    return ProxyApp(config, index)


async def serve(config: ProxyConfig, shutdown_grace_s: float = 30.0) -> None:
    """Run until SIGINT or SIGTERM, then shut down gracefully."""
    import gc
    import signal

    app = create_app(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await app.start()
        # What start-up built (config, tokenizer, chat templates, metrics, the index's
        # tables) lives as long as the process: moved out of the collector's reach, it
        # is not walked again by every full collection a busy proxy triggers.
        gc.freeze()
        await stop.wait()
        logger.info("shutting down: finishing in-flight requests (up to %.0f s)",
                    shutdown_grace_s)
    finally:
        await app.stop(shutdown_grace_s)
