"""Redis-backed ``KVIndex``, shared by several proxy replicas, on one Redis or a Redis
Cluster.

Every update and every lookup is one Lua script, so each is atomic and costs one
round trip whatever the number of blocks.  The key names are
``vllm_sessionkv.wire.redis_keys``'s: all carry the deployment's hash tag, so on a
cluster every script (the routing read included: record, published handle and
lookup) runs on the one node that holds that slot.  Scripts declare the keys they are
given in ``KEYS`` (the lookup its request keys), so a cluster client sends them to
that node; the ones they derive inside Redis (an engine's tiers, the request keys a
store touches) are in the same slot.

Memory is bounded by ``max_blocks_per_slot`` per engine and tier (the least recently
stored entry is evicted first) and, optionally, by ``entry_ttl_s`` on every key,
refreshed on store, a safety net for engines that vanish without clearing.

Values are exchanged as strings only: Lua numbers are doubles and would round 64-bit
keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from vllm_sessionkv.wire.hashing import RequestKey
from vllm_sessionkv.wire.redis_keys import RedisKeys, parse_redis_url

from .base import EngineHash, PrefixMatch, RouteRead

__all__ = ["DEFAULT_MAX_BLOCKS_PER_SLOT", "RedisIndex", "delete_matching"]

# About the block count of a large engine, so eviction only bites when events
# were lost; Dynamo's approximate router uses the same 2^20 tree bound.
DEFAULT_MAX_BLOCKS_PER_SLOT = 1 << 20

_RELEASE = """
local function release(rk_prefix, slot, rk)
  local k = rk_prefix .. rk
  if redis.call('HINCRBY', k, slot, -1) <= 0 then redis.call('HDEL', k, slot) end
end
"""

# KEYS: eh, lru, tick, tiers, engines
# ARGV: slot, tier, engine, rk_prefix, cap (0: none), ttl_s (0: none), eh1, rk1, ...
_STORE = _RELEASE + """
local eh_key, lru_key = KEYS[1], KEYS[2]
local slot, rk_prefix = ARGV[1], ARGV[4]
local cap, ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local n = (#ARGV - 6) / 2
local base = redis.call('INCRBY', KEYS[3], n) - n
for i = 0, n - 1 do
  local eh, rk = ARGV[7 + 2 * i], ARGV[8 + 2 * i]
  local old = redis.call('HGET', eh_key, eh)
  local k = rk_prefix .. rk
  if old ~= rk then
    if old then release(rk_prefix, slot, old) end
    redis.call('HSET', eh_key, eh, rk)
    redis.call('HINCRBY', k, slot, 1)
  elseif redis.call('HEXISTS', k, slot) == 0 then
    -- the key expired under its TTL while the map still held it: re-hold it
    redis.call('HINCRBY', k, slot, 1)
  end
  if ttl > 0 then redis.call('EXPIRE', k, ttl) end
  redis.call('ZADD', lru_key, base + i + 1, eh)
end
if cap > 0 then
  local over = redis.call('ZCARD', lru_key) - cap
  if over > 0 then
    local victims = redis.call('ZPOPMIN', lru_key, over)
    for j = 1, #victims, 2 do
      local rk = redis.call('HGET', eh_key, victims[j])
      if rk then
        redis.call('HDEL', eh_key, victims[j])
        release(rk_prefix, slot, rk)
      end
    end
  end
end
redis.call('SADD', KEYS[4], ARGV[2])
redis.call('SADD', KEYS[5], ARGV[3])
if ttl > 0 then
  redis.call('EXPIRE', eh_key, ttl)
  redis.call('EXPIRE', lru_key, ttl)
  redis.call('EXPIRE', KEYS[4], ttl)
end
return n
"""

# KEYS: eh, lru.  ARGV: slot, rk_prefix, eh1, eh2, ...
_REMOVE = _RELEASE + """
local removed = 0
for i = 3, #ARGV do
  local rk = redis.call('HGET', KEYS[1], ARGV[i])
  if rk then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
    release(ARGV[2], ARGV[1], rk)
    removed = removed + 1
  end
end
return removed
"""

# KEYS: tiers, engines.  ARGV: prefix, engine, tier ('' = every tier)
_CLEAR = _RELEASE + """
local prefix, engine = ARGV[1], ARGV[2]
local tiers
if ARGV[3] == '' then tiers = redis.call('SMEMBERS', KEYS[1]) else tiers = {ARGV[3]} end
for _, tier in ipairs(tiers) do
  local slot = engine .. '\\0' .. tier
  local eh_key = prefix .. 'eh:' .. tier .. ':' .. engine
  local flat = redis.call('HGETALL', eh_key)
  for j = 2, #flat, 2 do release(prefix .. 'rk:', slot, flat[j]) end
  redis.call('DEL', eh_key, prefix .. 'lru:' .. tier .. ':' .. engine)
  redis.call('SREM', KEYS[1], tier)
end
if redis.call('SCARD', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], engine) end
return #tiers
"""

# KEYS: tiers.  ARGV: prefix, engine, eh
_REQUEST_KEY = """
for _, tier in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local rk = redis.call('HGET', ARGV[1] .. 'eh:' .. tier .. ':' .. ARGV[2], ARGV[3])
  if rk then return rk end
