"""The private vLLM 0.32 surface the connector relies on, checked by name.

``_vllm.py`` is the only module that touches these; if vLLM moves one, this test names
it, instead of a server failing at run time.  With vLLM installed these tests fail,
never skip: an ImportError here is the likeliest sign of a vLLM upgrade.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv import _vllm  # noqa: E402


def test_pinned_version_is_installed():
    import vllm

    assert vllm.__version__.startswith(_vllm.VLLM_VERSION_TESTED)


def test_scheduler_private_state_exists():
    src = inspect.getsource(_vllm.NixlPullConnectorScheduler.__mro__[1].__init__)
    for attr in ("_reqs_need_send", "_reqs_need_recv", "_reqs_not_processed", "_reqs_in_batch",
                 "kv_recompute_threshold", "is_bidirectional_kv_xfer_enabled", "block_size"):
        assert f"self.{attr}" in src, attr
    assert hasattr(_vllm.NixlPullConnectorScheduler, "_get_remote_prefill_token_count")


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


def test_worker_agent_config_hook_exists():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    assert hasattr(base_worker, "nixl_agent_config")
    init_src = inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    assert "self.xfer_stats" in init_src
    # _vllm.reads_in_flight: posted reads stay here until a poll sees them done.
    assert "self._recving_transfers" in init_src
    assert "del transfers[req_id]" in inspect.getsource(
        base_worker.NixlBaseConnectorWorker._pop_done_transfers)


def test_nixl_agent_options_are_applied_and_scoped():
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    original = base_worker.nixl_agent_config
    if original is None:
        pytest.skip("nixl not installed")
    api = importlib.import_module(original.__module__)
    create_backend = api.nixl_agent.create_backend
    seen = []

    def recording_create_backend(agent, backend, initParams=None):  # noqa: N803
        seen.append((backend, dict(initParams or {})))
        return create_backend(agent, backend, initParams)

    api.nixl_agent.create_backend = recording_create_backend
    try:
        with _vllm.nixl_agent_options(False, "none"):
            # What vLLM 0.32's worker passes (base_worker.py l.641).
            config = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
            # Thread off: the agent must ask for RW sync, or NIXL builds
            # single-threaded UCX workers that vLLM's handshake thread and engine
            # step would use at once.
            assert config.enable_pthread is False
            assert config.sync_mode.name == "NIXL_THREAD_SYNC_RW"
            agent = api.nixl_agent("sessionkv-adapter-test", config)
        assert "UCX" in agent.backends
        assert seen == [("UCX", {"num_threads": "4", "ucx_error_handling_mode": "none"})]
        assert base_worker.nixl_agent_config is original
        assert api.nixl_agent.create_backend is recording_create_backend
        with _vllm.nixl_agent_options(True, None):  # stock: nothing patched
            assert base_worker.nixl_agent_config is original
            assert api.nixl_agent.create_backend is recording_create_backend
    finally:
        api.nixl_agent.create_backend = create_backend


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

        _vllm.limit_engine_busy_poll(0.002)
        _vllm.limit_engine_busy_poll(0.5)  # the smallest cap stays
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
        assert _vllm._POLL_MAX_S * 0.8 < waited < 0.5, waited

        time.sleep(0.2)  # the SUB has joined by now
        reader.last_read = time.monotonic() - 3600
        started = time.monotonic()
        writer.notify()
        reader.wait(timeout_ms=3000)  # a write's notification wakes it before the bound
        assert time.monotonic() - started < _vllm._POLL_MAX_S / 2
        with pytest.raises(ValueError):
            _vllm.limit_engine_busy_poll(-1)
    finally:
        ctx.destroy(linger=0)


def test_a_busy_engine_spins_as_vllm_does_and_an_idle_one_keeps_the_cap():
    """``set_engine_busy(True)`` (a step scheduled tokens) gives the reader vLLM's own
    1 s spin back; ``False`` (only holding, waiting for KV) applies the cap again.
    Fails if the cap applies on busy steps: the busy wait would sleep ~10 ms."""
    import time

    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    ctx = zmq.Context()
    reader = SpinCondition(is_reader=True, context=ctx,
                           notify_address=get_open_zmq_ipc_path())
    try:
        _vllm.limit_engine_busy_poll(0.002)
        _vllm.set_engine_busy(True)
        reader.record_read()
        time.sleep(0.01)          # past the cap, within vLLM's 1 s
        started = time.monotonic()
        reader.wait(timeout_ms=300)
        assert time.monotonic() - started < 0.005 and reader.busy_loop_s == 1

        _vllm.set_engine_busy(False)
        reader.record_read()
        time.sleep(0.01)
        started = time.monotonic()
        reader.wait(timeout_ms=300)
        assert time.monotonic() - started > 0.005 and reader.busy_loop_s == 0.002
    finally:
        _vllm.set_engine_busy(False)
        ctx.destroy(linger=0)


def test_nixl_worker_pins_its_thread_and_keep_thread_affinity_undoes_it():
    """0.32's NIXL worker moves the thread that builds it (the one that runs the
    model) onto the last core of each NUMA node on CPU; ours puts it back."""
    import os
    import threading

    source = inspect.getsource(_vllm._nixl_base_worker.NixlBaseConnectorWorker.__init__)
    assert "os.sched_setaffinity(0, rsv_cores_for_kv)" in source

    seen = {}

    def in_thread():   # a thread of its own: affinity is per thread
        before = os.sched_getaffinity(0)
        with _vllm.keep_thread_affinity():
            os.sched_setaffinity(0, {max(before)})
            seen["inside"] = os.sched_getaffinity(0)
        seen["before"], seen["after"] = before, os.sched_getaffinity(0)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen["inside"] == {max(seen["before"])}
    assert seen["after"] == seen["before"]


def test_a_worker_spins_for_the_call_that_follows_execute_model():
    """Past the cap a reader sleeps; right after an ``execute_model`` RPC the worker
    spins instead, since vLLM's step sends ``sample_tokens`` next.  Fails without
    ``_expect_sample_tokens_after_execute``: the second wait would sleep ~10 ms."""
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
        _vllm.limit_engine_busy_poll(0.002)
        _vllm.set_engine_busy(False)   # a step that ran no model: nothing to sample
        reader.record_read()
        proc._execute_worker_rpc(("execute_model", (), {}, None))
        started = time.monotonic()
        reader.wait(timeout_ms=300)   # past the cap: sleeps
        assert time.monotonic() - started > 0.005

        _vllm.set_engine_busy(True)    # a step that ran the model
        reader.record_read()   # the execute_model message
        proc._execute_worker_rpc(("execute_model", (), {}, None))
        _vllm.set_engine_busy(False)   # (so that the wait below is capped, not vLLM's)
        started = time.monotonic()
        reader.wait(timeout_ms=300)   # past the cap, yet it spins for the next call
        assert time.monotonic() - started < 0.002

        reader.record_read()   # the sample_tokens message
        proc._execute_worker_rpc(("sample_tokens", (), {}, None))
        started = time.monotonic()
        reader.wait(timeout_ms=300)   # after any other call: sleeps, as before
        assert time.monotonic() - started > 0.005
        assert calls == ["execute_model", "execute_model", "sample_tokens"]
    finally:
        _vllm.set_engine_busy(False)
        ctx.destroy(linger=0)


def test_cpu_defaults_for_nixl_agent():
    from vllm_sessionkv.config import ConfigError, SessionKVConfig, parse_config

    assert SessionKVConfig().nixl_agent_options(cpu_platform=True) == (False, "none")
    assert SessionKVConfig().nixl_agent_options(cpu_platform=False) == (True, None)
    explicit = SessionKVConfig(nixl_progress_thread=True, nixl_ucx_error_handling="peer")
    assert explicit.nixl_agent_options(cpu_platform=True) == (True, "peer")
    with pytest.raises(ConfigError, match="nixl_ucx_error_handling"):
        parse_config({"sessionkv": {"nixl_ucx_error_handling": "sometimes"}})


def test_connector_loads_through_factory_and_plugin():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_sessionkv.connector import SessionKVConnector
    from vllm_sessionkv.plugin import CONNECTOR_NAME, register

    register()
    register()  # idempotent
    assert KVConnectorFactory._registry[CONNECTOR_NAME]() is SessionKVConnector


def _engine_config(connector: str, module_path: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector=connector, kv_connector_module_path=module_path))


def test_side_channel_ports_do_not_split_the_compile_cache(monkeypatch):
    """Two engines with SessionKVConnector that differ only in their NIXL side-channel
    port share one torch.compile cache key (vLLM 0.32 hashed the port into it); an
    engine without the connector keeps vLLM's own key."""
    import vllm.envs as envs
    from vllm.config.utils import hash_factors

    from vllm_sessionkv.plugin import register

    def env_hash(port: str, vllm_config=None) -> str:
        # vLLM calls compile_factors with the compiling engine's config in a local
        # named vllm_config (VllmBackend.__call__, aot_compile_hash_factors).
        monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", port)
        return hash_factors(envs.compile_factors())

    ours = _engine_config("SessionKVConnector")
    stock = _engine_config("NixlConnector")
    unwrapped = getattr(envs.compile_factors, "__wrapped__", envs.compile_factors)
    monkeypatch.setattr(envs, "compile_factors", unwrapped)  # restored after the test
    assert env_hash("5600", ours) != env_hash("5700", ours)  # the vLLM behaviour
    register()
    register()  # wraps once
    assert envs.compile_factors.__wrapped__ is unwrapped
    assert env_hash("5600", ours) == env_hash("5700", ours)
    by_path = _engine_config("SessionKVConnector", "vllm_sessionkv.connector")
    assert env_hash("5600", by_path) == env_hash("5700", by_path)
    # Not our connector, or no config known: vLLM's own key.
    assert env_hash("5600", stock) != env_hash("5700", stock)
    assert env_hash("5600") != env_hash("5700")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    one_bind = env_hash("5600", ours)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert env_hash("5600", ours) != one_bind  # every other factor still counts


