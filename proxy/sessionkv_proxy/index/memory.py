"""In-process ``KVIndex``: the default backend, one per proxy process.

Layout, chosen so that a lookup costs one dict probe and one integer AND per prompt
block however many blocks are indexed:

* each ``(engine, tier)`` pair gets a *slot*, a bit position;
* ``_holders[request_key]`` is the bitmask of slots holding that key;
* ``_entries[slot]`` maps the slot's engine hashes to request keys, in least recently
  stored order (dicts keep insertion order; a re-store moves the entry to the end), so
  the capacity bound evicts the stalest entry first;
* ``_extra_refs`` counts the rare second engine hash of one slot that maps to an
  already-held request key, so removing one of them keeps the bit.

Not thread-safe: it lives on the proxy's event loop, as do its callers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec

from vllm_sessionkv.wire.hashing import RequestKey
from vllm_sessionkv.wire.protocol import decode_handle

from .base import EngineHash, PrefixMatch, RouteRead

__all__ = ["MemoryIndex"]


def _hold_token(raw: bytes) -> int | None:
    try:
        return decode_handle(raw).payload.hold_token
    except (ValueError, msgspec.DecodeError):
        return None


class MemoryIndex:
    """Dict-and-bitmask ``KVIndex``.

    ``max_blocks_per_slot`` bounds the entries of one engine on one tier (None: no
    bound); the least recently stored entry goes first.  ``clock`` is monotonic
    seconds, injectable so session expiry can be tested without sleeping.
    ``max_sessions`` bounds the session records; the least recently written go first.
    ``max_handles`` bounds the published handles (``put_handle``: those the engines'
    handle channel delivered), likewise.
    """

    def __init__(self, *, max_blocks_per_slot: int | None = None,
                 max_sessions: int = 1_000_000, max_handles: int = 50_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks_per_slot is not None and max_blocks_per_slot <= 0:
            raise ValueError(f"max_blocks_per_slot must be positive, got {max_blocks_per_slot}")
        self._max_blocks_per_slot = max_blocks_per_slot
        self._max_sessions = max_sessions
        self._clock = clock
        self._slot_of: dict[tuple[str, str], int] = {}
        self._pair_of: dict[int, tuple[str, str]] = {}
        self._free_slots: list[int] = []
        self._entries: dict[int, dict[EngineHash, RequestKey]] = {}
        self._holders: dict[RequestKey, int] = {}
        self._extra_refs: dict[tuple[int, RequestKey], int] = {}
        self._sessions: dict[str, tuple[float, bytes]] = {}
        # session key -> (monotonic expiry or inf, handle bytes), oldest first.
        self._max_handles = max_handles
        self._handles: dict[str, tuple[float, bytes]] = {}
        # session key -> {withdrawn hold token: monotonic expiry}, oldest first, bounded
        # like the handles; engine URL -> latest start epoch.
        self._withdrawn: dict[str, dict[int, float]] = {}
        self._epochs: dict[str, int] = {}

    # -- slots ---------------------------------------------------------------------

    def _slot(self, engine: str, tier: str) -> int:
        slot = self._slot_of.get((engine, tier))
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
            self._slot_of[(engine, tier)] = slot
            self._pair_of[slot] = (engine, tier)
            self._entries[slot] = {}
        return slot

    def _hold(self, slot: int, key: RequestKey) -> None:
        bit = 1 << slot
        mask = self._holders.get(key, 0)
        if mask & bit:
            self._extra_refs[(slot, key)] = self._extra_refs.get((slot, key), 0) + 1
        else:
            self._holders[key] = mask | bit

    def _release(self, slot: int, key: RequestKey) -> None:
        extra = self._extra_refs.get((slot, key))
        if extra:
            if extra == 1:
                del self._extra_refs[(slot, key)]
            else:
                self._extra_refs[(slot, key)] = extra - 1
            return
        mask = self._holders.get(key, 0) & ~(1 << slot)
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    def _drop_slot(self, engine: str, tier: str) -> None:
        slot = self._slot_of.pop((engine, tier), None)
        if slot is None:
            return
        for key in self._entries.pop(slot).values():
            self._release(slot, key)
        del self._pair_of[slot]
        self._free_slots.append(slot)

    # -- KVIndex -------------------------------------------------------------------

    async def store(self, engine: str, tier: str,
                    blocks: Sequence[tuple[EngineHash, RequestKey]]) -> None:
        slot = self._slot(engine, tier)
        entries = self._entries[slot]
        for engine_hash, key in blocks:
            old = entries.pop(engine_hash, None)  # pop + insert = most recently stored
            if old is None:
                self._hold(slot, key)
            elif old != key:
                self._release(slot, old)
                self._hold(slot, key)
            entries[engine_hash] = key
        cap = self._max_blocks_per_slot
        if cap is not None:
            while len(entries) > cap:
                oldest = next(iter(entries))
                self._release(slot, entries.pop(oldest))

    async def remove(self, engine: str, tier: str, engine_hashes: Sequence[EngineHash]) -> None:
        slot = self._slot_of.get((engine, tier))
        if slot is None:
            return
        entries = self._entries[slot]
        for engine_hash in engine_hashes:
            key = entries.pop(engine_hash, None)
            if key is not None:
                self._release(slot, key)

    async def clear(self, engine: str, tier: str | None = None) -> None:
        if tier is not None:
            self._drop_slot(engine, tier)
            return
        for pair_engine, pair_tier in [p for p in self._slot_of if p[0] == engine]:
            self._drop_slot(pair_engine, pair_tier)

    async def request_key(self, engine: str, engine_hash: EngineHash) -> RequestKey | None:
        for (pair_engine, _tier), slot in self._slot_of.items():
            if pair_engine == engine:
                key = self._entries[slot].get(engine_hash)
                if key is not None:
                    return key
        return None

    async def lookup(self, request_keys: Sequence[RequestKey]) -> PrefixMatch:
        return self._lookup(request_keys)

    async def route_read(self, session_key: str | None, request_keys: Sequence[RequestKey],
                         take_handle: bool = False) -> RouteRead:
        # No I/O and no await: the read (and a take) is atomic on the event loop.
        read = RouteRead(record=self._get_session(session_key) if session_key else None,
                         matches=self._lookup(request_keys) if request_keys else {})
        if session_key:
            read.handle, ttl_ms = self.take_handle(session_key, take_handle)
            if take_handle and read.handle is not None:
                read.handle_taken, read.handle_ttl_ms = True, ttl_ms
            read.withdrawn = self.withdrawn_tokens(session_key)
            read.epochs = self.epochs()
        return read

    def withdrawn_tokens(self, session_key: str) -> set[int]:
        tokens = self._withdrawn.get(session_key)
        if not tokens:
            return set()
        now = self._clock()
        return {t for t, expires_at in tokens.items() if expires_at > now}

    def withdraw_handle(self, session_key: str, hold_token: int, ttl_ms: int) -> None:
        item = self._handles.get(session_key)
        if item is not None and _hold_token(item[1]) == hold_token:
            del self._handles[session_key]
        now = self._clock()
        tokens = {t: e for t, e in self._withdrawn.pop(session_key, {}).items() if e > now}
        tokens[hold_token] = float("inf") if ttl_ms < 0 else now + ttl_ms / 1000
        self._withdrawn[session_key] = tokens      # re-inserted last: oldest first
        while len(self._withdrawn) > self._max_handles:
            del self._withdrawn[next(iter(self._withdrawn))]

    def epochs(self) -> dict[str, int]:
        """The latest known start of each engine URL (``note_epoch``)."""
        return dict(self._epochs)

    def note_epoch(self, engine_url: str, epoch: int) -> None:
        if epoch > self._epochs.get(engine_url, 0):
            self._epochs[engine_url] = epoch

    def take_handle(self, session_key: str, take: bool = True) -> tuple[bytes | None, int]:
        """(the published handle of ``session_key`` or None, its remaining ms or -1
        for none); ``take`` removes it (single use)."""
        item = self._handles.get(session_key)
        if item is None:
            return None, -1
        expires_at, handle = item
        left_s = expires_at - self._clock()
        if left_s <= 0:
            del self._handles[session_key]
            return None, -1
        if take:
            del self._handles[session_key]
        return handle, -1 if left_s == float("inf") else max(1, int(left_s * 1000))

    def put_handle(self, session_key: str, handle: bytes, ttl_ms: int,
                   only_if_absent: bool = False) -> int:
        """Hold a handle published for ``session_key`` for ``ttl_ms`` (-1: until
        evicted), replacing any other unless ``only_if_absent``; returns how many
        older handles the bound evicted."""
        if only_if_absent and self.take_handle(session_key, take=False)[0] is not None:
            return 0
        if ttl_ms == 0 or ttl_ms < -1:
            return 0
        expires_at = float("inf") if ttl_ms == -1 else self._clock() + ttl_ms / 1000
        self._handles.pop(session_key, None)   # re-inserted last: oldest first below
        self._handles[session_key] = (expires_at, bytes(handle))
        evicted = 0
        while len(self._handles) > self._max_handles:
            del self._handles[next(iter(self._handles))]
            evicted += 1
        return evicted

    async def return_handle(self, session_key: str, handle: bytes, ttl_ms: int) -> None:
        # Unless a newer one was published since (a newer turn).
        self.put_handle(session_key, handle, ttl_ms, only_if_absent=True)

    def _lookup(self, request_keys: Sequence[RequestKey]) -> PrefixMatch:
        holders = self._holders
        matched: dict[int, int] = {}  # slot -> prefix blocks
        active = -1  # all ones: every slot is still in the running
        position = 0
        for position, key in enumerate(request_keys):
            still = active & holders.get(key, 0)
            if still != active and position > 0:
                self._record(active & ~still, position, matched)
            active = still
            if not active:
                break
        else:
            if request_keys and active:
                self._record(active, len(request_keys), matched)
        result: PrefixMatch = {}
        for slot, blocks in matched.items():
            engine, tier = self._pair_of[slot]
            result.setdefault(engine, {})[tier] = blocks
        return result

    @staticmethod
    def _record(slots_mask: int, blocks: int, matched: dict[int, int]) -> None:
        while slots_mask:
            low = slots_mask & -slots_mask
            matched[low.bit_length() - 1] = blocks
            slots_mask ^= low

    async def size(self) -> int:
        return sum(len(entries) for entries in self._entries.values())

    async def put_session(self, session_id: str, record: bytes, ttl_s: float) -> None:
        now = self._clock()
        self._sessions.pop(session_id, None)  # re-inserted last: oldest first below
        self._sessions[session_id] = (now + ttl_s, bytes(record))
        while len(self._sessions) > self._max_sessions:
            del self._sessions[next(iter(self._sessions))]
        # Sweep now and then so abandoned sessions cannot grow the table without bound.
        if len(self._sessions) % 1024 == 0:
            for sid in [s for s, (exp, _) in self._sessions.items() if exp <= now]:
                del self._sessions[sid]

    async def get_session(self, session_id: str) -> bytes | None:
        return self._get_session(session_id)

    def _get_session(self, session_id: str) -> bytes | None:
        item = self._sessions.get(session_id)
        if item is None:
            return None
        expires_at, record = item
        if expires_at <= self._clock():
            del self._sessions[session_id]
            return None
        return record

    async def clear_sessions(self) -> int:
        dropped = len(self._sessions)
        self._sessions.clear()
        self._handles.clear()
        self._withdrawn.clear()
        self._withdrawn.clear()
        return dropped

    def snapshot(self) -> tuple[list[tuple[str, str, list[tuple[EngineHash, RequestKey]]]],
                                list[tuple[str, bytes, float]]]:
        """Everything held, for re-publishing to a shared backend: the entries of
        each (engine, tier), least recently stored first, and each live session record
        with its remaining seconds."""
        entries = [(engine, tier, list(self._entries[slot].items()))
                   for (engine, tier), slot in self._slot_of.items()]
        now = self._clock()
        sessions = [(sid, record, expires_at - now)
                    for sid, (expires_at, record) in self._sessions.items()
                    if expires_at > now]
        return entries, sessions

    async def close(self) -> None:
        self._holders.clear()
        self._entries.clear()
        self._extra_refs.clear()
        self._sessions.clear()
        self._handles.clear()
        self._withdrawn.clear()
