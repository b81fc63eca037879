"""Every Redis key this project uses, named here only, and the Redis URL that says
"one Redis" or "a Redis Cluster".

The engines' publisher (``publisher.py``) and the proxy (its index, session records
and the routing read) share this layout; it is pure (standard library only) so the
proxy imports it without torch.

All keys of one deployment carry one hash tag, ``{<namespace>}``.  Redis Cluster
hashes only the tag, so every key of a deployment sits in one slot: every Lua script
and multi-key command is legal there, and the routing read (the session record, the
engines' published handle and the index's prefix match in one script) stays one
round trip, on one Redis as on a cluster.  The price is that one deployment's keys
live on one master and its replicas: a cluster gives failover, not more write
throughput to one deployment (deployments with other namespaces land on other
slots).

Layout (``P = "{<namespace>}:"``; a *session key* is ``protocol.session_store_key``):

* ``P handle:<session key>``: the engines' published handle (``SET PX``, single use);
* ``P sess:<session key>``: the proxy's session record (``SET PX``);
* ``P wd:<session key>``: ZSET of the hold tokens of the session's holds D ended
  before their lease (``protocol.HandleWithdrawal``), scored by when each stops
  mattering (unix ms), trimmed on write and expiring with the lease;
* ``P epochs``: HASH engine URL -> when that engine process started (unix ns);
* ``P rk:<request key hex>``: HASH ``<engine>\\0<tier>`` -> how many of that engine
  and tier's engine hashes map to the request key (lookups read only these);
* ``P eh:<tier>:<engine>``: HASH engine hash -> request key hex;
* ``P lru:<tier>:<engine>``: ZSET engine hash -> store tick;
* ``P tiers:<engine>``, ``P engines``: SETs; ``P tick``: the store counter.

The index's Lua scripts that walk an engine's tiers build the ``eh:`` and ``lru:``
names inside Redis from the same infixes (``index/redis.py``); a test checks that the
keys they write are the ones named here.
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["DEFAULT_NAMESPACE", "RedisKeys", "RedisTarget", "check_namespace",
           "check_redis_settings", "parse_redis_url"]

DEFAULT_NAMESPACE = "sessionkv"

# ``redis+cluster://host:port`` (and ``rediss+cluster://`` for TLS) asks for cluster
# mode; redis-py's own URL has the plain scheme.
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_PLAIN_SCHEMES = ("redis", "rediss", "unix")


def check_namespace(namespace: object) -> str:
    """The namespace, or ValueError: non-empty, and no braces (it becomes the tag)."""
    if not isinstance(namespace, str) or not namespace or "{" in namespace \
            or "}" in namespace:
        raise ValueError(f"must be a non-empty string without braces, got {namespace!r}")
    return namespace


class RedisKeys:
    """The key names of one deployment (``namespace``)."""

    __slots__ = ("namespace", "prefix", "request_key_prefix")

    def __init__(self, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.namespace = check_namespace(namespace)
        self.prefix = "{" + namespace + "}:"
        self.request_key_prefix = self.prefix + "rk:"

    # -- sessions (engines and proxy) -------------------------------------------
    def handle(self, session_key: str) -> str:
        return f"{self.prefix}handle:{session_key}"

    def session(self, session_key: str) -> str:
        return f"{self.prefix}sess:{session_key}"

    def withdrawn(self, session_key: str) -> str:
        return f"{self.prefix}wd:{session_key}"

    @property
    def epochs(self) -> str:
        return self.prefix + "epochs"

    @property
    def handles_pattern(self) -> str:
        return self.prefix + "handle:*"

    @property
    def sessions_pattern(self) -> str:
        return self.prefix + "sess:*"

    # -- the index (proxy) ------------------------------------------------------
    def request_key(self, request_key_hex: str) -> str:
        return self.request_key_prefix + request_key_hex

    def engine_hashes(self, tier: str, engine: str) -> str:
        return f"{self.prefix}eh:{tier}:{engine}"

    def lru(self, tier: str, engine: str) -> str:
        return f"{self.prefix}lru:{tier}:{engine}"

    def tiers(self, engine: str) -> str:
        return f"{self.prefix}tiers:{engine}"

    @property
    def engines(self) -> str:
        return self.prefix + "engines"

    @property
    def tick(self) -> str:
        return self.prefix + "tick"


class RedisTarget:
    """A parsed Redis URL: ``cluster`` and the URL in the form redis-py takes."""

    __slots__ = ("cluster", "url")

    def __init__(self, cluster: bool, url: str) -> None:
        self.cluster, self.url = cluster, url


def parse_redis_url(url: object) -> RedisTarget:
    """``redis://``, ``rediss://``, ``unix://`` (one Redis) or ``redis+cluster://`` /
    ``rediss+cluster://`` (a Redis Cluster: any of its nodes; the client finds the
    rest).  ValueError names what is wrong."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"must be a redis:// or redis+cluster:// URL, got {url!r}")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme in _PLAIN_SCHEMES:
        return RedisTarget(False, url)
    if scheme not in _CLUSTER_SCHEMES:
        raise ValueError(f"scheme must be one of {[*_PLAIN_SCHEMES, *_CLUSTER_SCHEMES]}, "
                         f"got {scheme!r}")
    plain = f"{_CLUSTER_SCHEMES[scheme]}://{rest}"
    parts = urlsplit(plain)
    if not parts.hostname:
        raise ValueError(f"a cluster URL names one node as host:port, got {url!r}")
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 only, got {parts.path!r}")
    return RedisTarget(True, plain)


def check_redis_settings(url: str | None, namespace: str, key_prefix: str = "") -> None:
    """Start-up check of a config's ``redis_url`` (optional) and ``redis_namespace``;
    the ValueError names the key as the config spells it (``key_prefix`` + name)."""
    if url is not None:
        try:
            parse_redis_url(url)
        except ValueError as exc:
            raise ValueError(f"{key_prefix}redis_url {exc}") from None
    try:
        check_namespace(namespace)
    except ValueError as exc:
        raise ValueError(f"{key_prefix}redis_namespace {exc}") from None
