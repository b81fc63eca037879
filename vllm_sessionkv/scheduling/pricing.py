"""The scheduler's prices: pull from a peer or restore from host against recompute,
and whether a read may run inside the step that computes its request.

It keeps the engine's live inputs, both smoothed: the load (requests per step) and
the link's measured bandwidth.  Every decision goes through ``decide`` (one
``PullQuote`` construction); ``wire/cost.py`` holds the arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_sessionkv.config import CostConfig
from vllm_sessionkv.wire.cost import (
    LinkModel,
    PullDecision,
    PullQuote,
    RecomputeModel,
    decide_pull,
    decide_sync_load,
    transfer_time_s,
)

__all__ = ["Pricing"]


class Pricing:
    def __init__(self, cost: CostConfig, kv_bytes_per_token: float,
                 host_link: LinkModel) -> None:
        self.cost = cost
        self.kv_bytes_per_token = kv_bytes_per_token
        self.recompute_model = RecomputeModel(
            s_per_token=cost.recompute_s_per_token,
            s_per_token_per_context_token=cost.recompute_s_per_token_per_context_token,
            load_slowdown_per_unit=cost.load_slowdown_per_unit)
        self.host_link = host_link
        self.link_bytes_per_s = cost.link_bytes_per_s
        self.engine_load = 0.0
        # Requests vLLM has asked about and not yet finished: when a request finds
        # none, the engine was idle, whatever its last busy steps left in the estimate.
        self._live_requests: set[str] = set()

    @property
    def peer_link(self) -> LinkModel:
        return LinkModel(bytes_per_s=self.link_bytes_per_s,
                         per_transfer_s=self.cost.per_transfer_s)

    def decide(self, tokens: int, context_tokens: int, link: LinkModel) -> PullDecision:
        """Move ``tokens`` over ``link`` or recompute them after ``context_tokens``."""
        return decide_pull(
            PullQuote(pull_tokens=tokens, context_tokens=context_tokens,
                      kv_bytes_per_token=self.kv_bytes_per_token,
                      engine_load=self.engine_load),
            self.recompute_model, link, min_pull_tokens=self.cost.min_pull_tokens)

    def sync_read(self, tokens: int) -> bool:
        """Whether a read of ``tokens`` from a peer may stall this step's forward."""
        read_s = transfer_time_s(tokens * self.kv_bytes_per_token, self.link_bytes_per_s,
                                 self.cost.per_transfer_s)
        return decide_sync_load(read_s, self.engine_load, self.cost.sync_load_max_stall_s)

    def note_live(self, request_id: str) -> None:
        # The load estimate only moves when the engine steps, and an idle engine does
        # not step: without this reset the first request after a busy spell would be
        # priced as if that spell were still on (recompute overpriced, every read
        # made asynchronous).
        if not self._live_requests:
            self.engine_load = 0.0
        self._live_requests.add(request_id)

    def finished(self, request_id: str) -> None:
        self._live_requests.discard(request_id)

    def observe_step(self, running: float) -> None:
        # Smoothed over a few steps: one step between batches says little about how
        # busy the engine is.
        alpha = self.cost.load_ewma_alpha
        self.engine_load = (1 - alpha) * self.engine_load + alpha * running

    def observe_transfers(self, num_bytes: Iterable[float],
                          durations_s: Iterable[float]) -> None:
        alpha = self.cost.bandwidth_ewma_alpha
        for size, duration_s in zip(num_bytes, durations_s):
            # Small transfers measure latency, which per_transfer_s already prices;
            # counting them as bandwidth would drag the estimate down step by step.
            if size >= self.cost.bandwidth_min_sample_bytes and duration_s > 0:
                self.link_bytes_per_s = ((1 - alpha) * self.link_bytes_per_s
                                         + alpha * size / duration_s)
