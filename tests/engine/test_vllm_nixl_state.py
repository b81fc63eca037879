"""NIXL's private scheduler and worker state (``_vllm/nixl_state.py``).

The private vLLM 0.32 surface checked by name, and the patch or accessor checked on
vLLM's own objects.  With vLLM installed these tests fail, never skip: an ImportError
here is the likeliest sign of a vLLM upgrade.
"""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import nixl_state  # noqa: E402


def test_scheduler_private_state_exists():
    src = inspect.getsource(nixl_state.NixlPullConnectorScheduler.__mro__[1].__init__)
    for attr in ("_reqs_need_send", "_reqs_need_recv", "_reqs_not_processed", "_reqs_in_batch",
                 "kv_recompute_threshold", "is_bidirectional_kv_xfer_enabled", "block_size"):
        assert f"self.{attr}" in src, attr
    assert hasattr(nixl_state.NixlPullConnectorScheduler, "_get_remote_prefill_token_count")


def test_worker_send_lease_state_exists():
    """``release_pending_send`` undoes what stock expiry undoes, minus its counting."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    init_src = inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    for attr in ("_reqs_to_send", "_reqs_to_process", "consumer_notification_counts_by_req",
                 "expected_consumer_notifications_by_req"):
        assert f"self.{attr}" in init_src, attr
    reap = inspect.getsource(base_worker.NixlBaseConnectorWorker._reap_expired_send_leases)
    for line in ("del self._reqs_to_send[req_id]", "self._reqs_to_process.remove(req_id)",
                 "self.consumer_notification_counts_by_req.pop(req_id, 0)",
                 "self.expected_consumer_notifications_by_req.pop(req_id, None)",
                 "done_sending.add(req_id)"):
        assert line in reap, line


def test_reset_reaches_the_connector_after_the_block_pool():
    """vLLM resets its block pool, then asks the connector (``reset_cache``): a reset
    that drops our holds reports failure until the next step frees their blocks."""
    from vllm.v1.core.sched.scheduler import Scheduler

    src = inspect.getsource(Scheduler.reset_prefix_cache)
    assert src.index("self.kv_cache_manager.reset_prefix_cache()") < src.index(
        "self.reset_connector_cache()")
    assert "self.connector.reset_cache()" in inspect.getsource(Scheduler.reset_connector_cache)


def test_private_scheduler_helpers_read_stock_state():
    assert not nixl_state.remote_blocks_processed(None)
    assert not nixl_state.remote_blocks_processed({"do_remote_decode": True})
    assert nixl_state.remote_blocks_processed({"_remote_blocks_processed": True})
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        base_scheduler,
        pull_scheduler,
    )

    src = inspect.getsource(base_scheduler) + inspect.getsource(pull_scheduler)
    assert '"_remote_blocks_processed"' in src
    assert callable(nixl_state.NixlPullConnectorScheduler._get_remote_prefill_token_count)


def test_synchronous_read_surface_exists():
    """nixl_state.set_sync_recv_blocks / start_ready_reads / recv_local_block_ids /
    report_invalid_blocks / stop_heartbeat, and the vLLM behaviour they rely on."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker
    from vllm.v1.core.sched import scheduler
    from vllm.v1.worker import kv_connector_model_runner_mixin

    worker_init = inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    for attr in ("_ready_requests", "_recving_metadata", "_invalid_block_ids"):
        assert f"self.{attr}" in worker_init, attr
    assert hasattr(nixl_state.NixlPullConnectorWorker, "_read_blocks_for_req")
    assert hasattr(base_scheduler.NixlBaseConnectorScheduler, "_stop_heartbeat")
    assert hasattr(base_scheduler.NixlBaseConnectorScheduler, "get_exchange_clipped_blocks")
    # _reqs_need_recv holds (request, block_ids, local_num_computed_blocks, awaiting_kvs).
    meta_src = inspect.getsource(base_scheduler.NixlBaseConnectorScheduler.build_connector_meta)
    assert "awaiting_kvs," in meta_src and "cached," in meta_src
    # A step with a synchronous load starts loads before the forward.
    assert "has_sync_kv_loads" in inspect.getsource(kv_connector_model_runner_mixin)
    assert "has_sync_kv_loads = True" in inspect.getsource(scheduler.Scheduler.schedule)
    # A synchronous read's failure reaches the scheduler only as invalid blocks.
    assert "self.running, invalid_block_ids" in inspect.getsource(
        scheduler.Scheduler._handle_invalid_blocks)


def test_posted_reads_stay_in_flight_until_a_poll_sees_them_done():
    """``reads_in_flight`` reads ``_recving_transfers``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    init_src = inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    assert "self._recving_transfers" in init_src
    assert "del transfers[req_id]" in inspect.getsource(
        base_worker.NixlBaseConnectorWorker._pop_done_transfers)
    worker = SimpleNamespace(_recving_transfers={})
    assert not nixl_state.reads_in_flight(worker)
    worker._recving_transfers["r"] = [object()]
    assert nixl_state.reads_in_flight(worker)


def test_pull_guard_surface_exists():
    """gate_reads / peer_ready / fail_read, and the vLLM behaviour the guard relies
    on (guard.py); the side-channel listener is ``test_vllm_side_channel``'s."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.v1.core.sched import scheduler

    # Reads (first ones and those after a handshake) are posted through
    # self._read_blocks_for_req, which the gate wraps.
    pull_worker = inspect.getsource(nixl_state.NixlPullConnectorWorker.start_load_kv)
    assert pull_worker.count("self._read_blocks_for_req(") == 2
    worker_init = inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    for attr in ("_remote_agents", "_recv_failures"):
        assert f"self.{attr}" in worker_init, attr
    failed = inspect.signature(base_worker.NixlBaseConnectorWorker._handle_failed_transfer)
    assert list(failed.parameters)[1:] == ["req_id", "handle", "failed_req_ids",
                                           "record_failed_transfer"]
    # The connector sees finished sends before vLLM frees them (the deferred free).
    update = inspect.getsource(scheduler.Scheduler._update_from_kv_xfer_finished)
    assert update.index("update_connector_output(") < update.index(
        "for req_id in kv_connector_output.finished_sending")
