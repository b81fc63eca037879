"""Session holds on D: whose blocks are kept for the next turn, until when, and why
each hold ended.

A finished session turn's blocks stay allocated on D for the next turn's D->P pull.
A hold ends in one of four ways, all normal outcomes (``RELEASE_REASONS``):

* ``pulled``: the next turn's P read the blocks (or told D it would not), so NIXL
  reported the send done without our asking;
* ``lease_ended``: ``session_lease_s`` passed with no next turn;
* ``superseded``: a newer turn of the session holds its own blocks; the older hold
  ends ``superseded_hold_grace_s`` later, in case a pull of it is in flight;
* ``reset``: an operator reset the engine's caches.

The scheduler asks the worker to release the last three itself, before NIXL's own
expiry timer (a later backstop) would, because NIXL counts and logs an expiry as a
failed hand-off.  Pure: the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RELEASE_REASONS", "HoldTable"]

RELEASE_REASONS = ("pulled", "lease_ended", "superseded", "reset")


@dataclass
class _Hold:
    session_id: str
    until_s: float                 # when the lease (or a superseded hold's grace) ends
    ending: str | None = None      # release asked for, and why; None while it runs
    superseded: bool = False


class HoldTable:
    """Holds by request id, and the current hold of each session."""

    def __init__(self) -> None:
        self._holds: dict[str, _Hold] = {}
        self._current: dict[str, str] = {}    # session id -> request id

    @property
    def sessions(self) -> int:
        """Sessions whose latest turn this engine holds (``sessionkv_session_holds``)."""
        return len(self._current)

    def __len__(self) -> int:
        """Holds whose blocks are still allocated, superseded ones included."""
        return len(self._holds)

    def hold(self, session_id: str, request_id: str, until_s: float,
             superseded_until_s: float) -> str | None:
        """Start a hold; a session's previous hold then ends by ``superseded_until_s``
        (returned, if any)."""
        previous = self._current.get(session_id)
        if previous == request_id:
            previous = None
        if previous is not None:
            old = self._holds.get(previous)
            if old is not None:
                old.superseded = True
                old.until_s = min(old.until_s, superseded_until_s)
        self._holds[request_id] = _Hold(session_id=session_id, until_s=until_s)
        self._current[session_id] = request_id
        return previous

    def due(self, now_s: float) -> dict[str, str]:
        """Holds whose time is up and not yet asked to end: request id -> reason.
        Each is returned once."""
        out: dict[str, str] = {}
        for request_id, hold in self._holds.items():
            if hold.ending is None and now_s >= hold.until_s:
                hold.ending = "superseded" if hold.superseded else "lease_ended"
                out[request_id] = hold.ending
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
        if self._current.get(hold.session_id) == request_id:
            del self._current[hold.session_id]
        return hold.ending or "pulled"
