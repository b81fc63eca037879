"""Typed proxy configuration: a JSON file and/or CLI flags, validated at start-up.

Errors name the bad key (msgspec's path, e.g. ``$.engines[1].role``) and the proxy
exits before binding its port.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec

from vllm_sessionkv.wire import side_auth
from vllm_sessionkv.wire.redis_keys import DEFAULT_NAMESPACE, check_redis_settings

# The proxy's one role type (re-exported), defined with the routing types.
from sessionkv_proxy.route_types import Role
from sessionkv_proxy.server import FrontLimits

__all__ = ["ConfigError", "EngineConfig", "IndexConfig", "ProxyConfig", "Role",
           "RoutingConfig", "load_config", "parse_engine_spec"]


# Python's logging levels, as log_level takes them (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    pass


# Secrets a config need not hold: where the key is absent, load_config takes it from
# this environment variable (so it stays off command lines and out of config files).
SECRET_ENV = {"api_key": "SESSIONKV_PROXY_API_KEY",
              "engine_api_key": "SESSIONKV_ENGINE_API_KEY",
              "side_port_secret": side_auth.SECRET_ENV}


def _check_bearer_token(value: str | None, key: str) -> None:
    """A token sent in an Authorization header: visible ASCII, no spaces."""
    if value is not None and not (value and all(33 <= ord(c) < 127 for c in value)):
        raise ValueError(f"{key} must be non-empty visible ASCII without spaces")




class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    url: str
    role: Role
    # KV events publisher of this engine (ZMQ PUB) and its replay socket (ROUTER).
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = "kv-events"
    # A decode engine's early-decode socket (its connector's early_decode_port, ZMQ
    # PULL): with it, a disaggregated request goes to D at the same time as to P, and
    # P's parameters follow here (vllm_sessionkv/early_decode.py).
    early_decode: str | None = None
    # A decode engine's handle channel (its connector's handle_channel_port, ZMQ
    # PUB): its end-of-turn session handles, streamed turns' included, reach this
    # proxy without Redis (see handle_subscriber.py).
    handle_channel: str | None = None

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://: {self.url!r}")
        for key in ("kv_events", "kv_events_replay", "early_decode", "handle_channel"):
            endpoint = getattr(self, key)
            if endpoint is not None and ("*" in endpoint or "0.0.0.0" in endpoint):
                # The engine's bind address, copied: the proxy connects, so it needs
                # an address of the engine's host.
                raise ValueError(f"{key} must name the engine's host, not a wildcard: "
                                 f"{endpoint!r}")
        for key in ("early_decode", "handle_channel"):
            endpoint = getattr(self, key)
            if endpoint is None:
                continue
            if self.role is not Role.DECODE:
                raise ValueError(f"{key} is for decode engines; {self.url} is "
                                 f"{self.role.value}")
            if not endpoint.startswith("tcp://"):
                raise ValueError(f"{key} must be a tcp://HOST:PORT endpoint, got "
                                 f"{endpoint!r}")


class IndexConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: str = "memory"          # "memory" (in-process) or "redis"
    # redis://HOST:PORT/DB for one Redis; redis+cluster://HOST:PORT (any node) for a
    # Redis Cluster (rediss:// and rediss+cluster:// with TLS).
    redis_url: str | None = None
    # The hash tag of every key (vllm_sessionkv/wire/redis_keys.py), shared by all replicas
    # of one deployment and by its engines (their sessionkv.redis_namespace).
    redis_namespace: str = DEFAULT_NAMESPACE
    # Bound on index entries per engine and tier; the oldest are dropped first.
    max_blocks_per_engine: int = 1_000_000
    # Bound on the session handles kept from the engines' handle channels (about 3 KB
    # each at a 4K-token context); the oldest are dropped first.
    max_published_handles: int = 50_000
    # Redis is an accelerator (see redis_link.py): each call waits at most about
    # twice this; after redis_failures_to_open failures in a row the proxy stops
    # calling it and routes from its own copy, pinging every redis_retry_interval_s
    # (doubling up to 10 s) until it answers, then re-publishes what it missed.
    redis_timeout_s: float = 0.25
    redis_failures_to_open: int = 3
    redis_retry_interval_s: float = 1.0
    # Connections to Redis; a request waits for a free one (within its deadline).
    redis_max_connections: int = 256

    def __post_init__(self):
        for key in ("redis_timeout_s", "redis_retry_interval_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"index.{key} must be > 0")
        for key in ("redis_failures_to_open", "redis_max_connections",
                    "max_blocks_per_engine", "max_published_handles"):
            if getattr(self, key) < 1:
                raise ValueError(f"index.{key} must be >= 1")
        if self.backend not in ("memory", "redis"):
            raise ValueError(f"index.backend must be 'memory' or 'redis', got {self.backend!r}")
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("index.redis_url is required when index.backend is 'redis'")
        check_redis_settings(self.redis_url, self.redis_namespace, "index.")


class RoutingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # "cost": KV- and load-aware routing; "round_robin": baseline for benchmarks.
    policy: str = "cost"
    # Parameters passed to the routing policy (see policy.RoutingParams).
    params: dict[str, Any] = msgspec.field(default_factory=dict)
    # How long the router credits a prefix to the workers it just sent it to, before
    # their KV events confirm it (see recent.py); 0 turns it off.
    recent_routes_ttl_s: float = 30.0

    def __post_init__(self):
        if self.recent_routes_ttl_s < 0:
            raise ValueError("routing.recent_routes_ttl_s must be >= 0")
        if self.policy not in ("cost", "round_robin"):
            raise ValueError(f"routing.policy must be 'cost' or 'round_robin', got {self.policy!r}")
        from sessionkv_proxy.prices import routing_params_from_config

        routing_params_from_config(self.params)  # fail at start-up, naming the key


class ProxyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engines: list[EngineConfig]
    host: str = "127.0.0.1"
    port: int = 8000
    index: IndexConfig = IndexConfig()
    routing: RoutingConfig = RoutingConfig()
    # Token ids for routing: "engine" asks a P engine's /tokenize (exact by
    # construction); "none" routes on session affinity and load only; a path (the
    # model directory given to `vllm serve`, or its tokenizer.json) tokenizes
    # completions string prompts in the proxy, and renders chat prompts with that
    # directory's chat template, each checked against an engine's /tokenize once
    # (see tokenizer.py and chat_template.py); "text" computes no token ids: the
    # router's keys are blocks of the prompt's text (about 3 characters a token),
    # matched against its own recent routes only, as vllm-router's cache_aware does.
    # That is for pools whose engines publish no KV events (which are keyed by
    # tokens): it saves each request its /tokenize round trip, the engine's
    # API server a request, and the host-tier restore (which needs token ids).
    tokenizer: str = "engine"
    # The engines' KV block size in tokens, which request keys are chained in.  None
    # (the default): learned from the engines' first KV event (block_size.py); a
    # number: used as given, and an engine whose events carry another is not indexed
    # (counted and named in /health).  With "tokenizer": "text" it sizes the text
    # blocks (32 tokens when None).
    block_size: int | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    # The front door's other limits: request line, header fields and count, the
    # deadline for a request's head, keep-alive (server.FrontLimits).
    front: FrontLimits = FrontLimits()
    max_session_id_chars: int = 256
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    # Other workers tried after a connection failure.
    connect_retries: int = 1
    metrics_scrape_interval_s: float = 2.0
    # A scrape slower than this keeps the last load; only refused or broken
    # connections mark an engine unhealthy.
    metrics_scrape_timeout_s: float = 5.0
    session_ttl_s: float = 3600.0
    # A client's X-Session-Hold-S (seconds until its session's next turn; D's
    # retention rule takes it as the hold's lease) is clamped to this before it is
    # forwarded; D clamps it to its retention_max_lease_s too.
    max_session_hold_s: float = 3600.0
    # Headers that name a conversation, checked in this order after the body's
    # prompt_cache_key and before its session_id (case-insensitive).  X-Session-ID is
    # ours; X-Session-Affinity is what opencode and pi-ai send with their session id.
    session_headers: list[str] = msgspec.field(
        default_factory=lambda: ["X-Session-ID", "X-Session-Affinity"])
    # An engine with no sign of life (answer, streamed chunk, metrics scrape) for this
    # long gets no new requests until it answers (0: never); see engines.py.
    engine_stall_s: float = 10.0
    # Admin endpoints (/admin/reset) answer loopback clients, and others that send
    # "Authorization: Bearer <admin_token>" when it is set.
    admin_token: str | None = None
    # Clients must send "Authorization: Bearer <api_key>" on /v1/*, /tokenize,
    # /detokenize and /metrics (auth.py); /health stays open, /admin/* keeps its rule.
    # None: SESSIONKV_PROXY_API_KEY from the environment, else no key is asked.
    api_key: str | None = None
    # Sent as "Authorization: Bearer <engine_api_key>" on every call to an engine
    # (requests, /tokenize, /metrics scrapes, /v1/models, resets), for engines started
    # with vLLM's --api-key.  None: SESSIONKV_ENGINE_API_KEY, else none is sent.
    engine_api_key: str | None = None
    # Authenticates the side ports' messages (vllm_sessionkv/wire/side_auth.py): the
    # pushes to D's early-decode inbox are signed, handle-channel messages without a
    # valid HMAC are dropped.  The engines' side_port_secret must be the same.  None:
    # SESSIONKV_SIDE_PORT_SECRET, else off.
    side_port_secret: str | None = None
    # Serve HTTPS: a PEM certificate (chain) and its private key, loaded at start-up.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # A JSON file holding the engine list (an array of engine objects, as "engines"),
    # read at start-up in place of "engines" and watched: when its content changes, the
    # proxy adds and removes engines without a restart (engine_set.py).
    engines_file: str | None = None
    engines_file_poll_s: float = 2.0
    # Answers keep D's kv_transfer_params (engine ids, NIXL addresses, block ids) only
    # when true, for clients that run their own P/D; by default they are removed.
    return_kv_transfer_params: bool = False
    log_level: str = "INFO"
    # Let D continue from the token P sampled (the engines' first_token_handoff);
    # False asks each P not to export it, so D recomputes the last prompt token.
    first_token_handoff: bool = True
    # Send a chat turn whose previous answer the client re-sends unchanged as token
    # ids, with that answer as the ids D generated (resent_answers.py): D's KV for it
    # stays reusable where the text would tokenize otherwise.  The model then sees
    # its own ids, not the template's tokenization of the text.  Needs tokenizer set
    # to the model directory; remembers the last answer of up to
    # resend_answer_ids_max_sessions sessions.
    resend_answer_ids: bool = False
    resend_answer_ids_max_sessions: int = 10_000

    def __post_init__(self):
        for name in self.__struct_fields__:   # durations, sizes, counts
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        check_engines(self.engines, self.tokenizer)
        if not 0 < self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if not self.engines_file_poll_s > 0:
            raise ValueError("engines_file_poll_s must be > 0")
        if self.tokenizer not in ("engine", "none", "text"):
            from sessionkv_proxy.tokenizer import LocalTokenizer

            LocalTokenizer.load(self.tokenizer)  # fail at start-up, naming the key
        if self.resend_answer_ids and self.tokenizer in ("engine", "none", "text"):
            raise ValueError("resend_answer_ids needs tokenizer set to the model directory "
                             f"(it renders chat prompts in the proxy), got {self.tokenizer!r}")
        if self.resend_answer_ids_max_sessions < 1:
            raise ValueError("resend_answer_ids_max_sessions must be >= 1")
        if self.engine_stall_s < 0:
            raise ValueError("engine_stall_s must be >= 0")
        for name in self.session_headers:
            if not name or not all(c.isalnum() or c in "-_" for c in name):
                raise ValueError(f"session_headers: not a header name: {name!r}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, "
                             f"got {self.log_level!r}")
        _check_bearer_token(self.api_key, "api_key")
        _check_bearer_token(self.engine_api_key, "engine_api_key")
        side_auth.check_secret(self.side_port_secret, "side_port_secret")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_cert_file is not None:
            self.ssl_context()   # fail at start-up, naming the key
        if self.block_size is not None and (self.block_size <= 0 or self.block_size % 16):
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")

    def ssl_context(self):
        """The front door's TLS context (None: plain HTTP)."""
        if self.tls_cert_file is None:
            return None
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_cert_file/tls_key_file: cannot load "
                             f"{self.tls_cert_file} and {self.tls_key_file}: {exc}") from None
        return context

    @property
    def prefill(self) -> list[EngineConfig]:
        return [e for e in self.engines if e.role is Role.PREFILL]

    @property
    def decode(self) -> list[EngineConfig]:
        return [e for e in self.engines if e.role is Role.DECODE]


