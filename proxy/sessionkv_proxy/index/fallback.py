"""A shared (Redis) index with an in-process copy to fall back on.

The proxy's own event consumer feeds both: every write goes to the in-process
``MemoryIndex`` first (it cannot fail) and then, through the ``RedisLink``'s
deadline and breaker, to Redis.  Reads prefer Redis, which other replicas also
write, and fall back to the in-process copy when Redis is down, slow or erroring,
so an outage costs at most the cross-replica view, never a request.

Redis misses writes while it is down, and a restarted Redis comes back empty.  The
proxy notices both (a skipped or failed write, a new ``run_id``) and re-publishes
its in-process copy: each engine's entries are cleared and stored again, and the
live session records are written back.  Meanwhile reads stay in-process and writes
wait for the re-publish, so they land after it in their own order.  Index entries
are hints either way: the connector verifies every block it attaches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from vllm_sessionkv.wire.hashing import RequestKey

from sessionkv_proxy.redis_link import LinkState, RedisLink, RedisUnavailable

from .base import EngineHash, PrefixMatch, RouteRead
from .memory import MemoryIndex
from .redis import RedisIndex

__all__ = ["FallbackIndex"]

logger = logging.getLogger("sessionkv_proxy.index")

# Entries per store call while re-publishing (one Lua call each).
_REPUBLISH_CHUNK = 2000
# How often a healthy Redis is asked for its run_id (a restart comes back empty).
_RUN_ID_CHECK_S = 5.0


class FallbackIndex:
    """``KVIndex`` over Redis, with the in-process copy as the fallback."""

    def __init__(self, remote: RedisIndex, local: MemoryIndex, link: RedisLink, *,
                 engines: Sequence[str] = (),
                 on_fallback: Callable[[str], None] | None = None,
                 on_republish: Callable[[], None] | None = None) -> None:
        self.remote = remote
        self.local = local
        self.link = link
        self._engines = tuple(engines)  # cleared on re-publish even when empty here
        self._on_fallback = on_fallback or (lambda op: None)
        self._on_republish = on_republish or (lambda: None)
        self._missed = False       # Redis lacks a write: re-publish when it answers
        self._writable = asyncio.Event()
        self._writable.set()       # cleared while re-publishing
        self.run_id: str | None = None
        self.republishes = 0

    @property
    def degraded(self) -> bool:
        """Reads are being served (or were just served) from the in-process copy."""
        return not self.link.available or self.link.consecutive_failures > 0

    # ------------------------------------------------------------------ writes
    async def _write(self, op: str, make: Callable[[], Awaitable[object]]) -> None:
        if not self._writable.is_set():
            await self._writable.wait()
        if not self.link.available:
            self._missed = True
            return
        try:
            await self.link.call(op, make)
        except RedisUnavailable:
            self._missed = True

    async def store(self, engine: str, tier: str,
                    blocks: Sequence[tuple[EngineHash, RequestKey]]) -> None:
        await self.local.store(engine, tier, blocks)
        await self._write("store", lambda: self.remote.store(engine, tier, blocks))

    async def remove(self, engine: str, tier: str, engine_hashes: Sequence[EngineHash]) -> None:
        await self.local.remove(engine, tier, engine_hashes)
        await self._write("remove", lambda: self.remote.remove(engine, tier, engine_hashes))

    async def clear(self, engine: str, tier: str | None = None) -> None:
        await self.local.clear(engine, tier)
        await self._write("clear", lambda: self.remote.clear(engine, tier))

    async def put_session(self, session_id: str, record: bytes, ttl_s: float) -> None:
        await self.local.put_session(session_id, record, ttl_s)
        await self._write("put_session",
                          lambda: self.remote.put_session(session_id, record, ttl_s))

    async def clear_sessions(self) -> int:
        """Both copies; raises ``RedisUnavailable`` when Redis's could not be cleared
        (an operator's reset must not half succeed in silence)."""
        dropped = await self.local.clear_sessions()
        if not self._writable.is_set():
            await self._writable.wait()
        return max(dropped, await self.link.call_long("clear_sessions",
                                                      self.remote.clear_sessions))

    # ------------------------------------------------------------------ reads
    async def request_key(self, engine: str, engine_hash: EngineHash) -> RequestKey | None:
        # The consumer's own copy holds every entry it wrote: no round trip needed.
        return await self.local.request_key(engine, engine_hash)

    # The link refuses at once while Redis is down, so each read is one try.
    async def lookup(self, request_keys: Sequence[RequestKey]) -> PrefixMatch:
        try:
            return await self.link.call("lookup", lambda: self.remote.lookup(request_keys))
        except RedisUnavailable:
            self._on_fallback("lookup")
            return await self.local.lookup(request_keys)

    async def get_session(self, session_id: str) -> bytes | None:
        try:
            record = await self.link.call("get_session",
                                          lambda: self.remote.get_session(session_id))
        except RedisUnavailable:
            self._on_fallback("get_session")
            record = None
        # None from Redis but a record here: Redis lost it (a restart the re-publish
        # has not covered yet); this replica's copy still helps.
        return record if record is not None else await self.local.get_session(session_id)

    async def route_read(self, session_key: str | None, request_keys: Sequence[RequestKey],
                         take_handle: bool = False) -> RouteRead:
        """Redis's answer in one round trip; while Redis is down, this replica's copy.
        A handle Redis does not hold may still be in this replica's copy (the engines'
        handle channel delivers to every replica; ``put_handle``)."""
        try:
            read = await self.link.call("route_read", lambda: self.remote.route_read(
                session_key, request_keys, take_handle))
        except RedisUnavailable:
            self._on_fallback("route_read")
            return await self.local.route_read(session_key, request_keys, take_handle)
        if session_key:
            if read.record is None:
                # As in get_session: Redis lost a record this replica still holds.
                read.record = await self.local.get_session(session_key)
            if take_handle:
                # Redis's copy first; the channel's copy of one Redis handed out is
                # dropped with it (single use).
                local, ttl_ms = self.local.take_handle(session_key)
                if read.handle is None and local is not None:
                    read.handle, read.handle_taken, read.handle_ttl_ms = local, True, ttl_ms
            # What the channel told this replica adds to what Redis says.
            read.withdrawn |= self.local.withdrawn_tokens(session_key)
            for url, epoch in self.local.epochs().items():
                if epoch > read.epochs.get(url, 0):
                    read.epochs[url] = epoch
        return read

    def put_handle(self, session_key: str, handle: bytes, ttl_ms: int) -> int:
        """A handle from the engines' channel, kept in this replica's copy only: an
        engine configured with Redis publishes there itself, and every replica
        receives the channel's copy (written to Redis by each, a handle one replica
        took would come back for another)."""
        return self.local.put_handle(session_key, handle, ttl_ms)

    def withdraw_handle(self, session_key: str, hold_token: int, ttl_ms: int) -> None:
        """A withdrawal from the engines' channel, kept in this replica's copy (as
        ``put_handle``): an engine with Redis withdraws there itself."""
        self.local.withdraw_handle(session_key, hold_token, ttl_ms)

    def note_epoch(self, engine_url: str, epoch: int) -> None:
        self.local.note_epoch(engine_url, epoch)

    async def return_handle(self, session_key: str, handle: bytes, ttl_ms: int) -> None:
        # Not a write of ours to re-publish: a handle lost to an outage costs one
        # turn's reuse, never correctness.  While Redis is down, a handle taken from
        # this replica's copy goes back there.
        if not self.link.available:
            await self.local.return_handle(session_key, handle, ttl_ms)
            return
        try:
            await self.link.call("return_handle",
                                 lambda: self.remote.return_handle(session_key, handle, ttl_ms))
        except RedisUnavailable:
            await self.local.return_handle(session_key, handle, ttl_ms)

    async def size(self) -> int:
        try:
            return await self.link.call("size", self.remote.size)
        except RedisUnavailable:
            return await self.local.size()

    # ------------------------------------------------------------------ upkeep
    async def maintain(self, interval_s: float = 0.25) -> None:
        """Run for the proxy's life: probe a down Redis, notice a restarted one, and
        re-publish what Redis missed once it answers."""
        since_run_id_check = _RUN_ID_CHECK_S
        while True:
            await asyncio.sleep(interval_s)
            since_run_id_check += interval_s
            try:
                if self.link.state is LinkState.DOWN:
                    if await self.link.probe():
                        await self._republish()
                    continue
                if since_run_id_check >= _RUN_ID_CHECK_S:
                    since_run_id_check = 0.0
                    await self._check_run_id()
                if self._missed and self.link.available:
                    self.link.hold_for_resync()
                    await self._republish()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("index upkeep failed; retrying")

    async def _check_run_id(self) -> None:
        try:
            run_id = await self.link.server_id()
        except RedisUnavailable:
            return
        if run_id is None:
            return
        if self.run_id is not None and run_id != self.run_id:
            logger.warning("redis restarted or failed over (run_id changed); "
                           "re-publishing the index and sessions")
            self._missed = True
        self.run_id = run_id

    async def _republish(self) -> None:
        """Write the in-process copy back to Redis; on success the link is up again,
        on failure it is down again and this runs after the next probe."""
        self._writable.clear()
        self._missed = False
        try:
            entries, sessions = self.local.snapshot()
            for engine in dict.fromkeys([*self._engines, *(e for e, _, _ in entries)]):
                await self.link.call("republish", lambda e=engine: self.remote.clear(e),
                                     force=True)
            for engine, tier, blocks in entries:
                for i in range(0, len(blocks), _REPUBLISH_CHUNK):
                    chunk = blocks[i:i + _REPUBLISH_CHUNK]
                    await self.link.call(
                        "republish", lambda c=chunk, e=engine, t=tier:
                        self.remote.store(e, t, c), force=True)
            for session_id, record, ttl_s in sessions:
                await self.link.call(
                    "republish", lambda s=session_id, r=record, t=ttl_s:
                    self.remote.put_session(s, r, t), force=True)
        except RedisUnavailable:
            self._missed = True
            self.link.open_breaker()
            return
        finally:
            self._writable.set()
        self.republishes += 1
        self._on_republish()
        logger.info("re-published %d index entries and %d sessions to redis",
                    sum(len(b) for _, _, b in entries), len(sessions))
        self.link.close_breaker()
        # The Redis just re-published to is the one whose restart counts next.
        self.run_id = None
        await self._check_run_id()

    async def close(self) -> None:
        await self.local.close()
        await self.remote.close()
