"""Admission on D: D's session holds make room for a request D cannot admit.

Holds are capped at a share of the KV (``session_hold_max_kv_fraction``), so a
request that needs more than the rest (a long prompt on a small D) would wait,
admitted by nothing and D running nothing, until the holds' leases ran out: minutes
under the value rule.  vLLM asks the connector about a waiting request before it
allocates the request's blocks, and tells it after; a request asked about and not
allocated found no free blocks.  A step that runs nothing while such a request waits
ends holds (``SessionHolds.make_room``) until they cover what it lacks."""

from __future__ import annotations

from collections.abc import Callable

from vllm_sessionkv.scheduling.session_holds import SessionHolds

__all__ = ["Admission"]


class Admission:
    def __init__(self, holds: SessionHolds, block_size: int) -> None:
        self._holds = holds
        self._block_size = block_size
        # Requests vLLM asked about this step and has not allocated yet, with the
        # blocks each needs.
        self._asks: dict[str, int] = {}

    def asked(self, request_id: str, uncomputed_tokens: int) -> None:
        """vLLM asked about a request and allocates it next, if it has the blocks:
        those for its ``uncomputed_tokens``, and one more."""
        self._asks[request_id] = 1 + -(-uncomputed_tokens // self._block_size)

    def allocated(self, request_id: str) -> None:
        self._asks.pop(request_id, None)

    def make_room(self, running: float, free_blocks: Callable[[], int | None],
                  now_s: float) -> int:
        """At the end of a step's scheduling (``running``: the requests it runs):
        when it runs nothing while a request asked to be admitted, vLLM found no
        blocks for it.  Session holds end (least valuable first) to free what it
        lacks against vLLM's ``free_blocks`` (None: not known; then all it needs),
        or one at least, step after step: a hold never keeps a request out.
        Returns how many holds ended; the asks are this step's alone."""
        asks, self._asks = self._asks, {}
        if not asks or running > 0:
            return 0
        free = free_blocks()
        need = max(asks.values())
        return self._holds.make_room(max(1, need - free) if free is not None else need,
                                     now_s)
