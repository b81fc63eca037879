"""Worker half of the connector: stock NIXL reads, tuned for the platform.

The transfer logic is vLLM's own.  We change how the NIXL agent is built (on CPU: no
spinning progress thread, thread-safe UCX workers, shared-memory transports) and
give the worker the stats container the scheduler uses, so both halves aggregate.
"""

from __future__ import annotations

import logging
import time

from vllm_sessionkv._vllm import engine_state, metrics, nixl_agent, nixl_state, pacing, version
from vllm_sessionkv.config import SessionKVConfig
from vllm_sessionkv.disk_tier import DiskBlockStore, layout_fingerprint
from vllm_sessionkv.host_tier import HostBlockPool
from vllm_sessionkv.kv_digest import TEST_CORRUPT_HELD_KV_ENV, KVDigester
from vllm_sessionkv.metadata import HostCopy, HostCopyKind, WorkerReport
from vllm_sessionkv.read_guard import GuardedRead, ReadGuard
from vllm_sessionkv.stats import SessionKVStats

__all__ = ["SessionKVWorker"]

logger = logging.getLogger("vllm.sessionkv.worker")

# Poll interval of a wait for reads (an idle step's, or a synchronous load's): short
# against a read (~1 ms), long enough to leave the core to the peer engine.
_READ_POLL_S = 100e-6


def _merge(results, more):
    """Fold one poll's transfer results into another's; returns ``results``."""
    results.finished_sending |= more.finished_sending
    results.finished_recving |= more.finished_recving
    results.failed_recving |= more.failed_recving
    return results


