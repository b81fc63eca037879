"""Patches that keep an engine with nothing to compute off the CPU: the spin on
vLLM's shared-memory queues, and the engine core's steps while it only holds blocks
or waits for P's parameters (early decode).  Process-wide, one engine per process."""

from __future__ import annotations

import functools
import math
import queue
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.device_communicators import shm_broadcast as _shm_broadcast
from vllm.v1.engine import core as _engine_core
from vllm.v1.executor import multiproc_executor as _multiproc_executor

__all__ = [
    "limit_engine_busy_poll",
    "pace_holding_steps",
    "set_engine_busy",
    "wait_for_prefill_params",
]


# Process-wide settings of the pacing patches below (None: not patched).
_busy_poll_cap_s: float | None = None


_holding_interval_s: float | None = None


# Whether the connector has something for the worker's next step (a hold begun whose
# blocks the worker has yet to digest): a holding engine then steps at once.
_holding_work_waiting: Callable[[], bool] | None = None


# Whether this engine has a model to run (see set_engine_busy); the cap applies only
# while it has none, unless spin_while_busy was turned off.
_engine_busy = False


_spin_while_busy = True


# A reader past its spin sleeps on a ZMQ notification, and a notification can be
# lost (vLLM's PUB has a high-water mark of 1 and its SUB conflates): at vLLM's 1 s
# spin that is rare and costs little, at a cap of milliseconds it happens every few
# dozen requests and leaves a step waiting until the caller's timeout (seconds).  So
# a capped reader also looks at the queue again after at most as long as it has been
# idle, within these bounds: a lost wake-up costs about a step, an idle engine
# wakes at most 1 / _POLL_MAX_S times a second.
_POLL_MIN_S = 0.001


_POLL_MAX_S = 0.05


def set_engine_busy(busy: bool) -> None:
    """Tell this process's queue readers whether the engine has a model to run.

    Set every step: by the scheduler half in the engine-core process, from the
    step it scheduled, and by the worker half in each worker process, from the
    connector metadata of the step it runs.  A busy engine spins as vLLM does
    (``busy_loop_s`` = 1 s): capping the spin while it decodes cost a connector engine
    2-3x the plain engine's time per token on a 2-core host, every hop between
    engine core and worker then waiting on a ZMQ wake-up.  An engine that only
    holds blocks, waits for KV or has stopped stepping is not busy and keeps the cap.
    """
    global _engine_busy
    _engine_busy = busy


def limit_engine_busy_poll(seconds: float, spin_while_busy: bool = True) -> None:
    """Cap how long this process spins on vLLM's shared-memory message queues while
    the engine is not busy (``set_engine_busy``; always, if not ``spin_while_busy``).

    The engine core and its workers talk through ``shm_broadcast.MessageQueue``; a
    reader waiting for the next message spins (``sched_yield``) for
    ``SpinCondition.busy_loop_s`` = 1 s after each read before it sleeps on a ZMQ
    notification that every write sends.  So an engine that served a request in the
    last second, or that steps only to hold blocks for a peer, keeps its worker and
    engine core spinning.  On a host with a few cores, two engines (P and D) spinning
    this way take the CPU that the other engine's real step needs.  Process-wide,
    idempotent; the smallest cap asked for wins.
    """
    global _busy_poll_cap_s, _spin_while_busy
    if seconds < 0:
        raise ValueError(f"busy-poll cap must be >= 0, got {seconds}")
    if _busy_poll_cap_s is None:
        original_wait = _shm_broadcast.SpinCondition.wait

        def wait_paced(self, timeout_ms=None):
            # vLLM's own spin, kept per reader: the cap below changes it per call.
            stock_s = self.__dict__.setdefault("_sessionkv_stock_busy_loop_s",
                                               self.busy_loop_s)
            if _engine_busy and _spin_while_busy:
                self.busy_loop_s = stock_s
                return original_wait(self, timeout_ms)
            self.busy_loop_s = min(stock_s, _busy_poll_cap_s)
            idle_s = time.monotonic() - self.last_read
            if idle_s > self.busy_loop_s:
                bound_ms = math.ceil(min(_POLL_MAX_S, max(_POLL_MIN_S, idle_s)) * 1e3)
                timeout_ms = bound_ms if timeout_ms is None else min(timeout_ms, bound_ms)
            return original_wait(self, timeout_ms)

        _shm_broadcast.SpinCondition.wait = wait_paced
        _busy_poll_cap_s = seconds
        _spin_while_busy = spin_while_busy
        _expect_sample_tokens_after_execute()
    else:
        _busy_poll_cap_s = min(_busy_poll_cap_s, seconds)
        _spin_while_busy = _spin_while_busy and spin_while_busy


def _expect_sample_tokens_after_execute() -> None:
    """Let a worker spin for the ``sample_tokens`` call that follows ``execute_model``.

    The spin window runs from the reader's last *read*, so a forward longer than the
    cap (2 ms on CPU) leaves the worker asleep on the ZMQ notification when the
    engine core, a fraction of a millisecond later, sends ``sample_tokens``: a
    traced P/D request's worker picked that call up 2.6 ms after it was sent.  So an
    ``execute_model`` call ends by restarting the window of the queue it came on,
    as a read does: the worker spins for the next call, for at most the cap (the
    spin's cost stays bounded as before when none follows, as after a step with
    nothing to sample, which is not waited for at all).  In an A/B on one 1P+1D
    cluster (interleaved blocks) P/D at
    max_tokens=2 went from 2.17x to 1.98x direct P.  Patches
    ``WorkerProc._execute_worker_rpc`` for this process (engine-core processes have
    none to call).
    """
    cls = _multiproc_executor.WorkerProc
    original = cls._execute_worker_rpc

    @functools.wraps(original)
    def execute_worker_rpc(self, rpc_request) -> None:
        original(self, rpc_request)
        spin = getattr(self.rpc_broadcast_mq, "_spin_condition", None)
        # Only after a step that ran the model: a step that only holds blocks or
        # waits for KV samples nothing, and spinning after it cost a holding D about
        # a tenth of a core (2 ms every 20 ms step).
        if rpc_request[0] == "execute_model" and spin is not None and _engine_busy:
            spin.record_read()

    cls._execute_worker_rpc = execute_worker_rpc


