"""The ``KVIndex`` interface: which engine holds which prompt blocks, on which tier.

Two keys per block (llm-d's dual-key design):

* a **request key** is the router's own chained hash of the block's tokens
  (``vllm_sessionkv.wire.hashing.request_keys``); the router computes it from a prompt, so
  lookups use request keys only;
* an **engine hash** is the engine's opaque block hash from KV events; it is kept only
  to map later events (``BlockRemoved``, a child ``BlockStored``'s parent, tokenless
  host-tier stores) back to request keys.

An entry is ``(engine, tier, engine_hash) -> request_key``.  An engine holds a request
key on a tier while at least one of its entries there maps to it.  Storing an entry
twice is a no-op (set semantics, so re-announced blocks do not pile up); removing an
unknown engine hash is a no-op (so lost or replayed events do no harm).

Every method is async so the in-process and the Redis backends are interchangeable.
The index holds no routing policy: ``lookup`` answers "how many leading blocks of this
prompt does each engine hold on each tier", and the router decides what that is worth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from vllm_sessionkv.wire.hashing import RequestKey

__all__ = [
    "TIER_DEVICE",
    "TIER_HOST",
    "TIER_STORAGE",
    "EngineHash",
    "KVIndex",
    "PublishedHandles",
    "PrefixMatch",
    "RouteRead",
]

# Tiers are vLLM's ``medium`` strings, kept verbatim so new media need no code change.
# The primary pool reports "GPU" even on the CPU platform: it means "device tier".
TIER_DEVICE = "GPU"
TIER_HOST = "CPU"
TIER_STORAGE = "STORAGE"

# An engine's block hash exactly as its events carry it: an int (default, low 64 bits
# of the digest) or the raw digest bytes.  Not ``hashing.EngineHash``, which is the
# full digest computed locally.
EngineHash = int | bytes

# engine -> tier -> number of leading prompt blocks held there (only entries > 0).
PrefixMatch = dict[str, dict[str, int]]


@dataclass(slots=True)
class RouteRead:
    """What one routing decision reads from the shared store, all in one go."""

    record: bytes | None = None   # the session record (opaque bytes), if any
    handle: bytes | None = None   # the engines' published handle, if any
    # True when ``handle`` was deleted from the store by this read (``take_handle``):
    # the caller now owns it and must ``return_handle`` it if it does not use it.
    handle_taken: bool = False
    handle_ttl_ms: int = -1       # its remaining time when taken; -1: no expiry
    matches: PrefixMatch = field(default_factory=dict)
    # Hold tokens of the session's holds D ended before their lease (withdrawn
    # handles), and the latest known start (unix ns) of each engine URL: a handle
    # either names is dead (``protocol.handle_is_dead``).  Empty: none known.
    withdrawn: set[int] = field(default_factory=set)
    epochs: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class KVIndex(Protocol):
    """Block placement across engines and tiers, plus the session records table."""

    async def store(self, engine: str, tier: str,
                    blocks: Sequence[tuple[EngineHash, RequestKey]]) -> None:
        """Record that ``engine`` holds ``blocks`` on ``tier``.

        ``blocks`` pairs each engine hash with its request key.  Re-storing an engine
        hash refreshes it (for capacity eviction) and, if its request key changed,
        re-points it.
        """
        ...

    async def remove(self, engine: str, tier: str, engine_hashes: Sequence[EngineHash]) -> None:
        """Forget ``engine_hashes`` on ``engine``/``tier``; unknown hashes are ignored."""
        ...

    async def clear(self, engine: str, tier: str | None = None) -> None:
        """Forget everything ``engine`` holds on ``tier``, or on every tier if None."""
        ...

    async def request_key(self, engine: str, engine_hash: EngineHash) -> RequestKey | None:
        """The request key ``engine`` stored for ``engine_hash`` on any tier, or None.

        The event consumer uses it to continue a request-key chain from a
        ``BlockStored``'s parent, and to place tokenless stores.
        """
        ...

    async def lookup(self, request_keys: Sequence[RequestKey]) -> PrefixMatch:
        """Longest held prefix of ``request_keys`` per engine and tier.

        ``result[engine][tier] == n`` means the engine holds ``request_keys[:n]`` on
        that tier and not ``request_keys[n]``.  Pairs holding no leading block are
        left out, so an empty dict means "nobody has any of it".
        """
        ...

    async def route_read(self, session_key: str | None, request_keys: Sequence[RequestKey],
                         take_handle: bool = False) -> RouteRead:
        """Everything a routing decision reads, in one step (one round trip for a
        shared store): the session record under ``session_key``, the engines'
        published handle for that session (None: neither is read), and
        ``lookup(request_keys)``.

        ``take_handle`` deletes the published handle in the same atomic step, so that
        of several readers (proxy replicas) exactly one gets it: a handle is single
        use.  The reader hands it back with :meth:`return_handle` if its decision
        does not use it.  A backend without published handles answers None.
        """
        ...

    async def return_handle(self, session_key: str, handle: bytes, ttl_ms: int) -> None:
        """Put back a handle ``route_read`` took for ``session_key`` and the decision
        did not use, with what was left of its time (-1: none), unless a newer one was
        published since."""
        ...

    async def size(self) -> int:
        """Number of ``(engine, tier, engine_hash)`` entries held."""
        ...

    async def put_session(self, session_id: str, record: bytes, ttl_s: float) -> None:
        """Store an opaque session record (e.g. an encoded ``SessionHandle``) for ``ttl_s``."""
        ...

    async def get_session(self, session_id: str) -> bytes | None:
        """The record stored for ``session_id``, or None if absent or expired."""
        ...

    async def clear_sessions(self) -> int:
        """Drop every session record (an operator's reset); how many were dropped."""
        ...

    async def close(self) -> None:
        """Release connections.  The index must not be used afterwards."""
        ...


@runtime_checkable
class PublishedHandles(Protocol):
    """A backend that keeps handles the engines' handle channel delivers to this
    replica (``handle_subscriber.py``); ``route_read`` then returns them as it returns
    those the engines publish to Redis."""

    def put_handle(self, session_key: str, handle: bytes, ttl_ms: int) -> int:
        """Keep ``handle`` for ``session_key`` for ``ttl_ms`` (-1: until evicted),
        replacing an older one (the newest turn's wins); returns how many handles the
        backend's bound evicted to make room."""
        ...

    def withdraw_handle(self, session_key: str, hold_token: int, ttl_ms: int) -> None:
        """D ended the hold ``hold_token`` names (``protocol.HandleWithdrawal``): drop
        the kept handle if it is that one, and answer the token in ``route_read``'s
        ``withdrawn`` for ``ttl_ms``, so a copy held elsewhere (a session record) is
        not attached either."""
        ...

    def note_epoch(self, engine_url: str, epoch: int) -> None:
        """An engine's handle or withdrawal names its process's start ``epoch``: keep
        the latest per URL for ``route_read``'s ``epochs``."""
        ...
