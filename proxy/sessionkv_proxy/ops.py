"""The operator and model-level endpoints: ``/v1/models``, ``/tokenize`` and
``/detokenize``, ``/health``, ``/metrics`` and ``/admin/reset``."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_sessionkv.wire.redis_keys import RedisKeys

from sessionkv_proxy import admin
from sessionkv_proxy.config import EngineConfig, ProxyConfig
from sessionkv_proxy.consumer import KVEventConsumer
from sessionkv_proxy.engine_set import EngineSet
from sessionkv_proxy.engines import EnginePool
from sessionkv_proxy.errors import ApiError, error_response
from sessionkv_proxy.handle_subscriber import HandleSubscribers
from sessionkv_proxy.index.base import KVIndex
from sessionkv_proxy.metrics import ProxyMetrics
from sessionkv_proxy.redis_link import LinkState, RedisLink
from sessionkv_proxy.relay import EngineSender, Load
from sessionkv_proxy.route_types import Role
from sessionkv_proxy.request import new_request_id
from sessionkv_proxy.router import DEFAULT_OUTPUT_ESTIMATE, Router
from sessionkv_proxy.server import Request, Response
from sessionkv_proxy.startup_checks import ModelCatalog

__all__ = ["Ops"]

_json = msgspec.json.Encoder()
# An event stream whose newest batch arrived later than this after it was published
# makes /health say "degraded": the index lags the engines.
_EVENT_LAG_DEGRADED_S = 5.0
# A model-level utility's load on D: no prompt known, the default output estimate.
_UTILITY_LOAD = Load(decode_tokens=DEFAULT_OUTPUT_ESTIMATE,
                     decode_work_tokens=DEFAULT_OUTPUT_ESTIMATE)


class Ops:
    """Handlers for the endpoints that are not generation."""

    def __init__(self, *, config: ProxyConfig, pool: EnginePool, index: KVIndex,
                 metrics: ProxyMetrics, router: Router, sender: EngineSender,
                 http: aiohttp.ClientSession, models: ModelCatalog,
                 consumer: KVEventConsumer | None, handles: HandleSubscribers | None,
                 redis: RedisLink | None, engine_set: EngineSet | None = None) -> None:
        self._config = config
        self._pool = pool
        self._index = index
        self._metrics = metrics
        self._router = router
        self._sender = sender
        self._http = http
        self._models = models
        self._consumer = consumer
        self._handles = handles
        self._redis = redis
        self._engine_set = engine_set

    async def models(self, request: Request) -> Response:
        if not self._models.body:
            await self._models.refresh()
        if not self._models.body:
            return error_response(ApiError(503, "no engine answered /v1/models"))
        return Response(200, self._models.body)

    async def forward_to_decode(self, request: Request) -> Response:
        """Model-level utilities (``/tokenize``, ``/detokenize``): every engine serves
        the same model, so a D answers them as it would directly, through the same
        send, retry and relay as a decode-only request."""
        engine = self._router.alternative(Role.DECODE, set())
        if engine is None:
            raise ApiError(503, "no decode engine available", type_="server_error")
        answer = await self._sender.answer(
            request, Role.DECODE, engine, request.path, request.body,
            new_request_id(request.headers), _UTILITY_LOAD, {}, stream=False)
        return answer.response

    def health_report(self) -> tuple[int, dict[str, Any]]:
        """What /health answers: 200 while the proxy can serve (a decode engine takes
        requests), 503 otherwise; ``status`` is "degraded" with each problem named
        when it serves with less than it should (an engine out, Redis down, events
        lagging)."""
        now = time.monotonic()
        problems: list[str] = []
        engines = []
        for e in self._pool.engines:
            engine_state = "up" if e.available else "stalled" if e.healthy else "unreachable"
            if engine_state != "up":
                problems.append(f"{e.role.value} engine {e.url} {engine_state}")
            engines.append({"url": e.url, "role": e.role.value, "state": engine_state,
                            "in_flight": e.active_requests,
                            "last_answer_s_ago": round(now - e.last_alive_s, 1)})
        available = {role.value: sum(e.available for e in self._pool.by_role(role))
                     for role in Role}
        if self._engine_set is not None:
            self._engine_set.update_gauges()   # forgets engines that finished draining
        report: dict[str, Any] = {"healthy": available, "engines": engines,
                                  "draining": [{"url": e.url, "role": e.role.value,
                                                "in_flight": e.active_requests}
                                               for e in self._pool.draining.values()]}
        if self._redis is not None:
            report["redis"] = self._redis.health()
            if self._redis.state is not LinkState.UP:
                problems.append(f"redis {self._redis.state.value}: routing from this "
                                "replica's own index and sessions")
        if self._consumer is not None and self._consumer.subscribers:
            report["events"] = self._event_health(problems)
            report["block_size"] = self._router.block_size.report()
            problems.extend(self._router.block_size.problems())
        if self._handles is not None and self._handles.subscribers:
            report["handle_channel"], channel_problems = self._handles.health()
            problems += channel_problems
        serving = available["decode"] > 0
        report["status"] = "unavailable" if not serving else "degraded" if problems else "ok"
        report["problems"] = problems
        return (200 if serving else 503), report

    def _event_health(self, problems: list[str]) -> dict[str, Any]:
        events = {}
        for engine, stats in self._consumer.stats().items():
            events[engine] = {"last_lag_s": round(stats.last_lag_s, 3),
                              "batches_lost": stats.batches_lost,
                              "index_errors": stats.index_errors,
                              "dropped": dict(stats.dropped_by_reason)}
            if stats.last_lag_s > _EVENT_LAG_DEGRADED_S:
                problems.append(f"kv events of {engine} lag {stats.last_lag_s:.1f} s")
        return events

    async def health(self, request: Request) -> Response:
        status, report = self.health_report()
        return Response(status, _json.encode(report))

    async def metrics(self, request: Request) -> Response:
        metrics = self._metrics
        try:
            metrics.index_blocks.set(await self._index.size())
        except Exception:
            metrics.errors.labels("index_size").inc()
        if self._consumer is not None:
            for engine, stats in self._consumer.stats().items():
                metrics.event_lag_s.labels(engine).set(stats.last_lag_s)
                metrics.events.labels(engine).set(stats.events_applied)
                metrics.replays.labels(engine).set(stats.replays)
                metrics.resets.labels(engine).set(stats.resets)
                metrics.undecodable.labels(engine).set(stats.batches_undecodable)
                for reason, count in stats.dropped_by_reason.items():
                    metrics.dropped.labels(engine, reason).set(count)
        if self._engine_set is not None:
            self._engine_set.update_gauges()
        for engine in [*self._pool.engines, *self._pool.draining.values()]:
            metrics.in_flight.labels(engine.url).set(engine.active_requests)
        for engine in self._pool.engines:
            metrics.engine_available.labels(engine.url).set(1 if engine.available else 0)
        if self._redis is not None:
            metrics.redis_up.set(1 if self._redis.available else 0)
        return Response(200, generate_latest(metrics.registry),
                        content_type=CONTENT_TYPE_LATEST)

    async def reset(self, request: Request) -> Response:
        """``POST /admin/reset`` (:mod:`sessionkv_proxy.admin`)."""
        admin.authorize(self._config.admin_token, request)
        timeout_s = admin.timeout_from_query(request.query)
        pattern = RedisKeys(self._config.index.redis_namespace).handles_pattern
        dropped = await admin.withdraw_sessions(self._router.sessions.flush, self._index,
                                                self._redis, pattern)
        status, body = await admin.reset_engines(
            self._http, [e.url for e in self._pool.engines], timeout_s)
        # The routes it remembers name prefixes the engines no longer hold: kept, they
        # sent long prompts to D alone as if D still had them.
        self._router.recent.clear()
        body["dropped"] = dropped
        return Response(status, _json.encode(body))

    async def engines(self, request: Request) -> Response:
        """``GET /admin/engines``: the engine list and the engines draining.
        ``PUT /admin/engines`` with ``{"engines": [...]}`` (each as in the config):
        make that the list (``engine_set.py``); 400 naming what is wrong, the set
        unchanged.  Admin rule: loopback, or ``admin_token``."""
        admin.authorize(self._config.admin_token, request)
        engine_set = self._engine_set
        if request.method == "GET":
            return Response(200, _json.encode({
                "engines": engine_set.configs,
                "draining": sorted(self._pool.draining)}))
        try:
            body = msgspec.json.decode(request.body)
            if not isinstance(body, dict) or "engines" not in body:
                raise ValueError('the body must be {"engines": [...]}')
            configs = msgspec.convert(body["engines"], list[EngineConfig])
        except ValueError as exc:   # msgspec's decode and validation errors are ones
            self._metrics.engine_set_changes.labels("invalid").inc()
            raise ApiError(400, f"engine list not applied: {exc}", param="engines") from None
        try:
            result = await engine_set.apply(configs)   # counts what it refuses
        except ValueError as exc:
            raise ApiError(400, f"engine list not applied: {exc}", param="engines") from None
        return Response(200, _json.encode(result))