def check_engines(engines: list[EngineConfig], tokenizer: str) -> None:
    """The rules an engine list meets, at start-up and on each change while running
    (``engine_set.py``); ``ValueError`` naming what is wrong."""
    urls = [e.url for e in engines]
    duplicate = next((u for u in urls if urls.count(u) > 1), None)
    if duplicate is not None:
        raise ValueError(f"engines: {duplicate} is listed twice")
    if not any(e.role is Role.DECODE for e in engines):
        raise ValueError("engines: at least one engine with role 'decode' is required")
    if tokenizer == "text":
        publishing = [e.url for e in engines if e.kv_events]
        if publishing:
            raise ValueError(
                "tokenizer: 'text' keys routing on the prompt's text, which KV "
                f"events (keyed by tokens) never match, but {publishing[0]} "
                "publishes them: use 'engine' or a tokenizer path")


def read_engines_file(path: str, raw: bytes | None = None) -> list[EngineConfig]:
    """The engine list in ``path`` (``raw``: its bytes, already read); ConfigError
    naming the file and the bad entry."""
    try:
        data = json.loads(raw if raw is not None else Path(path).read_bytes())
        return msgspec.convert(data, list[EngineConfig])
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"engines_file {path}: cannot read: {exc}") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"engines_file {path}: invalid engine list: {exc}") from None


