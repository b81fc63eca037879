"""The index a proxy runs on, from its config: in-process, or Redis with the
in-process copy to fall back on (and the Redis link it and the published handles
share)."""

from __future__ import annotations

from collections.abc import Callable

from vllm_sessionkv.wire.redis_keys import RedisKeys

from sessionkv_proxy.config import ProxyConfig
from sessionkv_proxy.index.base import KVIndex
from sessionkv_proxy.index.memory import MemoryIndex
from sessionkv_proxy.redis_link import RedisLink, make_redis_client

__all__ = ["make_index"]


def make_index(config: ProxyConfig, on_error: Callable[[str], None],
               on_fallback: Callable[[str], None], on_republish: Callable[[], None]
               ) -> tuple[KVIndex, RedisLink | None]:
    """(index, Redis link or None).  ``on_error`` counts a Redis error by kind,
    ``on_fallback`` an operation served from the in-process copy, ``on_republish``
    a resync of that copy to Redis."""
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
                     retry_interval_s=cfg.redis_retry_interval_s, on_error=on_error,
                     home_key=keys.engines)
    remote = RedisIndex(link.client, namespace=keys.namespace,
                        max_blocks_per_slot=cfg.max_blocks_per_engine)
    index = FallbackIndex(remote, local, link, engines=[e.url for e in config.engines],
                          on_fallback=on_fallback, on_republish=on_republish)
    return index, link
