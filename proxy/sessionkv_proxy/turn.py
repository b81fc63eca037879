"""One generation request through the pools: parse, plan, then P and D.

A turn goes P then D (P prefills with ``max_tokens=1`` and hands its KV to D over
NIXL; D decodes and streams), or straight to D when the policy finds the uncached
part small, or only to P when there is nothing to decode (at most one new token).
Streams are passed through byte for byte.  Each step takes values and returns
values: the plan is read, never changed; a retry's engine comes back with the
answer (:class:`~sessionkv_proxy.relay.Answer`), a host-tier restore's handle as new
P parameters.  The session is remembered behind the answer, under the D that gave it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_sessionkv.wire.early_decode import EarlyDecodeSender, new_early_decode_id
from vllm_sessionkv.wire.protocol import EarlyDecodePush, PayloadError, handle_expired

from sessionkv_proxy import handoff
from sessionkv_proxy.config import ProxyConfig
from sessionkv_proxy.engines import Engine
from sessionkv_proxy.errors import ApiError, error_response
from sessionkv_proxy.metrics import ProxyMetrics
from sessionkv_proxy.route_types import Mode, Role
from sessionkv_proxy.relay import (
    Answer,
    EngineSender,
    EngineUnreachable,
    Load,
    PrefillUnreachable,
)
from sessionkv_proxy.request import (
    ClientRequest,
    hold_hint_of,
    new_request_id,
    read_json,
    session_id_of,
    validate,
)
from sessionkv_proxy.resent_answers import ResentAnswers
from sessionkv_proxy.router import RoutePlan, Router
from sessionkv_proxy.server import Request, Response
from sessionkv_proxy.sessions import SessionRecord
from sessionkv_proxy.tasks import cancel_all

__all__ = ["TurnRunner"]

logger = logging.getLogger("sessionkv_proxy.turn")

_json = msgspec.json.Encoder()


class _PassThrough(Exception):
    """P answered with an error: the client gets P's answer as it is."""

    def __init__(self, status: int, body: bytes):
        super().__init__(status)
        self.status = status
        self.body = body


@dataclass
class _Holder:
    """The D an early-decode request is at now (a retry may move it)."""

    engine: Engine

    def moved_to(self, engine: Engine) -> None:
        self.engine = engine


