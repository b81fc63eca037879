"""Background tasks: ending them (cancel, and wait until each has ended, whatever it
raised, so a stop or a removal leaves nothing running behind it), and the one task
per engine that the KV-event consumer and the handle channels each run."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

__all__ = ["EngineTasks", "cancel_all"]

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


class EngineTasks:
    """One background task per engine (its subscriber's loop), named
    ``{kind}-{engine}``; a removed engine's task, or every task at a stop, is ended by
    :func:`cancel_all`."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, engine: str, loop: Coroutine[Any, Any, None]) -> None:
        self._tasks[engine] = asyncio.create_task(loop, name=f"{self._kind}-{engine}")

    def failure(self, engine: str) -> BaseException | None:
        """What ended the engine's task on its own, if it ended (its loop raised, or
        returned, which it never should)."""
        task = self._tasks.get(engine)
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception() or RuntimeError("its loop returned")

    async def end(self, engine: str) -> None:
        task = self._tasks.pop(engine, None)
        if task is not None:
            await cancel_all([task])

    async def end_all(self) -> None:
        tasks, self._tasks = self._tasks, {}
        await cancel_all(tasks.values())
