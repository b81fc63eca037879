"""The session table as the router uses it: records read with the route, handles
judged usable or not, and every write behind the request.

A record is written behind the answer (``save_later``): this replica reads it at
once (its unwritten copy), and one writer per session writes the newest to the store
(the index's session table: in-process, or Redis), so a request never waits for the
store.  A published handle the route read took but no P request will use goes back
to the store the same way.  A failed write is counted and costs the next turn's
reuse, never the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping

from vllm_sessionkv.wire.protocol import (
    SessionHandle,
    handle_expired,
    handle_is_dead,
    session_store_key,
)

from sessionkv_proxy.index.base import KVIndex, RouteRead
from sessionkv_proxy.sessions import (
    HandleUnreadable,
    SessionRecord,
    decode_published_handle,
    decode_record,
    encode_record,
)

__all__ = ["DEAD_HANDLE_OUTCOMES", "SessionStore", "usable_handle"]

logger = logging.getLogger("sessionkv_proxy.session_store")


class SessionStore:
    """Session records over the index's table, with write-behind."""

    def __init__(self, index: KVIndex, session_ttl_s: float,
                 on_error: Callable[[str], None]) -> None:
        self._index = index
        self._ttl_s = session_ttl_s
        self._on_error = on_error
        # The newest record per session key not yet written, its writer, and every
        # task behind the requests.
        self._unwritten: dict[str, bytes] = {}
        self._writers: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()

    def record(self, key: str, stored: bytes | None, tenant: str | None
               ) -> SessionRecord | None:
        """The session's record: this replica's own newest while its write is still
        on the way (read your own writes), else what the store returned."""
        raw = self._unwritten.get(key, stored)
        record = decode_record(raw) if raw else None
        # A record stored under this key is this tenant's; the check guards old ones.
        return record if record is not None and record.tenant == tenant else None

    async def load(self, session_id: str | None, tenant: str | None
                   ) -> SessionRecord | None:
        if not session_id:
            return None
        key = session_store_key(session_id, tenant)
        stored = None if key in self._unwritten else await self._index.get_session(key)
        return self.record(key, stored, tenant)

    def save_later(self, record: SessionRecord) -> None:
        """Write ``record`` behind the request (see the module doc)."""
        record.updated_at_unix_s = time.time()
        key = session_store_key(record.session_id, record.tenant)
        self._unwritten[key] = encode_record(record)
        if key not in self._writers:
            self._writers[key] = self._spawn(self._write(key))

    async def save(self, record: SessionRecord) -> None:
        """``save_later``, waiting for the write."""
        self.save_later(record)
        writer = self._writers.get(session_store_key(record.session_id, record.tenant))
        if writer is not None:
            await asyncio.shield(writer)

    async def _write(self, key: str) -> None:
        try:
            while (raw := self._unwritten.get(key)) is not None:
                try:
                    await self._index.put_session(key, raw, self._ttl_s)
                except Exception as exc:
                    self._write_failed("session_store", key, exc)
                if self._unwritten.get(key) is raw:   # else a newer one: write it next
                    del self._unwritten[key]
        finally:
            self._writers.pop(key, None)

    def give_back(self, read: RouteRead, session_id: str | None, tenant: str | None,
                  outcome: str = "") -> None:
        """A published handle ``route_read`` took and no P request will use goes back,
        behind the request (unless a newer one was published meanwhile); a dead one
        (``outcome`` in ``DEAD_HANDLE_OUTCOMES``) does not."""
        if read.handle_taken and read.handle is not None and session_id \
                and outcome not in DEAD_HANDLE_OUTCOMES:
            self._spawn(self._return_handle(session_store_key(session_id, tenant),
                                            read.handle, read.handle_ttl_ms))

    async def _return_handle(self, key: str, raw: bytes, ttl_ms: int) -> None:
        try:
            await self._index.return_handle(key, raw, ttl_ms)
        except Exception as exc:
            self._write_failed("handle_return", key, exc)

    def _write_failed(self, kind: str, key: str, exc: BaseException) -> None:
        self._on_error(kind)
        logger.warning("%s for %s failed: %r", kind, key, exc)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def flush(self) -> None:
        """Wait until the writes behind earlier requests are done (tests, stop)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


# Outcomes of a handle D no longer holds: not given back to the store when taken.
DEAD_HANDLE_OUTCOMES = ("withdrawn", "engine_restarted")


def usable_handle(record: SessionRecord | None, published: bytes | None,
                  tenant: str | None, holder_lost_at_unix_s: Callable[[str], float | None],
                  now_unix_s: float, expiry_margin_s: float,
                  withdrawn: Collection[int] = (), epochs: Mapping[str, int] | None = None
                  ) -> tuple[SessionHandle | None, str, str]:
    """(handle, outcome, source): the session's live handle, if any, and whether it
    came from the session record or from the engines' published copy (its bytes,
    ``published``, as ``route_read`` returned them).  ``holder_lost_at_unix_s``: when
    the engine at a URL last refused connections (None: not one of ours).
    ``withdrawn`` and ``epochs`` (``RouteRead``'s): a handle D withdrew, or one of an
    engine process that has restarted since, is dead (``protocol.handle_is_dead``)."""
    handle, source = (record.handle if record else None), "record"
    dead = handle_is_dead(handle, withdrawn, epochs or {}) if handle is not None else None
    if handle is None or dead is not None:
        # The engines' copy may be a newer turn's (a streamed one) where the
        # record's is dead.
        handle, source = decode_published_handle(published), "published"
    if isinstance(handle, HandleUnreadable):
        return None, handle.reason, ""
    if handle is None:
        return None, dead or "none", ""
    if handle.tenant != tenant:
        return None, "other_tenant", ""
    dead = handle_is_dead(handle, withdrawn, epochs or {})
    if dead is not None:
        return None, dead, ""
    lost_at = holder_lost_at_unix_s(handle.engine_url or "")
    if lost_at is not None and record is not None and lost_at > record.updated_at_unix_s:
        # The D that held it refused connections since this turn: if it is back, it
        # is a new process (P's read would fail against its new NIXL agent).
        return None, "engine_lost", ""
    # The engine's rule and margin: a handle P would refuse is left unconsumed.
    if handle_expired(handle.expires_at_unix_s, now_unix_s, expiry_margin_s):
        return None, "expired", ""
    return handle, "attached", source
