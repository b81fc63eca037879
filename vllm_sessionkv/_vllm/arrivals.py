"""Requests as they reach the scheduler (``Scheduler.add_request``).

vLLM's connector API first hears of a request when the scheduler's waiting loop gets
to it (``get_num_new_matched_tokens``), and that loop stops at the first request it
cannot allocate: on a D under KV pressure a request sent early (early decode, while
P prefills) can wait long unasked, and meanwhile D would end the very hold P is about
to pull (``retention.py``: a hold whose next turn has arrived ends last).  So D hears
of each request here, as vLLM queues it.  Patches ``Scheduler.add_request`` for this
process (one engine per process; idempotent); the listener runs after vLLM queued the
request, and its error is logged, never raised into vLLM.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched import scheduler as _scheduler

__all__ = ["on_request_added"]

logger = logging.getLogger("vllm.sessionkv.arrivals")

_listener: Callable[[Any], None] | None = None
_add_request_patched = False


def on_request_added(listener: Callable[[Any], None]) -> None:
    """Call ``listener(request)`` for every request this process's scheduler queues."""
    global _listener
    _listener = listener
    _patch_add_request()


def _patch_add_request() -> None:
    global _add_request_patched
    if _add_request_patched:
        return
    _add_request_patched = True
    cls = _scheduler.Scheduler
    original = cls.add_request

    @functools.wraps(original)
    def add_request(self, request) -> None:
        original(self, request)
        listener = _listener
        if listener is not None:
            try:
                listener(request)
            except Exception:   # a hint for retention; never fail vLLM's queueing
                logger.exception("sessionkv: request arrival hook failed for %s",
                                 getattr(request, "request_id", "?"))

    cls.add_request = add_request