class SessionKVWorker(nixl_state.NixlPullConnectorWorker):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config, config: SessionKVConfig):
        with nixl_agent.nixl_agent_options(*config.nixl_agent_options(version.is_cpu_platform())), \
                nixl_agent.keep_thread_affinity():
            super().__init__(vllm_config, engine_id, kv_cache_config)
        metrics.worker_set_stats(self, SessionKVStats())
        self.sessionkv_config = config
        self._kv_cache_config = kv_cache_config
        self.host_pool: HostBlockPool | None = None
        self.disk_store: DiskBlockStore | None = None
        self._vllm_config = vllm_config
        # Disk-tier reads since the last step report: promoted and refused hashes.
        self._disk_promoted: set[bytes] = set()
        self._disk_refused: set[bytes] = set()
        self._idle_step = False
        # Results seen while a synchronous load waited, reported with this step's.
        self._early_results = None
        # Synchronous loads given up on: their reads may still land; never report them.
        self._abandoned_sync: set[str] = set()
        # Synchronous reads run since the last step report, good or not (the
        # scheduler puts a good one's blocks back into the prefix cache).
        self._sync_loads_done: set[str] = set()
        # Session holds the scheduler ended (lease, superseded, reset), released here
        # and reported sent with this step's results.
        self._released_holds: set[str] = set()
        # The pull guard, as reader (guard.py): reads of held blocks are claimed
        # before they are posted and confirmed before they are reported received.
        self._guard: ReadGuard | None = None
        self._held_back: dict[str, object] = {}    # request id -> stock ReqMeta
        self._confirmed: set[str] = set()
        self._refuted: set[str] = set()
        if config.pull_guard:
            self._guard = ReadGuard(engine_id, member=nixl_state.worker_member(self),
                                    timeout_s=config.pull_guard_timeout_s,
                                    digest_wait_s=config.pull_claim_ttl_s)
            self._post_read = nixl_state.gate_reads(self, self._before_read)
        # The content digest (kv_digest.py): of holds as they begin, for the scheduler
        # (build_connector_worker_meta); of guarded reads, compared at their confirm.
        self._digest_on = False      # decided with the KV caches (register_kv_caches)
        self._corrupt_holds = KVDigester.corrupt_for_test()   # tests only
        self._digester: KVDigester | None = None
        self._held_digests: dict[str, dict[int, int]] = {}

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        self._digest_on = self.sessionkv_config.kv_digest_active(
            len(self._kv_cache_config.kv_cache_groups))
        if self._digest_on or self._corrupt_holds:
            self._digester = KVDigester(kv_caches, self._kv_cache_config.num_blocks)
        if self.sessionkv_config.host_tier_bytes:
            block_bytes = engine_state.kv_bytes_per_block(self._kv_cache_config)
            self.host_pool = HostBlockPool(
                kv_caches, self._kv_cache_config.num_blocks,
                self.sessionkv_config.host_tier_bytes // block_bytes,
                pin_memory=not version.is_cpu_platform())
            if self.sessionkv_config.disk_tier_bytes:
                model = self._vllm_config.model_config.model
                self.disk_store = DiskBlockStore(
                    self.sessionkv_config.disk_tier_dir, self._vllm_config.parallel_config.rank,
                    layout_fingerprint(f"{model}|{self.host_pool.layout()}"), self.host_pool)

    def start_load_kv(self, metadata):
        # Host copies first, in the scheduler's order: a restore may read a slot a
        # store in the same step wrote.
        ours = nixl_state.step_instructions(metadata)
        for copy in ours.host_copies:
            if self.host_pool is None:
                continue
            started = time.perf_counter()
            if copy.kind is HostCopyKind.STORE:
                self.host_pool.store(copy.src, copy.dst)
                self.xfer_stats.record("host_store_s", time.perf_counter() - started)
                if self.disk_store is not None:
                    self.disk_store.stored_into(copy.dst)
            elif copy.kind is HostCopyKind.LOAD:
                self.host_pool.load(copy.src, copy.dst)
                self.xfer_stats.record("host_restore_s", time.perf_counter() - started)
            else:
                self._disk_copy(copy)
        self._idle_step = ours.idle_step
        pacing.set_engine_busy(not self._idle_step)
        if self._guard is not None:
            self._guard.expect(ours.read_guards)
        super().start_load_kv(metadata)
        self._digest_holds(ours.holds_started)
        self._poll_guard()
        # After stock code has taken this step's held sends, which a reset in the
        # same step may already release.
        for req_id in ours.release_holds:
            if nixl_state.release_pending_send(self, req_id):
                self._released_holds.add(req_id)
        # Sends whose free waited for a reader's claim to end (guard.py).
        self._released_holds |= ours.report_sent
        if ours.sync_loads:
            self._finish_sync_loads(set(ours.sync_loads))

    def _disk_copy(self, copy: HostCopy) -> None:
        """One disk-tier operation, in the scheduler's order (disk_tier.py)."""
        if self.disk_store is None:
            # No disk tier here: every read is refused, so the scheduler forgets it.
            if copy.kind is HostCopyKind.PROMOTE:
                self._disk_refused.update(copy.block_hashes)
            return
        if copy.kind is HostCopyKind.SPILL:
            for slot, block_hash in zip(copy.src, copy.block_hashes):
                self.disk_store.spill(slot, block_hash)
        elif copy.kind is HostCopyKind.PROMOTE:
            started = time.perf_counter()
            for block_hash, slot in zip(copy.block_hashes, copy.dst):
                done = self.disk_store.promote(block_hash, slot)
                (self._disk_promoted if done else self._disk_refused).add(block_hash)
            self.xfer_stats.record("disk_read_s", time.perf_counter() - started)
        else:
            for block_hash in copy.block_hashes:
                self.disk_store.drop(block_hash)

    def _finish_sync_loads(self, pending: set[str]) -> None:
        """Wait for this step's synchronous reads before the forward that uses them.

        vLLM already counts their tokens as computed, so they are reported neither
        received nor failed (both are for requests parked waiting; vLLM's aggregator
        would hold a failure it never sees received).  A failed or overdue read is
        reported as invalid blocks, and vLLM recomputes from the first of them."""
        started = time.perf_counter()
        deadline = started + self.sessionkv_config.sync_load_timeout_s
        blocks = {req_id: nixl_state.recv_local_block_ids(self, req_id) for req_id in pending}
        while True:
            # A read whose handshake finished while we wait is posted now, not next step.
            nixl_state.start_ready_reads(self)
            self._poll_guard()
            results = self._merge_early(self._guarded(super().get_transfer_results()))
            pending -= results.finished_recving
            if not pending or time.perf_counter() >= deadline:
                break
            time.sleep(_READ_POLL_S)
        for req_id in pending:   # overdue: the read is still posted, or still claimed
            if self._held_back.pop(req_id, None) is not None:
                # Its claim was not answered in time: no read will be posted.
                nixl_state.fail_read(self, req_id)
            else:
                self._cancel_overdue_read(req_id)
            if self._guard is not None:
                self._guard.release(req_id, time.perf_counter())
            self._abandoned_sync.add(req_id)
            nixl_state.report_invalid_blocks(self, blocks[req_id])
            self.xfer_stats.record("sync_load_timeouts", 1)
        self._sync_loads_done |= blocks.keys()
        # (Stock code has queued the invalid blocks of reads that failed.)
        results.finished_recving -= blocks.keys()
        results.failed_recving -= blocks.keys()
        self.xfer_stats.record("sync_load_wait_s", time.perf_counter() - started)

    def _cancel_overdue_read(self, req_id: str) -> None:
        """A synchronous read past its timeout is aborted before the step goes on:
        vLLM recomputes into its destination blocks, and may free and reuse them,
        so no late write may land there.  A transfer NIXL cannot abort yet is waited
        for (it ends, done or failed, when the transport does)."""
        warned_s = time.perf_counter()
        while not nixl_state.cancel_read(self, req_id):
            if time.perf_counter() - warned_s >= 1.0:
                warned_s = time.perf_counter()
                logger.warning("sessionkv: waiting for NIXL to end the overdue "
                               "synchronous read of request %s", req_id)
            time.sleep(_READ_POLL_S)

    def build_connector_worker_meta(self):
        member = nixl_state.worker_member(self)
        report = WorkerReport(
            sync_loads_done=frozenset(self._sync_loads_done),
            held_digests={r: {member: d} for r, d in self._held_digests.items()},
            disk_promoted=frozenset(self._disk_promoted),
            disk_refused=frozenset(self._disk_refused))
        self._sync_loads_done, self._held_digests = set(), {}
        self._disk_promoted, self._disk_refused = set(), set()
        return nixl_state.worker_metadata(report)

    def _merge_early(self, results):
        if self._early_results is None:
            self._early_results = results
            return results
        return _merge(self._early_results, results)

    # ------------------------------------------------------------- content digest
    def _digest(self, block_ids: list[int]) -> tuple[int, ...]:
        started = time.perf_counter()
        digests = tuple(self._digester.digest(block_ids))
        self.xfer_stats.record("kv_digest_s", time.perf_counter() - started)
        self.xfer_stats.record("kv_digest_blocks", len(block_ids))
        return digests

    def _digest_holds(self, holds: dict[str, list[int]]) -> None:
        if self._digester is None:
            return
        for req_id, blocks in holds.items():
            if self._digest_on:
                self._held_digests[req_id] = dict(zip(blocks, self._digest(blocks)))
            if self._corrupt_holds:
                self._digester.corrupt(blocks)
                logger.warning("sessionkv TEST ONLY (%s=1): overwrote the %d held blocks of "
                               "request %s after their digest", TEST_CORRUPT_HELD_KV_ENV,
                               len(blocks), req_id)

    # ------------------------------------------------------------- pull guard
    def _before_read(self, req_id: str, meta) -> bool:
        """Stock code is about to post this read: go ahead, or hold it back while its
        claim is asked (guard.py).  Reads of nothing (notify-only) and unguarded
        reads go ahead; so does a first read from a peer not yet handshaken with,
        which stock code brings back here once the handshake is done."""
        guard = self._guard
        token = guard.token(req_id)
        if token is None or guard.is_granted(req_id):
            return True
        remote = meta.remote
        if not any(meta.local_block_ids) or not nixl_state.peer_ready(self, remote.engine_id):
            return True
        guard.claim(GuardedRead(
            request_id=req_id, holder_engine_id=remote.engine_id,
            holder_request_id=remote.request_id, token=token, host=remote.host,
            port=remote.port, local_blocks=frozenset(meta.local_block_ids[0]),
            digest_pairs=nixl_state.read_block_pairs(self, meta) if self._digest_on else ()),
            time.perf_counter())
        self._held_back[req_id] = meta
        return False

    def _poll_guard(self) -> None:
        """Post the reads whose claims were granted; fail those refused; take the
        confirms' answers."""
        if self._guard is None or not self._guard.waiting:
            return
        now = time.perf_counter()
        polled = self._guard.poll(now)
        for req_id in polled.granted:
            meta = self._held_back.pop(req_id, None)
            if meta is None:     # given up on (a synchronous load's timeout) meanwhile
                self._guard.release(req_id, now)
            else:
                self._post_read(req_id, meta)
        for req_id, reason in polled.refused:
            self._count_guard_fallback("claim", reason, req_id)
            if self._held_back.pop(req_id, None) is not None:
                nixl_state.fail_read(self, req_id)
        self._confirmed.update(polled.confirmed)
        for check in polled.digest_checks:
            self.xfer_stats.record(f"kv_digest_{check}", 1)
        for read, reason in polled.refuted:
            if reason == "digest_mismatch":
                logger.warning("sessionkv digest: the KV read for request %s differs from "
                               "the holder's digest of request %s on engine %s; "
                               "recomputing", read.request_id, read.holder_request_id,
                               read.holder_engine_id)
            else:
                self._count_guard_fallback("confirm", reason, read.request_id)
            if read.request_id in self._abandoned_sync:
                # Given up on and already reported invalid: its blocks may be
                # another request's by now.
                continue
            # The read may have seen another request's KV: never attach or cache it.
            nixl_state.report_invalid_blocks(self, set(read.local_blocks))
            self._refuted.add(read.request_id)

    def _count_guard_fallback(self, stage: str, reason: str, req_id: str) -> None:
        kind = f"{stage}_timeout" if reason == "timeout" else f"{stage}_refused"
        self.xfer_stats.record(f"pull_guard_{kind}", 1)
        logger.info("sessionkv guard: %s of request %s %s (%s); recomputing", stage,
                    req_id, "timed out" if reason == "timeout" else "refused", reason)

    def _guarded(self, results):
        """Hold back guarded reads that completed until their confirm is answered;
        report the answered ones: received, or failed (recomputed)."""
        guard = self._guard
        if guard is None:
            return results
        now = time.perf_counter()
        for req_id in results.finished_recving:
            if not guard.is_granted(req_id):
                continue
            if req_id in results.failed_recving:
                guard.release(req_id, now)
            elif not guard.confirming(req_id):
                pairs = guard.granted_read(req_id).digest_pairs
                guard.confirm(req_id, now, self._digest([local for local, _ in pairs])
                              if pairs else None)
        results.finished_recving -= {r for r in results.finished_recving
                                     if guard.confirming(r)}
        self._poll_guard()
        results.finished_recving |= self._confirmed | self._refuted
        results.failed_recving |= self._refuted
        self._confirmed, self._refuted = set(), set()
        return results

    def get_transfer_results(self):
        results = self._idle_wait_results()
        if self._early_results is not None:
            results = self._merge_early(results)
            self._early_results = None
        # Before the abandoned synchronous reads are dropped: a confirm may name one.
        results = self._guarded(results)
        if self._abandoned_sync:
            late = (results.finished_recving | results.failed_recving) & self._abandoned_sync
            results.finished_recving -= late
            results.failed_recving -= late
            self._abandoned_sync -= late
        if self._released_holds:
            results.finished_sending |= self._released_holds
            self._released_holds = set()
        return results

    def shutdown(self):
        if self._guard is not None:
            self._guard.close()
        super().shutdown()

    def _idle_wait_results(self):
        wait_s = self.sessionkv_config.idle_step_recv_wait_s
        waits = bool(self._idle_step and wait_s and nixl_state.reads_in_flight(self))
        started = time.perf_counter()
        results = super().get_transfer_results()
        if not waits:
            return results
        # No model to run this step, so waiting here costs nothing but lets the
        # scheduler see a read that lands now in this step's output, not a later one.
        deadline = started + wait_s
        while nixl_state.reads_in_flight(self) and time.perf_counter() < deadline:
            time.sleep(_READ_POLL_S)
            _merge(results, super().get_transfer_results())
        self.xfer_stats.record("idle_step_recv_wait_s", time.perf_counter() - started)
        return results
