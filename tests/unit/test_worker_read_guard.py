"""The reader's worker under the pull guard (``worker.py``): claims before a read is
posted, confirms before it is reported, and what it reports when either fails.

The worker is ours (``SessionKVWorker``, its real ``ReadGuard`` over real ZMQ to a
real ``SendLedger`` holder); what stands in is stock NIXL's worker beneath it: its
constructor, the posting of a read and the transfer results, which here a test
completes by hand (a NIXL read itself is exercised by the e2e tests).
"""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm_sessionkv._vllm import nixl_state, pacing
from vllm_sessionkv.config import SessionKVConfig
from vllm_sessionkv.metadata import StepInstructions
from vllm_sessionkv.worker import SessionKVWorker

BLOCKS = [4, 5, 6]
TOKEN = 7


class _StockNixl:
    """Stock NIXL's worker as the tests need it: reads are posted to a list, and a
    test says when one completes or fails; results are reported as stock reports
    them (a failed read also in ``finished_recving``, its blocks queued invalid)."""

    def __init__(self, vllm_config, engine_id, kv_cache_config):
        self.tp_rank = 0
        self.pp_size = 1
        self._remote_agents = {"D": "agent"}         # handshaken with the holder
        self._recving_metadata: dict = {}
        self._recving_transfers: dict = {}
        self._recv_failures: set[str] = set()
        self._invalid_block_ids: queue.Queue = queue.Queue()
        self._ready_requests: queue.Queue = queue.Queue()
        self._pending_recv_notifs: dict = {}
        self.posted: list[str] = []
        self.released: list[tuple[str, str]] = []    # handles released (a read aborted)
        self.landed: dict[str, bool] = {}             # read done -> ok
        self.auto_land = False                        # a read lands as it is posted

    def start_load_kv(self, metadata):
        for req_id, meta in metadata.reqs_to_recv.items():
            self._recving_metadata[req_id] = meta
            self._read_blocks_for_req(req_id, meta)

    def _read_blocks_for_req(self, req_id, meta):
        self._recving_transfers[req_id] = ["xfer"]
        self.posted.append(req_id)
        if self.auto_land:
            self.landed[req_id] = True

    def _try_release_xfer_handle(self, req_id, handle):
        self.released.append((req_id, handle))
        return True

    def _handle_failed_transfer(self, req_id, handle, failed_req_ids=None,
                                record_failed_transfer=True):
        failed_req_ids.add(req_id)
        return True

    def get_transfer_results(self):
        done, failed = set(), set()
        for req_id in [r for r in self.landed if r in self._recving_transfers]:
            del self._recving_transfers[req_id]
            done.add(req_id)
            if not self.landed.pop(req_id):
                failed.add(req_id)
        for req_id in list(self._recv_failures):
            if req_id not in self._recving_transfers:
                self._recv_failures.discard(req_id)
                done.add(req_id)
                failed.add(req_id)
        for req_id in done:
            meta = self._recving_metadata.pop(req_id)
            if req_id in failed:
                self._invalid_block_ids.put(set(meta.local_block_ids[0]))
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def shutdown(self):
        pass


@pytest.fixture
def make_worker(monkeypatch):
    # The worker marks its engine busy or idle for the process (pacing); put it back.
    monkeypatch.setattr(pacing, "_engine_busy", pacing._engine_busy)
    base = nixl_state.NixlPullConnectorWorker
    for name in ("__init__", "start_load_kv", "_read_blocks_for_req",
                 "_try_release_xfer_handle", "_handle_failed_transfer",
                 "get_transfer_results", "shutdown"):
        monkeypatch.setattr(base, name, getattr(_StockNixl, name))
    workers = []

    def make(**config) -> SessionKVWorker:
        worker = SessionKVWorker(None, "P", None, SessionKVConfig(**config))
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.shutdown()


def _meta(port: int):
    remote = SimpleNamespace(engine_id="D", request_id="x", host="127.0.0.1", port=port)
    return SimpleNamespace(local_block_ids=[list(BLOCKS)], remote=remote)