end
return false
"""

# prefix_match(keys, first): the longest held prefix of the request keys
# keys[first..] per slot, as a flat list slot, blocks, slot, blocks...
_PREFIX_MATCH = """
local function prefix_match(keys, first)
  local active, count, n_active = nil, {}, 0
  for i = first, #keys do
    local fields = redis.call('HKEYS', keys[i])
    if active == nil then
      active = {}
      for _, f in ipairs(fields) do active[f] = true; count[f] = 1; n_active = n_active + 1 end
    else
      local present = {}
      for _, f in ipairs(fields) do present[f] = true end
      for f in pairs(active) do
        if present[f] then count[f] = count[f] + 1
        else active[f] = nil; n_active = n_active - 1 end
      end
    end
    if n_active == 0 then break end
  end
  local out = {}
  for f, c in pairs(count) do out[#out + 1] = f; out[#out + 1] = c end
  return out
end
"""

# KEYS: the request keys, in prompt order.
_LOOKUP = _PREFIX_MATCH + """
return prefix_match(KEYS, 1)
"""

# A routing decision's whole read, one round trip.  KEYS: the session record, the
# engines' published handle, the session's withdrawn hold tokens and the engines'
# epochs (all four, or none), then the request keys.  ARGV: number of session keys
# (4 or 0), take ('1': delete the handle as it is read).  Returns {record|nil,
# handle|nil, handle's PTTL when taken (-2: not taken), {slot, blocks, ...},
# {withdrawn token, ...}, {engine url, epoch, ...}}.  Every key is in the index's
# hash tag (redis_keys.py), so on a cluster this is one script on one node, as on one
# Redis.
_ROUTE_READ = _PREFIX_MATCH + """
local record, handle, ttl, withdrawn, epochs = false, false, -2, {}, {}
local n = tonumber(ARGV[1])
if n == 4 then
  record = redis.call('GET', KEYS[1])
  handle = redis.call('GET', KEYS[2])
  if handle and ARGV[2] == '1' then
    ttl = redis.call('PTTL', KEYS[2])
    redis.call('DEL', KEYS[2])
  end
  if record or handle then
    withdrawn = redis.call('ZRANGE', KEYS[3], 0, -1)
    epochs = redis.call('HGETALL', KEYS[4])
  end
end
return {record, handle, ttl, prefix_match(KEYS, n + 1), withdrawn, epochs}
"""

# KEYS: engines.  ARGV: prefix
_SIZE = """
local total = 0
for _, engine in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  for _, tier in ipairs(redis.call('SMEMBERS', ARGV[1] .. 'tiers:' .. engine)) do
    total = total + redis.call('HLEN', ARGV[1] .. 'eh:' .. tier .. ':' .. engine)
  end
end
return total
"""


async def delete_matching(client: aioredis.Redis, pattern: str, batch: int = 500) -> int:
    """Delete every key matching ``pattern`` (SCAN, then UNLINK in batches: no
    blocking KEYS on a large Redis); how many were deleted."""
    deleted, keys = 0, []
    async for key in client.scan_iter(match=pattern, count=batch):
        keys.append(key)
        if len(keys) >= batch:
            deleted += await client.unlink(*keys)
            keys = []
    if keys:
        deleted += await client.unlink(*keys)
    return deleted


def _prefix_match(flat: list) -> PrefixMatch:
    result: PrefixMatch = {}
    for i in range(0, len(flat), 2):
        engine, _, tier = flat[i].decode().partition("\0")
        result.setdefault(engine, {})[tier] = int(flat[i + 1])
    return result


def _eh_str(engine_hash: EngineHash) -> str:
    # Decimal for ints, "x"+hex for bytes: the two forms can never collide.
    if isinstance(engine_hash, int):
        return str(engine_hash)
    return "x" + bytes(engine_hash).hex()


def _rk_str(key: RequestKey) -> str:
    return format(int(key), "x")


class RedisIndex:
    """``KVIndex`` on Redis (>= 6.2 for ``ZPOPMIN`` with a count).

    ``namespace`` separates indexes sharing one Redis (tests use one per test).
    ``max_blocks_per_slot`` bounds each engine/tier (None: unbounded); ``entry_ttl_s``
    expires keys not re-stored for that long (None: never).
    """

    def __init__(self, client: aioredis.Redis, *, namespace: str = "skv",
                 max_blocks_per_slot: int | None = DEFAULT_MAX_BLOCKS_PER_SLOT,
                 entry_ttl_s: int | None = None, owns_client: bool = False) -> None:
        if max_blocks_per_slot is not None and max_blocks_per_slot <= 0:
            raise ValueError(f"max_blocks_per_slot must be positive, got {max_blocks_per_slot}")
        if entry_ttl_s is not None and entry_ttl_s <= 0:
            raise ValueError(f"entry_ttl_s must be positive, got {entry_ttl_s}")
        self.keys = RedisKeys(namespace)   # ValueError for a namespace with braces
        self._client = client
        self._owns_client = owns_client
        self._prefix = self.keys.prefix
        self._rk_prefix = self.keys.request_key_prefix
        self._cap = max_blocks_per_slot or 0
        self._ttl_s = entry_ttl_s or 0
        self._store = client.register_script(_STORE)
        self._remove = client.register_script(_REMOVE)
        self._clear = client.register_script(_CLEAR)
        self._request_key = client.register_script(_REQUEST_KEY)
        self._lookup = client.register_script(_LOOKUP)
        self._route_read = client.register_script(_ROUTE_READ)
        self._size = client.register_script(_SIZE)

    @classmethod
    def from_url(cls, url: str, **kwargs) -> RedisIndex:
        """Connect to ``url`` (``redis://host:port/db``, or ``redis+cluster://host:port``
        for a Redis Cluster); the index owns the client."""
        target = parse_redis_url(url)
        if target.cluster:
            from redis.asyncio.cluster import RedisCluster

            return cls(RedisCluster.from_url(target.url), owns_client=True, **kwargs)
        return cls(aioredis.Redis.from_url(target.url), owns_client=True, **kwargs)

    def _slot_keys(self, engine: str, tier: str) -> tuple[str, str]:
        return (self.keys.engine_hashes(tier, engine), self.keys.lru(tier, engine))

    async def store(self, engine: str, tier: str,
                    blocks: Sequence[tuple[EngineHash, RequestKey]]) -> None:
        if not blocks:
            return
        eh_key, lru_key = self._slot_keys(engine, tier)
        args: list[str | int] = [f"{engine}\0{tier}", tier, engine, self._rk_prefix,
                                 self._cap, self._ttl_s]
        for engine_hash, key in blocks:
            args.append(_eh_str(engine_hash))
            args.append(_rk_str(key))
        await self._store(keys=[eh_key, lru_key, self.keys.tick, self.keys.tiers(engine),
                                self.keys.engines], args=args)

    async def remove(self, engine: str, tier: str, engine_hashes: Sequence[EngineHash]) -> None:
        if not engine_hashes:
            return
        await self._remove(keys=list(self._slot_keys(engine, tier)),
                           args=[f"{engine}\0{tier}", self._rk_prefix,
                                 *(_eh_str(h) for h in engine_hashes)])

    async def clear(self, engine: str, tier: str | None = None) -> None:
        await self._clear(keys=[self.keys.tiers(engine), self.keys.engines],
                          args=[self._prefix, engine, tier or ""])

    async def request_key(self, engine: str, engine_hash: EngineHash) -> RequestKey | None:
        raw = await self._request_key(keys=[self.keys.tiers(engine)],
                                      args=[self._prefix, engine, _eh_str(engine_hash)])
        return None if raw is None else RequestKey(int(raw, 16))

    async def lookup(self, request_keys: Sequence[RequestKey]) -> PrefixMatch:
        if not request_keys:
            return {}
        flat = await self._lookup(keys=[self.keys.request_key(_rk_str(k))
                                        for k in request_keys], args=[])
        return _prefix_match(flat)

    async def route_read(self, session_key: str | None, request_keys: Sequence[RequestKey],
                         take_handle: bool = False) -> RouteRead:
        """One script, so one round trip: the record, the handle (taken atomically
        with ``take_handle``) and the lookup."""
        keys = [self.keys.session(session_key), self.keys.handle(session_key),
                self.keys.withdrawn(session_key), self.keys.epochs] if session_key else []
        keys += [self.keys.request_key(_rk_str(k)) for k in request_keys]
        record, handle, ttl_ms, flat, withdrawn, epochs = await self._route_read(
            keys=keys, args=[4 if session_key else 0, "1" if take_handle else "0"])
        taken = handle is not None and int(ttl_ms) != -2
        return RouteRead(record=record, handle=handle, handle_taken=taken,
                         handle_ttl_ms=int(ttl_ms) if taken else -1,
                         matches=_prefix_match(flat),
                         withdrawn={int(t) for t in withdrawn},
                         epochs={epochs[i].decode(): int(epochs[i + 1])
                                 for i in range(0, len(epochs), 2)})

    async def return_handle(self, session_key: str, handle: bytes, ttl_ms: int) -> None:
        # NX: a handle published since (a newer turn) is not overwritten.  A ttl of
        # 0 or less than a millisecond left: it ran out meanwhile, nothing to return.
        key = self.keys.handle(session_key)
        if ttl_ms == -1:
            await self._client.set(key, handle, nx=True)
        elif ttl_ms > 0:
            await self._client.set(key, handle, nx=True, px=ttl_ms)

    async def size(self) -> int:
        return int(await self._size(keys=[self.keys.engines], args=[self._prefix]))

    async def put_session(self, session_id: str, record: bytes, ttl_s: float) -> None:
        await self._client.set(self.keys.session(session_id), record,
                               px=max(1, int(ttl_s * 1000)))

    async def get_session(self, session_id: str) -> bytes | None:
        return await self._client.get(self.keys.session(session_id))

    async def clear_sessions(self) -> int:
        return await delete_matching(self._client, self.keys.sessions_pattern)

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()