class TurnRunner:
    """Serves the generation endpoints: one :meth:`serve` per request."""

    def __init__(self, *, config: ProxyConfig, router: Router, sender: EngineSender,
                 early: EarlyDecodeSender | None, metrics: ProxyMetrics,
                 model_ids: Callable[[], frozenset[str]],
                 resent: ResentAnswers | None = None) -> None:
        self._config = config
        self._resent = resent
        self._router = router
        self._sender = sender
        self._early = early
        self._metrics = metrics
        self._model_ids = model_ids

    async def serve(self, request: Request, *, endpoint: str, path: str, is_chat: bool
                    ) -> Response | None:
        """One generation request, with every outcome counted in ``requests_total``:
        the status answered, 499 for a client that left before its answer was
        complete, 502 for an engine stream that broke, 500 (and
        ``errors{kind="internal"}``) for a bug."""
        status = 500
        try:
            response = await self._generate(request, path, is_chat)
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
            self._metrics.errors.labels("internal").inc()
            raise
        finally:
            self._metrics.count_request(endpoint, status)

    def _parse(self, request: Request, path: str, is_chat: bool, request_id: str
               ) -> ClientRequest:
        body = read_json(request.body)
        validate(body, is_chat, self._model_ids())
        session_id = session_id_of(request.headers, body, self._config.session_headers,
                                   self._config.max_session_id_chars)
        hint_s = hold_hint_of(request.headers, self._config.max_session_hold_s)
        return ClientRequest(request_id=request_id, path=path, is_chat=is_chat, body=body,
                             raw_body=request.body, session_id=session_id,
                             hold_hint_s=hint_s if session_id else None)

    async def _generate(self, request: Request, path: str, is_chat: bool
                        ) -> Response | None:
        """Route and answer one generation request."""
        # The phase timings only feed the debug log.
        debug = logger.isEnabledFor(logging.DEBUG)
        started = time.perf_counter() if debug else 0.0
        try:
            client = self._parse(request, path, is_chat, new_request_id(request.headers))
            # resend_answer_ids: a chat turn may go on as token ids (completions).
            rewrite = None
            if self._resent is not None:
                client, rewrite = self._resent.rewrite(client)
            plan = await self._router.plan(client.body, client.is_chat, client.session_id)
        except ApiError as err:
            return error_response(err)
        plan_done = time.perf_counter() if debug else 0.0
        self._count_route(client, plan, debug)
        try:
            answer, prefill_s = await self._run(request, client, plan)
        except ApiError as err:
            return error_response(err)
        except _PassThrough as exc:
            return Response(exc.status, exc.body)
        # A prefill-only turn leaves the session where it was: its D (and any handle
        # there) still serves the next turn, and P's copy is in the index.
        if client.session_id and plan.mode is not Mode.PREFILL_ONLY:
            self._remember_session(plan, client, answer)
        response = answer.response
        if rewrite is not None:
            response = self._resent.finish(rewrite, answer)
        if debug:
            done = time.perf_counter()
            logger.debug("done request_id=%s in %.1f ms: plan %.1f ms, prefill %.1f ms, "
                         "prefill and decode %.1f ms", client.request_id,
                         (done - started) * 1e3, (plan_done - started) * 1e3,
                         prefill_s * 1e3, (done - plan_done) * 1e3)
        return response

    def _count_route(self, client: ClientRequest, plan: RoutePlan, debug: bool) -> None:
        if plan.degraded:
            self._metrics.degraded.labels(plan.degraded).inc()
        self._metrics.count_route(plan.mode, plan.reason, plan.handle_outcome,
                                  plan.terms.get("decision_s", 0.0), len(plan.prompt_keys))
        if debug:
            logger.debug(
                "route request_id=%s session_id=%s mode=%s reason=%s prefill=%s decode=%s "
                "handle=%s terms=%s", client.request_id, client.session_id,
                plan.mode.value, plan.reason.value,
                plan.prefill.url if plan.prefill else "-", plan.decode.url,
                plan.handle_outcome, json.dumps(plan.terms, default=str,
                                                separators=(",", ":")))

    async def _run(self, request: Request, client: ClientRequest, plan: RoutePlan
                   ) -> tuple[Answer, float]:
        """The plan carried out: its answer and P's seconds."""
        session_id = client.session_id
        # The body sent on: the client's, less prompt_cache_key, with the session id.
        # Untouched (sent as the client's bytes) when neither is there and the request
        # goes to one engine.
        body_unchanged = not session_id and "prompt_cache_key" not in client.body
        d_body = client.body   # read only: every change below makes a new dict
        if not body_unchanged:
            d_body = {k: v for k, v in d_body.items() if k != "prompt_cache_key"}
            if session_id:
                d_body["session_id"] = session_id
        headers = {"x-sessionkv-route": plan.mode.value,
                   "x-sessionkv-request-id": client.request_id}
        if session_id:
            headers["x-sessionkv-handle"] = plan.handle_outcome
        if "detail" in plan.terms:
            headers["x-sessionkv-route-reason"] = plan.terms["detail"]
        try:
            if plan.mode is Mode.DISAGGREGATED:
                return await self._disaggregated(request, client, plan, d_body, headers)
            if session_id and plan.mode is Mode.DECODE_ONLY:
                d_body = handoff.with_params(d_body, handoff.session_params(
                    session_id, client.hold_hint_s))
            role = Role.PREFILL if plan.mode is Mode.PREFILL_ONLY else Role.DECODE
            payload = client.raw_body if body_unchanged else _json.encode(d_body)
            return await self._answer(request, client, plan, role, payload, headers), 0.0
        except PrefillUnreachable:
            return await self._decode_alone(request, client, plan, d_body, headers), 0.0

    async def _answer(self, request: Request, client: ClientRequest, plan: RoutePlan,
                      role: Role, payload: bytes, headers: dict[str, str],
                      relay_after: asyncio.Future | None = None,
                      holder: _Holder | None = None) -> Answer:
        """The answering engine's send and relay (D, or P for a prefill-only turn)."""
        if role is Role.DECODE:
            engine = plan.decode
            load = Load(decode_tokens=plan.prompt_tokens + plan.output_tokens,
                        decode_work_tokens=plan.decode_work_tokens,
                        prefill_work_tokens=plan.decode_prefill_tokens)
        else:
            engine, load = plan.prefill, Load(prefill_tokens=plan.prompt_tokens,
                                              prefill_work_tokens=plan.prefill_work_tokens)
        return await self._sender.answer(
            request, role, engine, client.path, payload, client.request_id, load, headers,
            client.stream, relay_after=relay_after,
            on_engine=holder.moved_to if holder is not None else None)

    async def _prefill(self, client: ClientRequest, plan: RoutePlan,
                       d_body: dict[str, Any], params: dict[str, Any],
                       early_push: EarlyDecodePush | None) -> tuple[Engine, dict[str, Any]]:
        """Run P; return the P that answered and its kv_transfer_params for D.
        ``early_push`` asks P's connector to push them to the D holding the request."""
        p_body = handoff.prefill_body(d_body, client.is_chat, params, early_push,
                                      self._config.first_token_handoff)
        # The handle names D's blocks, valid for any P: a retry keeps it.
        async with self._sender.sending(
                Role.PREFILL, plan.prefill, client.path, _json.encode(p_body),
                client.request_id, Load(prefill_tokens=plan.prompt_tokens,
                                        prefill_work_tokens=plan.prefill_work_tokens)
                ) as sent:
            status, data = sent.response.status, await sent.response.read()
        if status != 200:
            raise _PassThrough(status, data)
        _, p_params = handoff.decode_answer(data)
        if p_params is None:
            self._metrics.errors.labels("prefill_no_params").inc()
            raise ApiError(502, f"prefill engine {sent.engine.url} returned no "
                           "kv_transfer_params; is it running SessionKVConnector with "
                           "kv_role kv_producer?")
        return sent.engine, p_params

    async def _disaggregated(self, request: Request, client: ClientRequest,
                             plan: RoutePlan, d_body: dict[str, Any],
                             headers: dict[str, str]) -> tuple[Answer, float]:
        """P, then D with P's parameters; returns D's answer and P's seconds.

        With early decode (D has an early-decode socket) D's request goes out first,
        naming an id instead of P's parameters: D parses and queues it while P
        prefills, and holds it until the parameters are pushed under that id."""
        params = plan.prefill_params
        if plan.restore_tokens:
            params = await self._restore_on_decode(client, plan) or params
        early = self._early
        endpoint = plan.decode.config.early_decode if early is not None else None
        decode_task = early_id = None
        holder = _Holder(plan.decode)
        if endpoint:
            early_id = new_early_decode_id()
            prefill_done = asyncio.get_running_loop().create_future()
            decode_task = asyncio.ensure_future(self._answer(
                request, client, plan, Role.DECODE, _json.encode(handoff.with_params(
                    d_body, handoff.early_decode_params(early_id, client.session_id,
                                                        client.hold_hint_s))),
                headers, relay_after=prefill_done, holder=holder))
        started = time.perf_counter()
        try:
            prefill, p_params = await self._prefill(
                client, plan, d_body, params,
                EarlyDecodePush(endpoint=endpoint, id=early_id) if decode_task is not None
                else None)
        except BaseException:
            if decode_task is not None:
                await cancel_all([decode_task])   # D's engine aborts the held request
            raise
        prefill_s = time.perf_counter() - started
        # D's answer is not relayed before this, so its headers carry them.
        acct = handoff.accounting_header(p_params)
        if acct:
            headers["x-sessionkv-prefill"] = acct
        headers["x-sessionkv-prefill-engine"] = prefill.url
        # P's time as the proxy saw it (its queue, prefill and pulls, and the hop).
        headers["x-sessionkv-prefill-ms"] = f"{prefill_s * 1e3:.1f}"
        if decode_task is not None:
            prefill_done.set_result(None)
            # P's connector pushed them itself when it could reach D; else push them
            # here, to the D holding the request (a retry may have moved it).
            at = holder.engine.config.early_decode
            pushed_by_p = at == endpoint and handoff.pushed_by_prefill(p_params)
            if decode_task.done() or pushed_by_p or (
                    at and early.send(at, early_id, p_params)):
                return await decode_task, prefill_s
            self._metrics.errors.labels("early_decode_push").inc()
            await cancel_all([decode_task])
        payload = _json.encode(handoff.with_params(
            d_body, handoff.with_hold_hint(p_params, client.hold_hint_s)))
        return await self._answer(request, client, plan, Role.DECODE, payload,
                                  headers), prefill_s

    async def _decode_alone(self, request: Request, client: ClientRequest,
                            plan: RoutePlan, d_body: dict[str, Any],
                            headers: dict[str, str]) -> Answer:
        """The request P could not take, sent to D alone (D prefills it itself, as
        co-located): a P pool that cannot be reached costs speed, never the request.
        Nothing of P's was sent to D (an early-decode request D held was cancelled)."""
        logger.warning("no prefill engine reachable request_id=%s; decode only on %s",
                       client.request_id, plan.decode.url)
        self._metrics.errors.labels("prefill_unreachable").inc()
        if client.session_id:
            d_body = handoff.with_params(d_body, handoff.session_params(
                client.session_id, client.hold_hint_s))
        headers = {**headers, "x-sessionkv-route": Mode.DECODE_ONLY.value,
                   "x-sessionkv-route-reason": "no prefill engine reachable; decode only"}
        return await self._answer(request, client, plan, Role.DECODE,
                                  _json.encode(d_body), headers)

    async def _restore_on_decode(self, client: ClientRequest, plan: RoutePlan
                                 ) -> dict[str, Any] | None:
        """Have D restore the prompt's prefix from its host tier, for P to pull; P's
        new parameters (D's handle of the restored blocks), or None.

        D is sent that prefix as a one-token session turn: its connector restores the
        blocks from host (priced against recomputing them, as for any turn), holds
        them under a fresh lease and answers with their handle; P verifies and prices
        the pull as for any handle.  Any failure costs speed only: P then prefills
        without the handle."""
        ids = plan.prompt_token_ids or []
        # D computes at least the last token it is sent: one past the restored prefix.
        upto = min(plan.restore_tokens, len(ids) - 1)
        if upto <= 0 or not client.session_id:
            return None
        body = handoff.restore_body(client.body.get("model"), ids[:upto + 1],
                                    client.session_id, plan.tenant)
        outcome, params = "failed", None
        try:
            resp = await self._sender.post(plan.decode, "/v1/completions",
                                           _json.encode(body), f"{client.request_id}-restore")
            data = await resp.read()
            if resp.status == 200:
                handle = handoff.handle_of_answer(handoff.decode_answer(data)[1])
                if handle is not None:
                    outcome, params = self._restored_handle(plan.decode, handle)
        except (EngineUnreachable, ApiError, PayloadError, msgspec.DecodeError,
                AttributeError) as exc:
            logger.warning("host-tier restore request_id=%s engine=%s failed: %r",
                           client.request_id, plan.decode.url, exc)
        self._metrics.host_tier_restores.labels(outcome).inc()
        return params

    def _restored_handle(self, decode: Engine, handle: Any
                         ) -> tuple[str, dict[str, Any] | None]:
        """(outcome, P's parameters) for a restore's handle."""
        margin_s = self._router.params.handle_expiry_margin_s
        # A lease shorter than the margin gives a handle P would refuse.
        if not handle_expired(handle.expires_at_unix_s, time.time(), margin_s):
            return "handle", handle.prefill_params()
        if not decode.restore_handles_expire:
            decode.restore_handles_expire = True
            logger.warning(
                "host-tier restores on %s stop: its handles expire within the proxy's "
                "handle_expiry_margin_s (%.0f s); its session_lease_s must be longer for "
                "P to pull restored KV", decode.url, margin_s)
        return "expired", None

    def _remember_session(self, plan: RoutePlan, client: ClientRequest, answer: Answer
                          ) -> None:
        """Store the session under the D that answered, behind the answer."""
        session_id = client.session_id
        try:
            handle = handoff.handle_of_answer(answer.params)
        except PayloadError as exc:   # a D speaking another protocol version
            logger.warning("session %s: D's handle not stored: %s", session_id, exc)
            handle = None
        try:
            self._router.sessions.save_later(SessionRecord(
                session_id=session_id, last_decode=answer.engine.url, handle=handle,
                prompt_keys=plan.prompt_keys, tenant=plan.tenant))
        except Exception as exc:  # the answer is out; a lost record costs speed only
            self._metrics.errors.labels("session_store").inc()
            logger.warning("session %s not stored: %r", session_id, exc)


