"""The scheduler's prices: pull from a peer or restore from host against recompute,
and whether a read may run inside the step that computes its request.

It keeps the engine's live inputs, all smoothed: the load (requests per step), the
link's measured bandwidth (NIXL's telemetry) and the recompute price per token (the
engine's own prefill steps, timed by the scheduler; ``cost.recompute_s_per_token``
pins it).  Every decision goes through ``decide`` (one
``PullQuote`` construction); ``wire/cost.py`` holds the arithmetic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from vllm_sessionkv.config import CostConfig
from vllm_sessionkv.wire.cost import (
    LinkModel,
    PullDecision,
    PullQuote,
    RecomputeModel,
    calibrate_s_per_token,
    decide_pull,
    decide_sync_load,
    attention_pairs,
    transfer_time_s,
)

# Steps scheduled and not yet seen finished (vLLM's async scheduling keeps one more in
# flight): more than this means outputs were lost, and the oldest are dropped.
_MAX_STEPS_IN_FLIGHT = 4

__all__ = ["Pricing"]


class Pricing:
    def __init__(self, cost: CostConfig, kv_bytes_per_token: float,
                 host_link: LinkModel) -> None:
        self.cost = cost
        self.kv_bytes_per_token = kv_bytes_per_token
        # Configured: pinned; unset: calibrated from the prior on.
        self.recompute_pinned = cost.recompute_s_per_token is not None
        self.recompute_model = RecomputeModel(
            s_per_token=(cost.recompute_s_per_token if self.recompute_pinned
                         else cost.recompute_prior_s_per_token),
            s_per_token_per_context_token=cost.recompute_s_per_token_per_context_token,
            load_slowdown_per_unit=cost.load_slowdown_per_unit)
        self.host_link = host_link
        self.link_bytes_per_s = cost.link_bytes_per_s
        self.engine_load = 0.0
        # Requests vLLM has asked about and not yet finished: when a request finds
        # none, the engine was idle, whatever its last busy steps left in the estimate.
        self._live_requests: set[str] = set()
        # Steps built and not yet finished: (built at, new tokens, attention pairs).
        self._steps: deque[tuple[float, int, float]] = deque(maxlen=_MAX_STEPS_IN_FLIGHT)
        self._last_step_end = 0.0

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

    def step_built(self, now: float, work: Iterable[tuple[int, int]],
                   timed: bool = True) -> None:
        """A step was scheduled at ``now`` that computes, per request, (new tokens,
        tokens before them).  ``timed=False``: the step also waits for something
        else (a synchronous read, host copies), so its time says nothing of recompute."""
        work = list(work)
        tokens = sum(n for n, _ in work) if timed else 0
        pairs = sum(attention_pairs(n, c) for n, c in work) if timed else 0.0
        self._steps.append((now, tokens, pairs))

    def step_finished(self, now: float) -> bool:
        """The oldest step in flight has its output at ``now``: time it from when it
        could start (built, and the step before it finished).  Whether the recompute
        price moved."""
        if not self._steps:
            return False
        built, tokens, pairs = self._steps.popleft()
        started = max(built, self._last_step_end)
        self._last_step_end = now
        return self.observe_step_timing(tokens, pairs, now - started)

    def observe_step_timing(self, tokens: int, pairs: float, step_s: float) -> bool:
        """One engine step computed ``tokens`` new tokens over ``pairs`` attention
        pairs in ``step_s``: refine the recompute price unless it is pinned.  Whether
        the price moved."""
        if self.recompute_pinned:
            return False
        model = self.recompute_model
        s_per_token = calibrate_s_per_token(
            model.s_per_token, tokens, pairs, step_s, model.s_per_token_per_context_token,
            self.cost.recompute_ewma_alpha, self.cost.recompute_min_sample_tokens)
        if s_per_token == model.s_per_token:
            return False
        self.recompute_model = RecomputeModel(
            s_per_token=s_per_token,
            s_per_token_per_context_token=model.s_per_token_per_context_token,
            load_slowdown_per_unit=model.load_slowdown_per_unit)
        return True

    def observe_transfers(self, num_bytes: Iterable[float],
                          durations_s: Iterable[float]) -> None:
        alpha = self.cost.bandwidth_ewma_alpha
        for size, duration_s in zip(num_bytes, durations_s):
            # Small transfers measure latency, which per_transfer_s already prices;
            # counting them as bandwidth would drag the estimate down step by step.
            if size >= self.cost.bandwidth_min_sample_bytes and duration_s > 0:
                self.link_bytes_per_s = ((1 - alpha) * self.link_bytes_per_s
                                         + alpha * size / duration_s)
