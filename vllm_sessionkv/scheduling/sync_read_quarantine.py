"""Synchronous reads not yet proven: their blocks stay out of the prefix cache.

vLLM hashes a synchronous read's blocks when it allocates them, before the read runs,
and under ``kv_load_failure_policy: recompute`` keeps a failed read's blocks findable
until the request recomputes them: an abort, a preemption or a chunked recompute in
between would leave KV nothing wrote under the prompt's hashes (the whole case:
``_vllm/prefix_cache.py``, docs/kv_lifetimes.md).  So a read's blocks are taken out
of the prefix cache when it is queued and put back once it is proven: its step's
worker report names it and vLLM reported none of its blocks invalid, or its request
finished on an output first.  A failed read's blocks stay out; vLLM's recompute
caches them as it schedules the tokens that rewrite them.

This component decides which blocks and when, on plain data; the scheduler applies
its answers to vLLM's prefix cache (``_vllm/prefix_cache.py``: ``hide``, ``restore``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Generic, TypeVar

__all__ = ["SyncReadQuarantine"]

# The request as vLLM holds it: kept only to be handed back for ``restore``.
R = TypeVar("R")


class SyncReadQuarantine(Generic[R]):
    def __init__(self, enabled: bool) -> None:
        # Off only for tests' negative control (``sync_read_quarantine``).
        self.enabled = enabled
        # Reads queued and not yet proven or failed, by request id.
        self._unproven: dict[str, R] = {}

    def queued(self, request_id: str, request: R, block_ids: Sequence[int],
               first_block: int) -> list[int]:
        """A synchronous read was queued for ``request``, whose blocks (first KV cache
        group) are ``block_ids`` and whose first ``first_block`` were a local hit:
        the blocks to take out of the prefix cache until it is proven.  vLLM hashed
        the read's blocks, and the ones after them that the step computes, at
        allocation; a local hit was written before and stays findable.  Nothing
        while the quarantine is off."""
        if not self.enabled:
            return []
        self._unproven[request_id] = request
        return list(block_ids[first_block:])

    def settle(self, done: Collection[str], failed: Collection[str]) -> list[R]:
        """The synchronous reads a step ran (``done``; ``failed``: those vLLM reported
        invalid blocks for): the requests whose blocks go back into the prefix cache,
        the good ones.  Either way each read is no longer unproven."""
        proven = []
        for request_id in done:
            request = self._unproven.pop(request_id, None)
            if request is not None and request_id not in failed:
                proven.append(request)
        return proven

    def finished(self, request_id: str, with_output: bool) -> bool:
        """A request ended (``with_output``: on an output of its own, not by an abort):
        whether its blocks go back now.  One that finished on an output ran its read's
        step without failing (vLLM skips a failed read's request in that step's
        output), though the step's report is still on its way.  An aborted one's
        blocks stay out."""
        return self._unproven.pop(request_id, None) is not None and with_output
