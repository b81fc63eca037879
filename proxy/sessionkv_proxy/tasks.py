"""Ending background tasks: cancel them and wait until each has ended, whatever it
raised, so a stop or a removal leaves nothing running behind it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["cancel_all"]

# How long a cancelled task may take to end before it is cancelled again.
RECANCEL_AFTER_S = 1.0


async def cancel_all(tasks: Iterable[asyncio.Future],
                     recancel_after_s: float = RECANCEL_AFTER_S) -> None:
    """Cancel ``tasks`` and wait for every one to end, cancelling again each
    ``recancel_after_s`` those still running.  A cancellation can be lost inside a
    library (one that turns CancelledError into its own error, which a retry loop then
    catches): a proxy replica whose KV-event subscriber lost it waited on its ZMQ
    socket for ever and never exited on SIGTERM."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=recancel_after_s)
        for task in done:   # retrieved, so none is reported as never retrieved
            if not task.cancelled():
                task.exception()