def test_vllm_computes_compile_factors_with_the_engine_config_at_hand():
    """``_vllm.compile_factors`` reads the caller's ``vllm_config``: both of vLLM
    0.32's callers have one."""
    from vllm.compilation import backends, caching

    call = inspect.getsource(backends.VllmBackend.__call__)
    assert call.index("vllm_config = self.vllm_config") < call.index(
        "envs.compile_factors()")
    hash_factors = inspect.signature(caching.aot_compile_hash_factors)
    assert "vllm_config" in hash_factors.parameters
    assert "envs.compile_factors()" in inspect.getsource(caching.aot_compile_hash_factors)


def test_the_tested_vllm_starts_and_an_untested_one_is_refused(caplog):
    caplog.set_level(logging.INFO, logger="vllm.sessionkv")
    _vllm.check_vllm_version(False)              # the installed one, pinned above
    _vllm.check_vllm_version(False, "0.32.0+cpu")
    for version in ("0.33.0", "0.32.1", "0.31.9"):
        with pytest.raises(_vllm.UntestedVllmVersion, match="allow_untested_vllm"):
            _vllm.check_vllm_version(False, version)
    _vllm.check_vllm_version(True, "0.33.0")     # the override starts, with a warning
    assert any(r.levelno == logging.WARNING and "0.33.0" in r.getMessage()
               for r in caplog.records)


