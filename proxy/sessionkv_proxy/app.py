"""The proxy's lifecycle: build its services whole, serve, shut down in order.

:class:`ProxyApp` opens the clients, the KV-event consumer, the early-decode
sockets and the scraper in :meth:`~ProxyApp.start`, asks the engines what it must
know before serving (:mod:`sessionkv_proxy.startup_checks`), and only then binds
the routes to a complete :class:`Services`: the generation endpoints to
:class:`~sessionkv_proxy.turn.TurnRunner`, the others to
:class:`~sessionkv_proxy.ops.Ops`.  Each step of start-up registers its own undoing,
so :meth:`~ProxyApp.stop` (also after a start that failed half way) undoes what was
done, newest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import msgspec

from vllm_sessionkv.wire.early_decode import EarlyDecodeSender

from sessionkv_proxy.auth import OPEN_PATHS, requiring_key
from sessionkv_proxy.config import ProxyConfig
from sessionkv_proxy.consumer import EngineSource, KVEventConsumer
from sessionkv_proxy.engine_set import EngineSet
from sessionkv_proxy.engines import EnginePool
from sessionkv_proxy.errors import ApiError, error_response
from sessionkv_proxy.handle_subscriber import HandleSubscribers
from sessionkv_proxy.index.base import KVIndex, PublishedHandles
from sessionkv_proxy.index.factory import make_index
from sessionkv_proxy.metrics import ProxyMetrics
from sessionkv_proxy.ops import Ops
from sessionkv_proxy.redis_link import RedisLink
from sessionkv_proxy.relay import EngineSender
from sessionkv_proxy.resent_answers import ResentAnswers
from sessionkv_proxy.route_types import Role
from sessionkv_proxy.router import Router
from sessionkv_proxy.server import HttpServer, Request, Response
from sessionkv_proxy.startup_checks import ModelCatalog
from sessionkv_proxy.tasks import cancel_all
from sessionkv_proxy.turn import TurnRunner
from sessionkv_proxy.upstream import UpstreamPool

__all__ = ["ProxyApp", "Services", "create_app", "serve"]

logger = logging.getLogger("sessionkv_proxy.app")

_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class Services:
    """Everything a started proxy serves with.  ``redis`` is None without Redis,
    ``handles`` with an index that cannot keep published handles; never because
    start-up has not got there.  The early-decode sender, the KV-event consumer and
    the handle subscribers run with no engine of theirs too: one added later may
    have a socket for them (``engine_set.py``)."""

    config: ProxyConfig
    pool: EnginePool
    index: KVIndex
    metrics: ProxyMetrics
    redis: RedisLink | None
    http: aiohttp.ClientSession   # control plane: scrape, models, admin
    upstream: UpstreamPool        # the request hot path, /tokenize too
    router: Router
    early: EarlyDecodeSender
    consumer: KVEventConsumer
    handles: HandleSubscribers | None   # Ds' handle channels (no Redis needed)
    models: ModelCatalog
    turns: TurnRunner
    ops: Ops
    engine_set: EngineSet             # engines added and removed while running


class ProxyApp:
    """The proxy: :meth:`start`, then :meth:`stop`."""

    services: Services   # set, whole, by a start that succeeded

    def __init__(self, config: ProxyConfig, index: KVIndex | None = None) -> None:
        self.config = config
        self.metrics = ProxyMetrics(redis=index is None and config.index.backend == "redis")
        redis = None
        if index is None:
            index, redis = make_index(
                config, on_error=self._count_error,
                on_fallback=lambda op: self.metrics.redis_fallbacks.labels(op).inc(),
                on_republish=lambda: self.metrics.redis_republishes.inc())
        self.index, self.redis = index, redis
        self.pool = EnginePool.from_configs(config.engines)
        self._undo = contextlib.AsyncExitStack()
        if redis is not None:
            self._undo.push_async_callback(redis.aclose)
        self._undo.push_async_callback(index.close)
        self._grace_s = 30.0

    def _count_error(self, kind: str) -> None:
        self.metrics.errors.labels(kind).inc()

    async def start(self) -> None:
        """Open the clients, the index consumer and the scraper, then listen."""
        config = self.config
        services = await self._open_services()
        self._start_background(services)
        routes = _routes(services)
        server = HttpServer(routes, error_response=_server_error,
                            max_body_bytes=config.max_body_bytes, limits=config.front)
        await server.start(config.host, config.port, ssl=config.ssl_context())
        self._undo.push_async_callback(lambda: server.stop(self._grace_s))
        self.services = services
        logger.info("proxy ready on %s://%s:%d (API key %s): %d prefill, %d decode "
                    "engines, index=%s, policy=%s",
                    "https" if config.tls_cert_file else "http", config.host, config.port,
                    "required" if config.api_key else "not asked", len(config.prefill),
                    len(config.decode), config.index.backend, config.routing.policy)

    async def _open_services(self) -> Services:
        config, undo = self.config, self._undo
        # This session scrapes /metrics and discovers models.  Its DNS answers live
        # 10 s (aiohttp's default): after an engine pod restarts with a new IP, its
        # scrapes go to the old address (refused ones count against its health) only
        # until the cached answer expires (it was 300 s).  The request path resolves
        # on each new connection.
        http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=10, keepalive_timeout=60),
            headers=_engine_auth(config),
            json_serialize=lambda o: _json.encode(o).decode(),
            timeout=aiohttp.ClientTimeout(total=config.request_timeout_s,
                                          sock_connect=config.connect_timeout_s))
        undo.push_async_callback(http.close)
        upstream = UpstreamPool(connect_timeout_s=config.connect_timeout_s,
                                request_timeout_s=config.request_timeout_s,
                                engine_api_key=config.engine_api_key)
        undo.push_async_callback(upstream.close)
        router = Router(config, self.pool, self.index, upstream, on_error=self._count_error)
        undo.push_async_callback(functools.partial(_flush, router))
        early = await self._open_early_decode()
        consumer = self._start_consumer(router)
        handles = self._start_handle_channels()
        models = ModelCatalog(http, [e.url for e in self.pool.by_role(Role.DECODE)
                                     + self.pool.by_role(Role.PREFILL)])
        await models.refresh()
        await router.prompt_keys.check_local()
        sender = EngineSender(upstream=upstream, pool=self.pool,
                              alternative=router.alternative, metrics=self.metrics,
                              connect_retries=config.connect_retries,
                              request_timeout_s=config.request_timeout_s,
                              return_kv_transfer_params=config.return_kv_transfer_params)
        resent = (ResentAnswers(router.prompt_keys, config.resend_answer_ids_max_sessions,
                                self.metrics) if config.resend_answer_ids else None)
        turns = TurnRunner(config=config, router=router, sender=sender, early=early,
                           metrics=self.metrics, model_ids=lambda: models.ids,
                           resent=resent)
        engine_set = EngineSet(config=config, pool=self.pool, index=self.index,
                               metrics=self.metrics, consumer=consumer, handles=handles,
                               early=early, models=models)
        ops = Ops(config=config, pool=self.pool, index=self.index, metrics=self.metrics,
                  router=router, sender=sender, http=http, models=models,
                  consumer=consumer, handles=handles, redis=self.redis,
                  engine_set=engine_set)
        return Services(config=config, pool=self.pool, index=self.index,
                        metrics=self.metrics, redis=self.redis, http=http,
                        upstream=upstream, router=router, early=early, consumer=consumer,
                        handles=handles, models=models, turns=turns, ops=ops,
                        engine_set=engine_set)

    async def _open_early_decode(self) -> EarlyDecodeSender:
        # Made with no endpoint too: a decode engine added later may have one.
        endpoints = [e.early_decode for e in self.config.decode if e.early_decode]
        early = EarlyDecodeSender(endpoints, secret=self.config.side_port_secret)
        self._undo.callback(early.close)
        if endpoints:
            await _wait_connected(early, endpoints, min(2.0, self.config.connect_timeout_s))
        return early

    def _start_consumer(self, router: Router) -> KVEventConsumer:
        # Started with no source too: an engine added later may publish.
        sources = [EngineSource(engine=e.url, endpoint=e.kv_events,
                                replay_endpoint=e.kv_events_replay, topic=e.kv_events_topic)
                   for e in self.config.engines if e.kv_events]
        consumer = KVEventConsumer(sources, self.index, block_size=router.block_size)
        consumer.start()
        self._undo.push_async_callback(consumer.stop)
        return consumer

    def _start_handle_channels(self) -> HandleSubscribers | None:
        channels = {e.url: e.handle_channel for e in self.config.decode if e.handle_channel}
        if not channels and not isinstance(self.index, PublishedHandles):
            return None   # an index that cannot keep them: no engine may name one
        handles = HandleSubscribers(channels, self.index, self.config.side_port_secret)
        self.metrics.registry.register(handles.collector())
        handles.start()
        self._undo.push_async_callback(handles.stop)
        return handles

    def _start_background(self, services: Services) -> None:
        config, count = self.config, self._count_error
        tasks = [asyncio.create_task(self.pool.scrape_forever(
            services.http, config.metrics_scrape_interval_s,
            config.metrics_scrape_timeout_s,
            on_slow=lambda e: count("metrics_scrape_slow"), stall_s=config.engine_stall_s,
            on_stall=lambda e: count("engine_stalled")), name="metrics-scraper")]
        if config.engines_file:
            tasks.append(asyncio.create_task(services.engine_set.watch_file(
                config.engines_file, config.engines_file_poll_s), name="engines-file"))
        maintain = getattr(self.index, "maintain", None)
        if maintain is not None:
            tasks.append(asyncio.create_task(maintain(), name="index-upkeep"))
        self._undo.push_async_callback(functools.partial(cancel_all, tasks))

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop accepting, finish in-flight requests up to ``grace_s``, close all."""
        self._grace_s = grace_s
        await self._undo.aclose()


