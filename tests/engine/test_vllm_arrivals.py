"""The request-arrival hook (``_vllm/arrivals.py``): vLLM 0.32's ``Scheduler.add_request``
checked by name and signature, and the patch on it: the listener hears of a request
after vLLM queued it, and a listener's error never reaches vLLM.  With vLLM installed
these tests fail, never skip."""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import arrivals  # noqa: E402


@pytest.fixture(autouse=True)
def _restored(connector_process_state_restored):
    """vLLM put back as it was after each test (``conftest.py``)."""


def test_add_request_surface_exists():
    from vllm.v1.core.sched.scheduler import Scheduler

    assert list(inspect.signature(Scheduler.add_request).parameters) == ["self", "request"]


def test_the_listener_hears_of_each_request_after_vllm_queued_it(monkeypatch):
    from vllm.v1.core.sched import scheduler

    order: list[str] = []
    monkeypatch.setattr(scheduler.Scheduler, "add_request",
                        lambda self, request: order.append(f"queued {request.request_id}"))
    monkeypatch.setattr(arrivals, "_add_request_patched", False)
    arrivals.on_request_added(lambda request: order.append(f"heard {request.request_id}"))
    arrivals.on_request_added(lambda request: order.append(f"HEARD {request.request_id}"))
    scheduler.Scheduler.add_request(None, SimpleNamespace(request_id="a"))
    # One listener per process (the last engine's), one patch.
    assert order == ["queued a", "HEARD a"]

    def broken(request):
        raise RuntimeError("listener bug")
    arrivals.on_request_added(broken)
    scheduler.Scheduler.add_request(None, SimpleNamespace(request_id="b"))
    assert order[-1] == "queued b"          # queued, and no error reached vLLM