def test_the_engine_refuses_an_untested_vllm_without_the_override(monkeypatch):
    """SessionKVConnector checks the version first thing, before it sets anything up."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_sessionkv.connector import SessionKVConnector

    monkeypatch.setattr(_vllm, "vllm_version", lambda: "0.99.0")

    def engine(extra):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=extra))

    with pytest.raises(_vllm.UntestedVllmVersion, match="0.99.0"):
        SessionKVConnector(engine({}), KVConnectorRole.SCHEDULER, None)
    # With the override the version check passes; the fake config then fails further on.
    with pytest.raises(AttributeError, match="parallel_config"):
        SessionKVConnector(engine({"sessionkv": {"allow_untested_vllm": True}}),
                           KVConnectorRole.SCHEDULER, None)


def test_private_scheduler_helpers_read_stock_state():
    assert not _vllm.remote_blocks_processed(None)
    assert not _vllm.remote_blocks_processed({"do_remote_decode": True})
    assert _vllm.remote_blocks_processed({"_remote_blocks_processed": True})
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        base_scheduler,
        pull_scheduler,
    )

    src = inspect.getsource(base_scheduler) + inspect.getsource(pull_scheduler)
    assert '"_remote_blocks_processed"' in src
    assert callable(_vllm.NixlPullConnectorScheduler._get_remote_prefill_token_count)


def test_prom_metric_classes_are_the_ones_vllm_chose():
    from vllm.distributed.kv_transfer.kv_connector.v1 import metrics

    init = inspect.getsource(metrics.KVConnectorPromMetrics.__init__)
    for attr in ("_gauge_cls", "_counter_cls", "_histogram_cls"):
        assert f"self.{attr}" in init, attr


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("sessionkv") == "vllm_sessionkv.plugin:register"


def test_synchronous_read_surface_exists():
    """_vllm.set_sync_recv_blocks / start_ready_reads / recv_local_block_ids /
    report_invalid_blocks / stop_heartbeat, and the vLLM behaviour they rely on."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker
    from vllm.v1.core.sched import scheduler
    from vllm.v1.worker import kv_connector_model_runner_mixin

    worker_init = inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    for attr in ("_ready_requests", "_recving_metadata", "_invalid_block_ids"):
        assert f"self.{attr}" in worker_init, attr
    assert hasattr(_vllm.NixlPullConnectorWorker, "_read_blocks_for_req")
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


