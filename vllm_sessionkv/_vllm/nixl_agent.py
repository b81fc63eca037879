"""How NIXL's worker is built: its agent's options, and the thread affinity it changes."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _nixl_base_worker

__all__ = ["keep_thread_affinity", "nixl_agent_options"]


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