def _only_holding_blocks(core: Any) -> bool:
    """True when the engine steps only because finished requests still hold blocks
    (``Scheduler.has_finished_requests``: a peer has yet to read them, or a session
    lease runs), with nothing to schedule, no output to return and no load to wait for
    (a request waiting for remote KV is unfinished)."""
    scheduler = core.scheduler
    return (core.is_running() and not core.engines_running and not core.batch_queue
            and not scheduler.has_unfinished_requests() and not scheduler.finished_req_ids
            and scheduler.has_finished_requests())


def _only_awaiting_prefill(core: Any, held: int) -> bool:
    """True when every unfinished request is one the connector holds until its P's
    parameters arrive (early decode): a step would schedule nothing."""
    scheduler = core.scheduler
    return (held > 0 and core.is_running() and not core.engines_running
            and not core.batch_queue and not scheduler.running
            and not scheduler.finished_req_ids
            and scheduler.get_num_unfinished_requests() == held)


class _PrefillWait:
    """What ``wait_for_prefill_params`` installed: how many requests are held, and a
    wait for the next message that releases one."""

    def __init__(self, held: Callable[[], int], wait_s: Callable[[float], bool],
                 max_wait_s: float) -> None:
        self.held, self.wait_s, self.max_wait_s = held, wait_s, max_wait_s


_prefill_wait: _PrefillWait | None = None


# How often a held engine looks at its input queue while it waits for a message.
_INPUT_CHECK_S = 0.001


def _wait_for_prefill(core: Any, wait: _PrefillWait) -> None:
    deadline = time.monotonic() + wait.max_wait_s
    while core.input_queue.empty() and time.monotonic() < deadline:
        if wait.wait_s(_INPUT_CHECK_S):
            return


def wait_for_prefill_params(held: Callable[[], int], wait_s: Callable[[float], bool],
                            max_wait_s: float) -> None:
    """Let an engine whose only requests wait for their P's parameters (early decode)
    block on the message that releases them, instead of stepping.

    vLLM 0.32 steps such an engine back to back (``Scheduler.has_requests``), 1 ms
    apart: each step a round trip through the engine core and its worker, which then
    spins.  That takes the CPU the P engine computes those very parameters with.
    Here the engine core waits on ``wait_s`` (the early-decode socket) and checks its
    input queue every millisecond, so a new request waits at most that; it steps
    at least every ``max_wait_s`` (held requests time out by steps).  Patches
    ``EngineCoreProc._process_input_queue`` for this process; one engine per process.
    """
    global _prefill_wait
    _prefill_wait = _PrefillWait(held, wait_s, max_wait_s)
    _patch_input_queue()


def pace_holding_steps(interval_s: float,
                       work_waiting: Callable[[], bool] | None = None) -> None:
    """Let an engine that only holds blocks wait for input up to ``interval_s`` per step.

    vLLM 0.32's engine core steps back to back while finished requests hold blocks
    for a peer (``EngineCore.has_work``), sleeping 1 ms between empty steps: a P
    until D has read, a D for as long as a session lease runs.  That is most of a
    core per engine.  Here such an engine first waits on its input queue: a new
    request ends the wait at once; otherwise it steps every ``interval_s``, which
    still releases read blocks, expires leases and drives NIXL.  Unless
    ``work_waiting()``: the connector has work for the worker's next step, and a peer
    waits on it (a hold just begun, whose digest a reader's confirm waits for: waiting
    out the interval first held every P/D read up to 20 ms, the reader asking again
    every 2 ms).  Patches ``EngineCoreProc._process_input_queue`` for this process;
    idempotent.
    """
    global _holding_interval_s, _holding_work_waiting
    if interval_s <= 0:
        return
    if work_waiting is not None:
        _holding_work_waiting = work_waiting
    first = _holding_interval_s is None
    _holding_interval_s = interval_s if first else min(_holding_interval_s, interval_s)
    _patch_input_queue()


_input_queue_patched = False


def _patch_input_queue() -> None:
    global _input_queue_patched
    if _input_queue_patched:
        return
    _input_queue_patched = True
    cls = _engine_core.EngineCoreProc
    original = cls._process_input_queue

    def process_input_queue(self) -> None:
        if self.input_queue.empty():
            prefill_wait = _prefill_wait
            waiting = _holding_work_waiting
            if _holding_interval_s and _only_holding_blocks(self) and not (
                    waiting is not None and waiting()):
                try:
                    request = self.input_queue.get(timeout=_holding_interval_s)
                except queue.Empty:
                    pass
                else:
                    self._handle_client_request(*request)
            elif prefill_wait is not None and _only_awaiting_prefill(self,
                                                                     prefill_wait.held()):
                _wait_for_prefill(self, prefill_wait)
        original(self)

    cls._process_input_queue = process_input_queue
