"""Session holds on D: whose blocks are kept for the next turn, until when, and why
each hold ended.

A finished session turn's blocks stay allocated on D for the next turn's D->P pull.
A hold ends in one of five ways, all normal outcomes (``RELEASE_REASONS``):

* ``pulled``: the next turn's P read the blocks (or told D it would not), so NIXL
  reported the send done without our asking;
* ``lease_ended``: the hold's lease (``retention.py``) passed with no next turn;
* ``superseded``: a newer turn of the session holds its own blocks; the older hold
  ends ``superseded_hold_grace_s`` later, in case a pull of it is in flight;
* ``reset``: an operator reset the engine's caches;
* ``kv_pressure``: holds pinned more of the engine's KV than
  ``session_hold_max_kv_fraction``, or a request D could not admit needed their
  blocks; the least valuable ended first (``retention.py``; the oldest under
  ``retention: "age"``).  Sessions can outnumber
  what device KV holds, and a held block cannot be evicted: without the cap, held
  sessions would keep new requests waiting for a lease to end.  With a host tier
  the session's KV is already on host (written through at the end of its turn), so
  its next turn restores it from there.

The scheduler asks the worker to release the last three itself, before NIXL's own
expiry timer (a later backstop) would, because NIXL counts and logs an expiry as a
failed hand-off.

What D would reclaim on demand (``hold_only_blocks``): the held blocks that nothing
but holds keeps allocated.  vLLM's KV usage counts them as used, so a router reading
that usage alone sees a D full of holds as full (``sessionkv_session_hold_blocks``;
docs/retention.md).  Pure: the caller passes the clock and vLLM's reference counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["HOLD_BLOCKS_EVERY_S", "RELEASE_REASONS", "WITHDRAW_REASONS", "HoldTable",
           "hold_only_blocks"]

RELEASE_REASONS = ("pulled", "lease_ended", "superseded", "reset", "kv_pressure")
# Ends for which D withdraws the hold's handle (session_holds.py): all but the lease's,
# which the handle's own expiry announces.
WITHDRAW_REASONS = tuple(r for r in RELEASE_REASONS if r != "lease_ended")
# How often D counts again the blocks only holds keep (``hold_only_blocks``): a count
# reads every held block's reference count, about 30 ms in the scheduler's step at
# 50,000 held blocks.  The proxy scrapes /metrics every 2 s by default
# (metrics_scrape_interval_s).
HOLD_BLOCKS_EVERY_S = 1.0


@dataclass
class _Hold:
    session_id: str
    until_s: float                 # when the lease (or a superseded hold's grace) ends
    ending: str | None = None      # release asked for, and why; None while it runs
    superseded: bool = False
    num_blocks: int = 0            # device blocks it pins
    block_ids: tuple[int, ...] = ()   # every KV cache group's, as vLLM gave them


def hold_only_blocks(holders: Mapping[int, int], ref_counts: Mapping[int, int]) -> int:
    """Blocks only holds keep: of the blocks holds pin (``holders``: block id -> how
    many holds name it), those whose reference count in vLLM's block pool
    (``ref_counts``, by block id) is no more than their holds.  A running request
    that shares a held block (a prefix hit on it) adds a reference, and ending the
    holds would not free that block; a block with no count (vLLM's null block, which
    pads sliding-window groups, or one not in ``ref_counts``) is none of theirs to
    free.  Ending every hold frees exactly these (``SessionHolds.make_room`` can)."""
    return sum(1 for block_id, holds in holders.items()
               if 0 < ref_counts.get(block_id, 0) <= holds)


class HoldTable:
    """Holds by request id, and the current hold of each session."""

    def __init__(self) -> None:
        self._holds: dict[str, _Hold] = {}
        self._current: dict[str, str] = {}    # session id -> request id
        self._holders: dict[int, int] = {}    # block id -> holds naming it

    @property
    def sessions(self) -> int:
        """Sessions whose latest turn this engine holds (``sessionkv_session_holds``)."""
        return len(self._current)

    def __len__(self) -> int:
        """Holds whose blocks are still allocated, superseded ones included."""
        return len(self._holds)

    @property
    def held_blocks(self) -> int:
        """Device blocks pinned by holds not yet asked to end."""
        return sum(h.num_blocks for h in self._holds.values() if h.ending is None)

    @property
    def holders(self) -> Mapping[int, int]:
        """Each block id holds name (all of them, ending ones included: their blocks
        are allocated until the worker reports the release) -> how many holds."""
        return self._holders

    @property
    def ending_blocks(self) -> int:
        """Device blocks of holds asked to end whose release is not yet reported."""
        return sum(h.num_blocks for h in self._holds.values() if h.ending is not None)

    def hold(self, session_id: str, request_id: str, until_s: float,
             superseded_until_s: float, num_blocks: int = 0,
             block_ids: Sequence[int] = ()) -> str | None:
        """Start a hold (``block_ids``: the blocks it pins, every group's); a
        session's previous hold then ends by ``superseded_until_s`` (returned, if
        any)."""
        self._drop_blocks(self._holds.get(request_id))
        previous = self._current.get(session_id)
        if previous == request_id:
            previous = None
        if previous is not None:
            old = self._holds.get(previous)
            if old is not None:
                old.superseded = True
                old.until_s = min(old.until_s, superseded_until_s)
        hold = _Hold(session_id=session_id, until_s=until_s, num_blocks=num_blocks,
                     block_ids=tuple(block_ids))
        self._holds[request_id] = hold
        for block_id in hold.block_ids:
            self._holders[block_id] = self._holders.get(block_id, 0) + 1
        self._current[session_id] = request_id
        return previous

    def _drop_blocks(self, hold: _Hold | None) -> None:
        for block_id in hold.block_ids if hold is not None else ():
            left = self._holders[block_id] - 1
            if left:
                self._holders[block_id] = left
            else:
                del self._holders[block_id]

    def due(self, now_s: float) -> dict[str, str]:
        """Holds whose time is up and not yet asked to end: request id -> reason.
        Each is returned once."""
        out: dict[str, str] = {}
        for request_id, hold in self._holds.items():
            if hold.ending is None and now_s >= hold.until_s:
                hold.ending = "superseded" if hold.superseded else "lease_ended"
                out[request_id] = hold.ending
        return out

    def running(self) -> list[tuple[str, str, bool]]:
        """(request id, session id, superseded) of each hold not yet asked to end,
        oldest first."""
        return [(rid, h.session_id, h.superseded) for rid, h in self._holds.items()
                if h.ending is None]

    def over_cap(self, max_blocks: int, keep: str | None = None,
                 order: list[str] | None = None) -> list[str]:
        """Ask running holds to end (``kv_pressure``) until the rest pin at most
        ``max_blocks``, in ``order`` (request ids, first to end first), by default the
        oldest first with superseded ones before; ``keep`` (the hold just made) never.
        Returns their request ids."""
        held = self.held_blocks
        if held <= max_blocks:
            return []
        out = []
        if order is None:
            # Insertion order is age: a hold is added when its turn finishes.
            order = [rid for rid, _ in sorted(self._holds.items(),
                                              key=lambda kv: not kv[1].superseded)]
        for request_id in order:
            if held <= max_blocks:
                break
            hold = self._holds.get(request_id)
            if hold is None or hold.ending is not None or request_id == keep:
                continue
            hold.ending = "kv_pressure"
            held -= hold.num_blocks
            out.append(request_id)
        return out

    def end_all(self, reason: str) -> list[str]:
        """Ask every running hold to end now (a reset); returns their request ids."""
        out = []
        for request_id, hold in self._holds.items():
            if hold.ending is None:
                hold.ending = reason
                out.append(request_id)
        return out

    def released(self, request_id: str) -> str | None:
        """The worker reported the request's blocks done: the reason the hold ended,
        or None when the request was no hold of ours."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return None
        self._drop_blocks(hold)
        if self._current.get(hold.session_id) == request_id:
            del self._current[hold.session_id]
        return hold.ending or "pulled"