def test_first_token_handoff_surface_exists():
    import dataclasses

    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    assert {"prompt_token_ids", "prefill_token_ids", "req_id"} <= {
        f.name for f in dataclasses.fields(NewRequestData)}
    assert {"req_ids", "num_output_tokens"} <= {f.name for f in dataclasses.fields(CachedRequestData)}
    # Scheduler.update_from_output adds output tokens with this method, and the runner
    # gets a new request's prompt from NewRequestData.from_request (not the v2 runner's
    # prefill_token_ids, which first_token_unsupported rules out).
    assert "append_output_token_ids" in inspect.getsource(Scheduler._update_request_with_output)
    assert "prompt_token_ids=request.prompt_token_ids" in inspect.getsource(
        NewRequestData.from_request)
    for name in ("append_output_token_ids", "num_output_tokens", "use_structured_output",
                 "num_tokens"):
        assert hasattr(Request, name), name
    # A request loaded up to num_tokens - 1 computes one token; vLLM backs a load that
    # covers num_tokens off by one, which a handed-off request's load never does.
    assert "request.num_computed_tokens == request.num_tokens" in inspect.getsource(
        Scheduler._update_waiting_for_remote_kv)


def test_first_token_is_returned_with_the_first_output_and_shown_to_the_runner(monkeypatch):
    from types import SimpleNamespace

    from vllm.v1.core.sched import scheduler
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    def step_outputs():
        return {0: EngineCoreOutputs(outputs=[
            EngineCoreOutput(request_id="held", new_token_ids=[9]),
            EngineCoreOutput(request_id="other", new_token_ids=[4])])}

    monkeypatch.setattr(scheduler.Scheduler, "update_from_output",
                        lambda self, so, mro: step_outputs())
    monkeypatch.setattr(_vllm, "_first_token_output_patched", False)
    appended: list[int] = []
    _vllm.continue_from_token(
        SimpleNamespace(request_id="held", append_output_token_ids=appended.append), 5)
    assert appended == [5]
    first = scheduler.Scheduler.update_from_output(None, None, None)
    assert [o.new_token_ids for o in first[0].outputs] == [[5, 9], [4]]
    later = scheduler.Scheduler.update_from_output(None, None, None)
    assert [o.new_token_ids for o in later[0].outputs] == [[9], [4]]

    # The runner's view: the token ends the new request's prompt, and it is not
    # counted among the outputs it keeps.
    new = NewRequestData(req_id="held", prompt_token_ids=[1, 2, 3], mm_features=[],
                         sampling_params=None, pooling_params=None, block_ids=([0],),
                         num_computed_tokens=3, lora_request=None)
    plain = NewRequestData(req_id="plain", prompt_token_ids=[1, 2], mm_features=[],
                           sampling_params=None, pooling_params=None, block_ids=([1],),
                           num_computed_tokens=0, lora_request=None)
    cached = CachedRequestData(req_ids=["held", "plain"], resumed_req_ids=set(),
                               new_token_ids=[], all_token_ids={},
                               new_block_ids=[None, None], num_computed_tokens=[5, 3],
                               num_output_tokens=[3, 1])
    output = SimpleNamespace(scheduled_new_reqs=[new, plain], scheduled_cached_reqs=cached)
    _vllm.show_first_tokens_to_worker(output, {"held": 5})
    assert new.prompt_token_ids == [1, 2, 3, 5] and plain.prompt_token_ids == [1, 2]
    assert cached.num_output_tokens == [2, 1]