def _routes(services: Services) -> dict[str, dict[str, Callable[[Request], Awaitable]]]:
    turns, ops = services.turns, services.ops
    # The generation endpoints are bound without a wrapper (but the API key's, when
    # set): ``serve`` answers every error itself, and a frame less is less CPU on
    # every request.
    routes = {
        "/v1/completions": {"POST": functools.partial(
            turns.serve, endpoint="completions", path="/v1/completions", is_chat=False)},
        "/v1/chat/completions": {"POST": functools.partial(
            turns.serve, endpoint="chat", path="/v1/chat/completions", is_chat=True)},
        "/v1/models": {"GET": _answering_errors(ops.models)},
        "/tokenize": {"POST": _answering_errors(ops.forward_to_decode)},
        "/detokenize": {"POST": _answering_errors(ops.forward_to_decode)},
        "/admin/reset": {"POST": _answering_errors(ops.reset)},
        "/admin/engines": {"GET": _answering_errors(ops.engines),
                           "PUT": _answering_errors(ops.engines)},
        "/health": {"GET": _answering_errors(ops.health)},
        "/metrics": {"GET": _answering_errors(ops.metrics)}}
    key = services.config.api_key
    if key:
        refused = services.metrics.unauthorized
        for path, methods in routes.items():
            if path not in OPEN_PATHS and not path.startswith("/admin/"):
                for method, handler in methods.items():
                    methods[method] = requiring_key(
                        handler, key, lambda p: refused.labels(p).inc())
    return routes


def _engine_auth(config: ProxyConfig) -> dict[str, str] | None:
    """The header every control-plane call to an engine carries (vLLM's --api-key)."""
    key = config.engine_api_key
    return {"Authorization": f"Bearer {key}"} if key else None


def _answering_errors(handler: Callable[[Request], Awaitable[Response]]
                      ) -> Callable[[Request], Awaitable[Response]]:
    async def answered(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as err:
            return error_response(err)
    return answered


def _server_error(status: int, message: str) -> Response:
    return error_response(ApiError(status, message))


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


async def _flush(router: Router) -> None:
    try:   # the writes behind the last requests
        await asyncio.wait_for(router.sessions.flush(), 10.0)
    except asyncio.TimeoutError:
        logger.warning("writes behind requests not finished at stop")


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
