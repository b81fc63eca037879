"""NIXL's connector classes and their private state: holds on finished requests
(``_reqs_need_send``), queued and posted reads, heartbeats, failed reads; and our
per-step instructions carried on NIXL's metadata object."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
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

from vllm_sessionkv.metadata import StepInstructions, WorkerReport

__all__ = [
    "NixlBaseConnector",
    "NixlPullConnector",
    "NixlPullConnectorScheduler",
    "NixlPullConnectorWorker",
    "attach_step_instructions",
    "cancel_read",
    "cancel_pending_send",
    "disable_stock_recompute_threshold",
    "fail_read",
    "gate_reads",
    "has_queued_read",
    "mark_in_batch",
    "peer_ready",
    "pending_send_deadline_unix_s",
    "read_block_pairs",
    "reads_in_flight",
    "recv_local_block_ids",
    "release_pending_send",
    "remote_blocks_processed",
    "remote_prefill_token_count",
    "report_invalid_blocks",
    "set_pending_send_deadline",
    "set_sync_recv_blocks",
    "start_ready_reads",
    "step_instructions",
    "stop_heartbeat",
    "worker_member",
    "worker_metadata",
    "worker_report",
]


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


def read_block_pairs(worker: NixlPullConnectorWorker,
                     meta: Any) -> tuple[tuple[int, int], ...]:
    """(local block, remote block) of a read about to be posted, first KV cache group,
    paired as stock code pairs them (the remote list end-trimmed to the local one,
    ``_apply_prefix_caching``), when each local block receives exactly one remote
    block of the same rank: same tensor-parallel size, block size and one kernel
    block a block on both sides.  Otherwise () (no per-block comparison is possible)."""
    try:
        info = worker.transfer_topo.get_engine_info(meta.remote.engine_id)
    except (AttributeError, KeyError):
        return ()
    if (info.remote_tp_size != worker.transfer_topo.tp_size
            or info.remote_block_size != worker.block_size
            or info.remote_physical_blocks_per_logical != 1
            or worker._physical_blocks_per_logical_kv_block != 1
            or len(meta.local_block_ids) != 1):
        return ()
    local = list(meta.local_block_ids[0])
    remote = list(meta.remote.block_ids[0]) if meta.remote.block_ids else []
    if not local or len(local) > len(remote):
        return ()
    return tuple(zip(local, remote[len(remote) - len(local):]))


def fail_read(worker: NixlPullConnectorWorker, request_id: str) -> None:
    """Report a read that will not be posted as failed, as stock code does for a
    peer it cannot reach: vLLM then recomputes the request's blocks."""
    worker._handle_failed_transfer(request_id, None, worker._recv_failures,
                                   record_failed_transfer=False)


def cancel_read(worker: NixlPullConnectorWorker, request_id: str) -> bool:
    """Abort a posted read given up on: release each of its NIXL transfer handles
    (NIXL aborts a transfer still in progress when its handle is released; a handle
    it cannot release stays, with the DMA possibly still running).  True when no
    handle is left: nothing can write the read's destinations any more, and stock
    code forgets the read (it will report it neither done nor failed)."""
    kept = [handle for handle in worker._recving_transfers.get(request_id, ())
            if not worker._try_release_xfer_handle(request_id, handle)]
    if kept:
        worker._recving_transfers[request_id] = kept
        return False
    worker._recving_transfers.pop(request_id, None)
    worker._recving_metadata.pop(request_id, None)
    worker._pending_recv_notifs.pop(request_id, None)
    return True


def pending_send_deadline_unix_s(deadline_perf_counter: float) -> float:
    """Convert a perf_counter deadline to wall-clock time for publishing."""
    return time.time() + (deadline_perf_counter - time.perf_counter())


def reads_in_flight(worker: NixlPullConnectorWorker) -> bool:
    """Whether the worker has NIXL reads posted and not yet seen done."""
    return bool(worker._recving_transfers)


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


def remote_blocks_processed(params: dict[str, Any] | None) -> bool:
    """Whether stock NIXL code already handled this request's remote blocks (its
    private marker in ``kv_transfer_params``, set once a load was queued or declined)."""
    return bool(params) and bool(params.get("_remote_blocks_processed"))


def remote_prefill_token_count(scheduler: NixlPullConnectorScheduler,
                               num_prompt_tokens: int) -> int:
    """Prompt tokens a P->D load may cover (stock keeps the last one, or more for
    some models, for D to compute)."""
    return scheduler._get_remote_prefill_token_count(num_prompt_tokens)


class _WorkerMetadata(KVConnectorWorkerMetadata):
    """Our ``WorkerReport`` as vLLM's worker->scheduler metadata (merged across
    workers by ``aggregate``)."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, _WorkerMetadata):
            return _WorkerMetadata(self.report.merge(other.report))
        return self


def worker_metadata(report: WorkerReport) -> KVConnectorWorkerMetadata | None:
    """What the worker's ``build_connector_worker_meta`` returns for this report."""
    return None if report.is_empty() else _WorkerMetadata(report)


def worker_report(connector_output: Any) -> WorkerReport:
    """The workers' merged report in a step's ``KVConnectorOutput`` (empty if none)."""
    meta = getattr(connector_output, "kv_connector_worker_meta", None)
    return meta.report if isinstance(meta, _WorkerMetadata) else WorkerReport()


def worker_member(worker: NixlPullConnectorWorker) -> str:
    """This worker's name among its engine's workers, for the pull guard's claims:
    its tensor-parallel rank, and its pipeline stage where there are several (each
    stage reads its own layers, so each claims and confirms on its own)."""
    if worker.pp_size > 1:
        from vllm.distributed.parallel_state import get_pp_group

        return f"pp{get_pp_group().rank_in_group}tp{worker.tp_rank}"
    return f"tp{worker.tp_rank}"
