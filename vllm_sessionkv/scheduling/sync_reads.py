"""Synchronous reads: a short pull from a peer this engine has already read from
runs inside the step that computes its request (``cost.decide_sync_load``), which
saves the request the step an asynchronous read spends waiting.  A first read from
a peer waits for a NIXL handshake, which no forward should wait for; a failed read
makes its peer asynchronous again until a read from it succeeds."""

from __future__ import annotations

from collections.abc import Collection

from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.scheduling.remote_plan import RemotePlan

__all__ = ["SyncReads"]


class SyncReads:
    def __init__(self, possible: bool) -> None:
        # vLLM can map a failed synchronous read back to its blocks only with one KV
        # cache group; and the config can turn them off.
        self.possible = possible
        self._warm_engines: set[str] = set()
        self._next: set[str] = set()      # queued for the next step's metadata
        self._in_step: set[str] = set()   # in the step the worker runs now

    def choose(self, plan: RemotePlan, complete_handle: bool, num_tokens: int,
               pricing: Pricing) -> None:
        """Make the plan's read synchronous where the price allows.  vLLM computes at
        least the last token itself (the last prompt token, or P's token after a
        handoff), so a synchronous read stops short of it.  Without a complete handle
        stock code queues no read, and a synchronous load would run the forward on
        blocks nothing wrote."""
        if not (self.possible and plan.load_tokens > 0 and complete_handle
                and plan.remote_engine_id in self._warm_engines):
            return
        sync_tokens = min(plan.load_tokens, num_tokens - 1 - plan.local_hit_tokens)
        if sync_tokens > 0 and pricing.sync_read(sync_tokens):
            plan.sync = True
            plan.load_tokens = sync_tokens

    def queued(self, request_id: str) -> None:
        self._next.add(request_id)

    def take_next(self) -> set[str]:
        """The reads the next step runs synchronously (for the worker)."""
        step, self._next = self._next, set()
        self._in_step |= step
        return step

    def finished_step(self, received: Collection[str], failed: Collection[str],
                      plans: dict[str, RemotePlan], now_s: float) -> None:
        """A step's output: time each read seen done (a synchronous read is done by the
        end of its step and never reported received), and warm the peers read from."""
        for req_id in set(received) | self._in_step:
            plan = plans.get(req_id)
            if plan is not None and plan.pull_started_s:
                plan.pull_ms = (now_s - plan.pull_started_s) * 1e3
                if req_id in received and req_id not in failed and plan.remote_engine_id:
                    self._warm_engines.add(plan.remote_engine_id)
        self._in_step.clear()

    @staticmethod
    def failed_by_blocks(plans: dict[str, RemotePlan], invalid: Collection[int]
                         ) -> list[str]:
        """Synchronous reads whose destinations vLLM reported invalid (a failed one
        comes back only as invalid blocks; vLLM recomputes them)."""
        return [req_id for req_id, plan in plans.items()
                if plan.sync and not plan.failed and not plan.sync_block_ids.isdisjoint(
                    invalid)]

    def cool(self, remote_engine_id: str) -> None:
        """Read asynchronously from this peer again until a read succeeds."""
        self._warm_engines.discard(remote_engine_id)
