"""Fixtures for the tests that build the connector in this process."""

from __future__ import annotations

import pytest


@pytest.fixture
def connector_process_state_restored(monkeypatch):
    """The connector patches vLLM and sets state for its process (one engine per
    process: the spin cap, holding steps, the first-token output hook, the engine
    marked busy).  Each is put back after the test, as the adapter tests expect to
    find vLLM unpatched."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    from vllm_sessionkv._vllm import arrivals, first_token, pacing

    for owner, names in ((SpinCondition, ("wait",)), (Scheduler, ("update_from_output", "add_request")),
                         (EngineCoreProc, ("_process_input_queue",)),
                         (WorkerProc, ("_execute_worker_rpc",)),
                         (pacing, ("_busy_poll_cap_s", "_holding_interval_s", "_engine_busy",
                                   "_spin_while_busy", "_prefill_wait",
                                   "_holding_work_waiting",
                                   "_input_queue_patched")),
                         (first_token, ("_first_token_output_patched",)),
                         (arrivals, ("_listener", "_add_request_patched"))):
        for name in names:
            monkeypatch.setattr(owner, name, getattr(owner, name))
    yield
    first_token._unreturned_first_tokens.clear()
    first_token._finished_first_tokens.clear()