def _step(worker, port: int, sync: bool = False) -> None:
    """The scheduler's step that reads request r1 from the holder's request x."""
    metadata = SimpleNamespace(reqs_to_recv={"r1": _meta(port)})
    nixl_state.attach_step_instructions(metadata, StepInstructions(
        read_guards={"r1": TOKEN}, sync_loads={"r1"} if sync else set()))
    worker.start_load_kv(metadata)


def _results_until(worker, condition, what: str, timeout_s: float = 10.0):
    """Step the worker's results until ``condition(results)``; every results seen."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen.append(worker.get_transfer_results())
        if condition(seen[-1]):
            return seen
        time.sleep(0.002)
    raise AssertionError(f"{what}: not seen in {len(seen)} results")


def _reported(seen) -> set[str]:
    return set().union(*(r.finished_recving | r.failed_recving for r in seen))


def _invalid(worker) -> set[int]:
    """The blocks vLLM hears are invalid at the end of a step (it asks after the
    step's transfer results)."""
    out = set()
    while not worker._invalid_block_ids.empty():
        out |= worker._invalid_block_ids.get_nowait()
    return out


def _count(worker, key: str) -> int:
    return len(worker.xfer_stats.data.get(key, []))


def test_a_granted_read_is_reported_received_only_after_its_confirm(make_worker,
                                                                    guard_holder):
    ledger = guard_holder.ledger
    ledger.add("x", TOKEN)
    worker = make_worker()
    _step(worker, guard_holder.port)
    assert worker.posted == []                       # held back until granted
    seen = _results_until(worker, lambda r: worker.posted, "the read posted")
    assert worker.posted == ["r1"] and ledger.claimed("x", time.perf_counter())
    # The read lands while the holder's side channel stalls: not reported, and the
    # holder's free of x waits for the confirm.
    guard_holder.stall()
    worker.landed["r1"] = True
    seen += [worker.get_transfer_results() for _ in range(3)]
    assert "r1" not in _reported(seen)
    assert ledger.gate({"x"}, time.perf_counter()) == set()
    guard_holder.resume()
    seen = _results_until(worker, lambda r: "r1" in r.finished_recving, "r1 received")
    assert "r1" not in seen[-1].failed_recving and _invalid(worker) == set()
    assert ledger.take_releasable(time.perf_counter()) == {"x"}   # claim ended
    assert _count(worker, "pull_guard_confirm_refused") == 0


@pytest.mark.parametrize("held", ["gone", "ending"])
def test_a_refused_claim_fails_the_read_unposted(make_worker, guard_holder, held):
    if held == "ending":
        guard_holder.ledger.add("x", TOKEN)
        guard_holder.ledger.mark_ending({"x"})
    worker = make_worker()
    _step(worker, guard_holder.port)
    seen = _results_until(worker, lambda r: "r1" in r.failed_recving, "r1 failed")
    # Failed (vLLM recomputes it), never posted, counted; stock queues its blocks
    # invalid like any failed read's.
    assert "r1" in seen[-1].finished_recving and worker.posted == []
    assert _count(worker, "pull_guard_claim_refused") == 1
    assert _invalid(worker) == set(BLOCKS)


def test_a_refuted_confirm_reports_the_blocks_invalid_and_the_read_failed(
        make_worker, guard_holder):
    ledger = guard_holder.ledger
    ledger.add("x", TOKEN)
    ledger.claim_ttl_s = 0.2
    worker = make_worker()
    _step(worker, guard_holder.port)
    seen = _results_until(worker, lambda r: worker.posted, "the read posted")
    # The claim lapses before the read lands (a stalled reader): the holder may
    # have freed the blocks under the read.
    deadline = time.monotonic() + 10
    while ledger.claimed("x", time.perf_counter()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ledger.claimed("x", time.perf_counter())
    worker.landed["r1"] = True
    seen += _results_until(worker, lambda r: "r1" in r.finished_recving, "r1 reported")
    assert "r1" in seen[-1].failed_recving
    assert _invalid(worker) == set(BLOCKS)
    assert _count(worker, "pull_guard_confirm_refused") == 1
    assert sum("r1" in r.finished_recving for r in seen) == 1


def test_a_holder_that_never_answers_is_a_counted_timeout(make_worker, silent_holder):
    worker = make_worker(pull_guard_timeout_s=0.2)
    _step(worker, silent_holder)
    seen = _results_until(worker, lambda r: "r1" in r.failed_recving, "r1 failed")
    assert "r1" in seen[-1].finished_recving and worker.posted == []
    assert _count(worker, "pull_guard_claim_timeout") == 1
    assert _count(worker, "pull_guard_claim_refused") == 0


def test_a_synchronous_read_confirmed_in_its_step_is_not_reported(make_worker,
                                                                   guard_holder):
    """The control for the next test: claim, read and confirm inside the step; the
    request is reported neither received nor failed (vLLM counts it computed)."""
    guard_holder.ledger.add("x", TOKEN)
    worker = make_worker(sync_load_timeout_s=10.0)
    worker.auto_land = True
    _step(worker, guard_holder.port, sync=True)
    assert worker.posted == ["r1"] and not guard_holder.ledger.claimed("x", time.perf_counter())
    seen = [worker.get_transfer_results() for _ in range(3)]
    assert _reported(seen) == set() and _invalid(worker) == set()
    assert _count(worker, "sync_load_timeouts") == 0


@pytest.mark.parametrize("stalls", ["claim", "read"])
def test_a_synchronous_read_given_up_is_never_reported_later(make_worker, guard_holder,
                                                             stalls):
    """Given up at sync_load_timeout_s (its claim unanswered, or its read not landed):
    its blocks are reported invalid at once, and whatever comes later (the grant,
    the read, the confirm) is never reported to vLLM."""
    ledger = guard_holder.ledger
    ledger.add("x", TOKEN)
    worker = make_worker(sync_load_timeout_s=0.2)
    if stalls == "claim":
        guard_holder.stall()
    _step(worker, guard_holder.port, sync=True)
    seen = [worker.get_transfer_results()]      # the step's own results
    assert _count(worker, "sync_load_timeouts") == 1
    assert _invalid(worker) == set(BLOCKS)
    assert worker.posted == ([] if stalls == "claim" else ["r1"])
    # A posted read is aborted before the step goes on (its handle released): vLLM
    # recomputes into its destination blocks and may reuse them.
    assert worker.released == ([] if stalls == "claim" else [("r1", "xfer")])
    if stalls == "claim":
        guard_holder.resume()
    if stalls == "read":
        worker.landed["r1"] = True
    # The late answers arrive: the claim is dropped (released or confirmed) and
    # stock has reported the read done, yet vLLM hears nothing of r1.
    seen += _results_until(
        worker, lambda r: not ledger.claimed("x", time.perf_counter())
        and not worker._recving_metadata and not worker._guard.waiting,
        "the late read settled")
    seen += [worker.get_transfer_results() for _ in range(3)]
    assert _reported(seen) == set()
    assert worker.posted == ([] if stalls == "claim" else ["r1"])
    assert _invalid(worker) == set()     # nor its blocks invalid again, in a later step


def test_an_unanswered_confirm_fails_the_read_and_a_late_answer_is_ignored(
        make_worker, guard_holder):
    ledger = guard_holder.ledger
    ledger.add("x", TOKEN)
    worker = make_worker(pull_guard_timeout_s=0.3)
    _step(worker, guard_holder.port)
    seen = _results_until(worker, lambda r: worker.posted, "the read posted")
    guard_holder.stall()
    worker.landed["r1"] = True
    seen += _results_until(worker, lambda r: "r1" in r.finished_recving, "r1 reported")
    assert "r1" in seen[-1].failed_recving and _invalid(worker) == set(BLOCKS)
    assert _count(worker, "pull_guard_confirm_timeout") == 1
    # The holder answers the confirm at last (valid: its claim stood): too late to
    # count, and r1 is not reported a second time.
    guard_holder.resume()
    deadline = time.monotonic() + 10
    while ledger.claimed("x", time.perf_counter()) and time.monotonic() < deadline:
        seen.append(worker.get_transfer_results())
        time.sleep(0.002)
    assert not ledger.claimed("x", time.perf_counter())
    seen += [worker.get_transfer_results() for _ in range(3)]
    assert sum("r1" in r.finished_recving for r in seen) == 1 and _invalid(worker) == set()