def parse_engine_spec(spec: str, role: Role) -> dict[str, Any]:
    """``URL`` or ``url=URL,events=tcp://...,replay=tcp://...,early=tcp://...`` from
    the command line."""
    if "url=" not in spec:
        return {"url": spec, "role": role.value}
    out: dict[str, Any] = {"role": role.value}
    names = {"url": "url", "events": "kv_events", "replay": "kv_events_replay",
             "topic": "kv_events_topic", "early": "early_decode",
             "handles": "handle_channel"}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key not in names:
            raise ConfigError(f"unknown engine field {key!r} in {spec!r}; "
                              f"expected one of {sorted(names)}")
        out[names[key]] = value
    return out


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in override.items()}}
    return override


def load_config(path: str | None, overrides: dict[str, Any]) -> ProxyConfig:
    """Merge a JSON config file with CLI overrides (flags win) and validate."""
    raw: dict[str, Any] = {}
    if path:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config {path} must hold a JSON object")
    for key, value in overrides.items():
        if value is None or (key == "engines" and not value):
            continue
        raw[key] = _merge(raw.get(key), value)
    if raw.get("engines_file"):
        if raw.get("engines"):
            raise ConfigError("engines and engines_file: give one (the file holds the "
                              "engine list)")
        raw["engines"] = msgspec.to_builtins(read_engines_file(raw["engines_file"]))
    for key, variable in SECRET_ENV.items():
        if raw.get(key) is None and os.environ.get(variable):
            raw[key] = os.environ[variable]
    try:
        return msgspec.convert(raw, ProxyConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid proxy config: {exc}") from None
