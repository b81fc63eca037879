"""The content digest (kv_digest.py): the digest itself on real KV-shaped tensors, the
holder's ledger answering confirms with it, and the reader comparing over real ZMQ.

Each check has its control: the digest of unchanged bytes matches (or the test of a
changed byte could pass by digests that never match), and a changed byte anywhere in
a block changes that block's digest only.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_guard import _poll_until

from vllm_sessionkv.guard import DIGEST_PENDING, GuardCall, GuardOp, SendLedger
from vllm_sessionkv.kv_digest import KVDigester
from vllm_sessionkv.metadata import WorkerReport
from vllm_sessionkv.read_guard import GuardedRead, ReadGuard

NUM_BLOCKS = 40


def _caches(layout: str, dtype=torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two layers' KV caches, block-first (CPU backend) or K/V-first (FlashAttention)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, 2, 2, 16, 64) if layout == "blocks_first" else (2, NUM_BLOCKS, 16, 2, 64)
    return {f"model.layers.{i}.attn": torch.randn(shape, generator=gen).to(dtype)
            for i in range(2)}


def _block(cache: torch.Tensor, layout: str, block: int) -> torch.Tensor:
    return cache[block] if layout == "blocks_first" else cache[:, block]


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equal_bytes_digest_equal_and_any_changed_word_changes_its_block(layout, dtype):
    holder, reader = _caches(layout, dtype), _caches(layout, dtype)
    blocks = [3, 7, 8, 30]
    a = KVDigester(holder, NUM_BLOCKS).digest(blocks)
    assert a == KVDigester(reader, NUM_BLOCKS).digest(blocks)   # control: same bytes
    assert len(set(a)) == len(a)
    # The same blocks at other places (a reader's destination blocks) digest the same.
    for layer in reader:
        for src, dst in zip(blocks, [10, 11, 12, 13]):
            _block(reader[layer], layout, dst).copy_(_block(holder[layer], layout, src))
    assert KVDigester(reader, NUM_BLOCKS).digest([10, 11, 12, 13]) == a
    # One word of one layer of block 8 changed: block 8's digest only.
    _block(reader["model.layers.1.attn"], layout, 12)[1, 1, 1, 33] += 1
    b = KVDigester(reader, NUM_BLOCKS).digest([10, 11, 12, 13])
    assert [x != y for x, y in zip(a, b)] == [False, False, True, False]


def test_words_moved_within_a_block_or_blocks_swapped_change_the_digest():
    caches = _caches("blocks_first", torch.float32)
    digester = KVDigester(caches, NUM_BLOCKS)
    before = digester.digest([1, 2])
    assert digester.digest([2, 1]) == before[::-1]
    row = caches["model.layers.0.attn"][1].reshape(-1)
    row[[5, 6]] = row[[6, 5]]
    assert digester.digest([1, 2])[0] != before[0]


def test_the_test_corruption_changes_every_block_it_names():
    caches = _caches("blocks_first")
    digester = KVDigester(caches, NUM_BLOCKS)
    before = digester.digest([4, 5, 6])
    digester.corrupt([4, 6])
    after = digester.digest([4, 5, 6])
    assert [x != y for x, y in zip(before, after)] == [True, False, True]


def test_worker_reports_merge_ranks():
    a = WorkerReport(held_digests={"r1": {"tp0": {3: 11}}}, sync_loads_done=frozenset({"s"}))
    b = WorkerReport(held_digests={"r1": {"tp1": {3: 12}}, "r2": {"tp1": {5: 1}}})
    merged = a.merge(b)
    assert merged.held_digests == {"r1": {"tp0": {3: 11}, "tp1": {3: 12}},
                                   "r2": {"tp1": {5: 1}}}
    assert merged.sync_loads_done == {"s"} and a.held_digests == {"r1": {"tp0": {3: 11}}}
    assert not WorkerReport().merge(WorkerReport()).held_digests
    assert not WorkerReport(held_digests={"r1": {}}).is_empty()


# ------------------------------------------------------------ the holder's ledger
def _call(op, blocks=(), member="tp0", seq=1):
    return GuardCall(op=op, engine_id="D", request_id="x", token=7, reader="p/r1",
                     member=member, seq=seq, blocks=tuple(blocks))


def test_confirm_waits_for_the_digests_with_the_claim_standing():
    ledger = SendLedger("D", claim_ttl_s=30.0, digests=True)
    ledger.add("x", 7)
    assert ledger.answer(_call(GuardOp.CLAIM), 0.0).ok
    pending = ledger.answer(_call(GuardOp.CONFIRM, [5, 6]), 1.0)
    assert not pending.ok and pending.reason == DIGEST_PENDING
    assert ledger.claimed("x", 1.0)                 # the free still waits
    ledger.set_digests("x", {"tp0": {5: 50, 6: 60, 9: 90}, "tp1": {5: 51}})
    answer = ledger.answer(_call(GuardOp.CONFIRM, [6, 5], seq=2), 2.0)
    assert answer.ok and answer.digests == (60, 50)
    assert not ledger.claimed("x", 2.0)


def test_confirm_without_digests_to_give():
    # The holder's digest off: valid, no digests (the reader counts it unchecked).
    ledger = SendLedger("D", claim_ttl_s=30.0)
    ledger.add("x", 7)
    ledger.answer(_call(GuardOp.CLAIM), 0.0)
    answer = ledger.answer(_call(GuardOp.CONFIRM, [5]), 1.0)
    assert answer.ok and answer.digests is None
    # Digests on, but none for this rank or block: valid, none given.
    ledger = SendLedger("D", claim_ttl_s=30.0, digests=True)
    ledger.add("x", 7)
    ledger.set_digests("x", {"tp0": {5: 50}})
    for call in (_call(GuardOp.CONFIRM, [5], member="tp1"), _call(GuardOp.CONFIRM, [5, 6])):
        ledger.answer(GuardCall(**{**{f: getattr(call, f) for f in call.__struct_fields__},
                                   "op": GuardOp.CLAIM}), 0.0)
        answer = ledger.answer(call, 1.0)
        assert answer.ok and answer.digests is None
    # A refused confirm carries none, and a lapsed claim is not kept for digests.
    ledger = SendLedger("D", claim_ttl_s=1.0, digests=True)
    ledger.add("x", 7)
    ledger.answer(_call(GuardOp.CLAIM), 0.0)
    answer = ledger.answer(_call(GuardOp.CONFIRM, [5]), 5.0)
    assert not answer.ok and answer.reason == "lapsed" and answer.digests is None


# ------------------------------------------------------------ the reader over ZMQ
@pytest.fixture
def digest_holder(guard_holder):
    """The holder's side channel (conftest), its ledger expecting its workers' digests."""
    guard_holder.ledger.digests = True
    return guard_holder.ledger, guard_holder.port


@pytest.mark.parametrize("case", ["matched", "mismatched", "late_digests", "unchecked"])
def test_the_reader_compares_its_digests_with_the_holders(digest_holder, case):
    ledger, port = digest_holder
    ledger.add("x", 7)
    if case != "late_digests":
        ledger.set_digests("x", {"tp0" if case != "unchecked" else "tp9": {5: 50, 6: 60}})
    guard = ReadGuard("P", member="tp0", timeout_s=5.0)
    try:
        guard.expect({"r1": 7})
        guard.claim(GuardedRead(request_id="r1", holder_engine_id="D",
                                holder_request_id="x", token=7, host="127.0.0.1",
                                port=port, local_blocks=frozenset({1, 2}),
                                digest_pairs=((1, 5), (2, 6))), time.perf_counter())
        _poll_until(guard, lambda p: p.granted)
        ours = (50, 61) if case == "mismatched" else (50, 60)
        guard.confirm("r1", time.perf_counter(), ours)
        if case == "late_digests":
            # Asked again while the digests are not there; the claim stands meanwhile.
            time.sleep(0.02)
            polled = guard.poll(time.perf_counter())
            assert not polled.confirmed and not polled.refuted and guard.waiting
            assert ledger.claimed("x", time.perf_counter())
            ledger.set_digests("x", {"tp0": {5: 50, 6: 60}})
        polled = _poll_until(guard, lambda p: p.confirmed or p.refuted)
        expected = {"matched": "matched", "late_digests": "matched",
                    "mismatched": "mismatched", "unchecked": "unchecked"}[case]
        assert polled.digest_checks == [expected]
        if case == "mismatched":
            assert [(r.request_id, why) for r, why in polled.refuted] == \
                [("r1", "digest_mismatch")]
        else:
            assert polled.confirmed == ["r1"]
        assert not ledger.claimed("x", time.perf_counter())
    finally:
        guard.close()


def test_digests_that_never_come_time_the_confirm_out(digest_holder):
    ledger, port = digest_holder
    ledger.add("x", 7)
    guard = ReadGuard("P", member="tp0", timeout_s=0.2)
    try:
        guard.expect({"r1": 7})
        guard.claim(GuardedRead(request_id="r1", holder_engine_id="D",
                                holder_request_id="x", token=7, host="127.0.0.1",
                                port=port, local_blocks=frozenset({1}),
                                digest_pairs=((1, 5),)), time.perf_counter())
        _poll_until(guard, lambda p: p.granted)
        guard.confirm("r1", time.perf_counter(), (50,))
        polled = _poll_until(guard, lambda p: p.refuted)
        assert [why for _, why in polled.refuted] == ["timeout"]
        # The reader released its claim: the holder may free.
        _poll_until(guard, lambda p: not ledger.claimed("x", time.perf_counter()))
    finally:
        guard.close()
