"""Ending background tasks: cancel them and wait until each has ended, whatever it
raised, so a stop or a removal leaves nothing running behind it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["cancel_all"]


async def cancel_all(tasks: Iterable[asyncio.Future]) -> None:
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