def test_pull_guard_surface_exists():
    """_vllm.serve_guard_on_side_channel / gate_reads / peer_ready / fail_read, and
    the vLLM behaviour the guard relies on (guard.py)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker
    from vllm.v1.core.sched import scheduler

    # The side-channel listener is started through the instance attribute, so ours
    # takes its place, with stock's arguments.
    start = inspect.getsource(base_scheduler.NixlBaseConnectorScheduler
                              .set_xfer_handshake_metadata)
    assert "target=self._nixl_handshake_listener" in start
    params = inspect.signature(
        base_scheduler.NixlBaseConnectorScheduler._nixl_handshake_listener).parameters
    assert list(params) == ["encoded_data", "ready_event", "stop_event", "host", "port"]
    # Reads (first ones and those after a handshake) are posted through
    # self._read_blocks_for_req, which the gate wraps.
    pull_worker = inspect.getsource(_vllm.NixlPullConnectorWorker.start_load_kv)
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


def test_side_channel_serves_nixl_and_the_guard_and_reports_a_port_it_cannot_bind():
    """Our listener answers NIXL's handshake as stock does, guard calls through the
    ledger's answer, survives a fault in that answer, and reports a taken port
    instead of dying silently (stock's thread dies and the engine waits for ever)."""
    import threading
    import time
    import types

    import msgspec
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    from vllm_sessionkv.guard import (GuardCall, GuardOp, SendLedger, decode_answer,
                                      decode_call, encode_answer, encode_call)

    ledger = SendLedger("D", claim_ttl_s=5.0)
    ledger.add("x", 7)
    faults = []

    def answer(raw):
        call = decode_call(raw)
        if call is None:
            return None
        if call.request_id == "boom":
            faults.append(call)
            raise RuntimeError("a bug of ours")
        return encode_answer(ledger.answer(call, time.perf_counter()))

    scheduler = types.SimpleNamespace()
    failure = _vllm.serve_guard_on_side_channel(scheduler, answer)
    ctx = zmq.Context()
    probe = ctx.socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=scheduler._nixl_handshake_listener,
                              args=({(0, 0): b"meta"}, ready, stop, "127.0.0.1", port))
    thread.start()
    req, dealer = ctx.socket(zmq.REQ), ctx.socket(zmq.DEALER)
    try:
        assert ready.wait(10) and failure() is None
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        assert req.poll(5000)
        data, ts = req.recv_multipart()
        assert data == b"meta" and isinstance(msgspec.msgpack.decode(ts), float)
        dealer.connect(f"tcp://127.0.0.1:{port}")

        def call(request_id, seq):
            dealer.send_multipart((b"", encode_call(GuardCall(
                op=GuardOp.CLAIM, engine_id="D", request_id=request_id, token=7,
                reader="p/r", member="tp0", seq=seq))))

        call("boom", 1)                  # unanswered, and the listener lives on
        call("x", 2)
        assert dealer.poll(5000)
        assert decode_answer(dealer.recv_multipart()[-1]).seq == 2 and faults
        # A second listener on the same port cannot bind: reported, not hung.
        scheduler2 = types.SimpleNamespace()
        failure2 = _vllm.serve_guard_on_side_channel(scheduler2, answer)
        ready2 = threading.Event()
        scheduler2._nixl_handshake_listener({}, ready2, threading.Event(), "127.0.0.1", port)
        assert ready2.is_set() and isinstance(failure2(), zmq.ZMQError)
    finally:
        req.close(linger=0)
        dealer.close(linger=0)
        stop.set()
        thread.join(10)
        ctx.term()
    assert not thread.is_alive()
