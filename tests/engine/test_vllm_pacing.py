"""The pacing patches on vLLM's queues and engine core (``_vllm/pacing.py``).

The private vLLM 0.32 surface checked by name, and the patch or accessor checked on
vLLM's own objects.  With vLLM installed these tests fail, never skip: an ImportError
here is the likeliest sign of a vLLM upgrade.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import pacing  # noqa: E402


def test_engine_core_surface_for_holding_pacing_exists():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    for name in ("_process_input_queue", "_handle_client_request", "is_running"):
        assert callable(getattr(EngineCoreProc, name, None)), name
    proc_init = inspect.getsource(EngineCoreProc.__init__)
    assert "self.input_queue" in proc_init and "self.engines_running" in proc_init
    assert "self.batch_queue" in inspect.getsource(EngineCore.__init__)
    assert "self.finished_req_ids" in inspect.getsource(Scheduler.__init__)
    for name in ("has_unfinished_requests", "has_finished_requests",
                 "get_num_unfinished_requests"):
        assert callable(getattr(Scheduler, name, None)), name
    # The early-decode wait counts held requests against these.
    assert "self.running" in inspect.getsource(Scheduler.__init__)
    # The wait is only safe because has_work() keeps holding engines stepping.
    assert "has_requests()" in inspect.getsource(EngineCoreProc.has_work)


def test_busy_poll_cap_makes_an_idle_reader_sleep_until_notified_or_a_bounded_poll():
    import time

    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    ctx = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=address)
    reader = SpinCondition(is_reader=True, context=ctx, notify_address=address)
    try:
        reader.record_read()
        started = time.monotonic()
        reader.wait(timeout_ms=300)  # within vLLM's 1 s spin: returns at once
        assert time.monotonic() - started < 0.1 and reader.busy_loop_s == 1

        pacing.limit_engine_busy_poll(0.002)
        pacing.limit_engine_busy_poll(0.5)  # the smallest cap stays
        reader.record_read()
        time.sleep(0.01)
        started = time.monotonic()
        # Past the cap: sleeps until notified, but a notification can be lost, so
        # for no longer than the reader has been idle (here ~10 ms, not the 300 ms
        # the caller allows) ...
        reader.wait(timeout_ms=300)
        waited = time.monotonic() - started
        assert 0.005 < waited < 0.1 and reader.busy_loop_s == 0.002, waited
        # ... and at most _POLL_MAX_S however long it has been idle.
        reader.last_read = time.monotonic() - 3600
        started = time.monotonic()
        reader.wait(timeout_ms=None)
        waited = time.monotonic() - started
        assert pacing._POLL_MAX_S * 0.8 < waited < 0.5, waited

        time.sleep(0.2)  # the SUB has joined by now
        reader.last_read = time.monotonic() - 3600
        started = time.monotonic()
        writer.notify()
        reader.wait(timeout_ms=3000)  # a write's notification wakes it before the bound
        assert time.monotonic() - started < pacing._POLL_MAX_S / 2
        with pytest.raises(ValueError):
            pacing.limit_engine_busy_poll(-1)
    finally:
        ctx.destroy(linger=0)


def test_a_busy_engine_spins_as_vllm_does_and_an_idle_one_keeps_the_cap():
    """``set_engine_busy(True)`` (a step scheduled tokens) gives the reader vLLM's own
    1 s spin back; ``False`` (only holding, waiting for KV) applies the cap again.
    Fails if the cap applies on busy steps: the busy wait's spin would be the cap's."""
    import time

    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    ctx = zmq.Context()
    reader = SpinCondition(is_reader=True, context=ctx,
                           notify_address=get_open_zmq_ipc_path())
    try:
        pacing.limit_engine_busy_poll(0.002)
        pacing.set_engine_busy(True)
        reader.record_read()
        time.sleep(0.01)          # past the cap, within vLLM's 1 s
        reader.wait(timeout_ms=300)
        assert reader.busy_loop_s == 1   # vLLM's spin (how fast it returned is load's)

        pacing.set_engine_busy(False)
        reader.record_read()
        time.sleep(0.01)
        started = time.monotonic()
        reader.wait(timeout_ms=300)
        assert time.monotonic() - started > 0.005 and reader.busy_loop_s == 0.002
    finally:
        pacing.set_engine_busy(False)
        ctx.destroy(linger=0)


def test_a_worker_spins_for_the_call_that_follows_execute_model():
    """Past the cap a reader sleeps; right after an ``execute_model`` RPC the worker
    spins instead, since vLLM's step sends ``sample_tokens`` next.  Fails without
    ``_expect_sample_tokens_after_execute``: the window would not restart."""
    import time
    import types

    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import (
        MessageQueue,
        SpinCondition,
    )
    from vllm.utils.network_utils import get_open_zmq_ipc_path
    from vllm.v1.executor.multiproc_executor import WorkerProc

    # The private surface the patch wraps: (self, (method, args, kwargs, rank)).
    stock = inspect.unwrap(WorkerProc._execute_worker_rpc)
    assert list(inspect.signature(stock).parameters) == ["self", "rpc_request"]
    assert "method, args, kwargs, output_rank = rpc_request" in inspect.getsource(stock)
    assert "self._spin_condition.record_read()" in inspect.getsource(MessageQueue)

    ctx = zmq.Context()
    reader = SpinCondition(is_reader=True, context=ctx,
                           notify_address=get_open_zmq_ipc_path())
    calls = []

    class FakeWorker:   # each call outlasts the 2 ms cap, as a forward does
        def execute_model(self, *args):
            calls.append("execute_model")
            time.sleep(0.01)

        def sample_tokens(self, *args):
            calls.append("sample_tokens")
            time.sleep(0.01)

    proc = WorkerProc.__new__(WorkerProc)   # only these attributes are used
    proc.worker, proc.rank = FakeWorker(), 0
    proc.handle_output = lambda output: None
    proc.rpc_broadcast_mq = types.SimpleNamespace(_spin_condition=reader)
    try:
        pacing.limit_engine_busy_poll(0.002)
        # The spin window runs from the reader's last read (``last_read``): a call
        # that restarts it when it ends makes the next wait spin, one that does not
        # leaves it past the cap, asleep.  Checked on ``last_read`` itself, since how
        # long a wait takes on a loaded machine proves nothing either way.
        pacing.set_engine_busy(False)   # a step that ran no model: nothing to sample
        reader.record_read()
        before = time.monotonic()
        proc._execute_worker_rpc(("execute_model", (), {}, None))
        assert reader.last_read < before   # window not restarted: the next wait sleeps
        started = time.monotonic()
        reader.wait(timeout_ms=300)   # past the cap: sleeps
        assert time.monotonic() - started > 0.005

        pacing.set_engine_busy(True)    # a step that ran the model
        reader.record_read()   # the execute_model message
        before = time.monotonic()
        proc._execute_worker_rpc(("execute_model", (), {}, None))
        # Restarted after the 10 ms forward: the worker spins for sample_tokens.
        assert reader.last_read >= before + 0.01

        reader.record_read()   # the sample_tokens message
        before = time.monotonic()
        proc._execute_worker_rpc(("sample_tokens", (), {}, None))
        assert reader.last_read < before   # after any other call: sleeps, as before
        pacing.set_engine_busy(False)
        started = time.monotonic()
        reader.wait(timeout_ms=300)
        assert time.monotonic() - started > 0.005
        assert calls == ["execute_model", "execute_model", "sample_tokens"]
    finally:
        pacing.set_engine_busy(False)
        ctx.destroy(linger=0)


def test_a_holding_engine_steps_at_once_while_the_worker_has_work_waiting(
        connector_process_state_restored):
    """An engine that only holds blocks waits for input up to the holding interval per
    step, unless the connector has work for the worker's next step (a hold just begun,
    whose digest a reader's confirm waits for): then it steps at once.  On vLLM's own
    ``EngineCoreProc._process_input_queue``, patched, with a stand-in engine core."""
    import queue
    import time
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCoreProc

    waiting = [False]
    pacing.pace_holding_steps(0.3, lambda: waiting[0])
    scheduler = SimpleNamespace(has_unfinished_requests=lambda: False,
                                finished_req_ids=set(),
                                has_finished_requests=lambda: True)
    core = SimpleNamespace(input_queue=queue.Queue(), scheduler=scheduler,
                           engines_running=False, batch_queue=None,
                           is_running=lambda: True, has_work=lambda: True)

    def one_pass() -> float:
        started = time.monotonic()
        EngineCoreProc._process_input_queue(core)
        return time.monotonic() - started

    assert one_pass() >= 0.25      # only holding: it waited out the interval
    waiting[0] = True
    assert one_pass() < 0.1        # a hold to digest: straight to the step
