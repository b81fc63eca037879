"""The host restore, synchronous reads (and their quarantine), first-token handoff and
early decode components on plain data."""

from __future__ import annotations

import zmq

from vllm_sessionkv.config import CostConfig
from vllm_sessionkv.early_decode import EarlyDecodeInbox
from vllm_sessionkv.first_token import FirstTokenRequest
from vllm_sessionkv.host_tier import HostTierManager
from vllm_sessionkv.metadata import HostCopyKind
from vllm_sessionkv.scheduling.early_decode import EarlyDecode
from vllm_sessionkv.scheduling.first_token import FirstTokenHandoff
from vllm_sessionkv.scheduling.host_restore import HostRestore
from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.scheduling.remote_plan import D_TO_P, RemotePlan
from vllm_sessionkv.scheduling.sync_read_quarantine import SyncReadQuarantine
from vllm_sessionkv.scheduling.sync_reads import SyncReads
from vllm_sessionkv.verification import Verdict
from vllm_sessionkv.wire.cost import LinkModel
from vllm_sessionkv.wire.protocol import (
    EARLY_DECODE_PUSHED_KEY,
    SESSIONKV_PARAMS_KEY,
    EarlyDecodePush,
    SessionPayload,
    payload_from_params,
)


class Stats:
    def __init__(self) -> None:
        self.data: dict[str, list] = {}

    def record(self, key: str, value: int | float = 1) -> None:
        self.data.setdefault(key, []).append(value)


FAST_HOST = LinkModel(bytes_per_s=1e12, per_transfer_s=0.0)


def pricing(recompute_s_per_token: float = 1e-3, **cost) -> Pricing:
    return Pricing(CostConfig(recompute_s_per_token=recompute_s_per_token, **cost),
                   kv_bytes_per_token=100.0, host_link=FAST_HOST)


def test_a_host_hit_is_restored_when_cheaper_and_offloads_queue_copies():
    host = HostRestore(HostTierManager(10 * 64, 64), block_size=4)
    hashes = [b"a", b"b", b"c", b"d"]
    host.offload(hashes, [10, 11, 12, 13], num_tokens=15)     # three full blocks
    ops = host.take_ops()
    assert [op.kind for op in ops] == [HostCopyKind.STORE] and ops[0].src == [10, 11, 12]
    # 17 prompt tokens, 4 hit locally: blocks 1-2 are on host (block 3 is not).
    tokens, plan = host.decide(hashes, 17, 4, pricing())
    assert (tokens, plan) == (8, (1, 2))
    assert host.restore(hashes, plan, [20, 21, 22, 23, 24]) == 8
    load = host.take_ops()[0]
    assert load.kind is HostCopyKind.LOAD and load.dst == [21, 22]
    free_recompute = pricing(recompute_s_per_token=0.0,
                             recompute_s_per_token_per_context_token=0.0)
    assert host.decide(hashes, 17, 4, free_recompute) == (0, None)   # a tie recomputes
    assert host.decide([b"x"], 17, 0, pricing()) == (0, None)
    stats = Stats()
    host.record_stats(stats)
    assert stats.data["host_offloaded_blocks"] == [3]
    assert stats.data["host_restored_blocks"] == [2]


def plan(**kw) -> RemotePlan:
    fields = dict(direction=D_TO_P, verdict=Verdict(verified_tokens=64, refused_tokens=0,
                                                    reason="ok"),
                  local_hit_tokens=0, load_tokens=64, decision="pull", remote_engine_id="D")
    fields.update(kw)
    return RemotePlan(**fields)


def test_a_read_is_synchronous_only_from_a_warm_peer_and_when_short():
    reads, cheap = SyncReads(possible=True), pricing(sync_load_max_stall_s=1.0)
    first = plan()
    reads.choose(first, complete_handle=True, num_tokens=65, pricing=cheap)
    assert not first.sync                        # no read from "D" yet: a handshake
    first.pull_started_s = 1.0
    reads.finished_step({"r"}, set(), {"r": first}, now_s=1.5)
    assert first.pull_ms == 500.0
    warm = plan()
    reads.choose(warm, complete_handle=True, num_tokens=64, pricing=cheap)
    assert warm.sync and warm.load_tokens == 63  # stops short of the last token
    reads.queued("w")
    assert reads.take_next() == {"w"} and reads.take_next() == set()
    assert SyncReads.failed_by_blocks({"w": plan(sync=True, sync_block_ids=frozenset({3}))},
                                      {3, 4}) == ["w"]
    reads.cool("D")
    cold = plan()
    reads.choose(cold, complete_handle=True, num_tokens=64, pricing=cheap)
    assert not cold.sync
    never = SyncReads(possible=False)
    never.finished_step({"r"}, set(), {"r": first}, now_s=2.0)
    off = plan()
    never.choose(off, complete_handle=True, num_tokens=64, pricing=cheap)
    assert not off.sync


def test_a_synchronous_read_is_quarantined_until_proven():
    quarantine: SyncReadQuarantine[str] = SyncReadQuarantine(enabled=True)
    # One block was a local hit: the read's blocks and the ones after it go out.
    assert quarantine.queued("good", "request good", [10, 11, 12, 13], 1) == [11, 12, 13]
    for name in ("failed", "early", "aborted"):
        assert quarantine.queued(name, f"request {name}", [20, 21], 0) == [20, 21]
    # A step's report: the good read comes back, the failed one stays out, the reads
    # the step did not run stay unproven, one never queued here is passed over, and
    # none is settled twice.
    assert quarantine.settle({"good", "failed", "other"}, {"failed"}) == ["request good"]
    assert quarantine.settle({"good", "failed"}, set()) == []
    assert not quarantine.finished("good", with_output=True)   # already settled
    # Finished before its report: back only if it finished on an output.
    assert quarantine.finished("early", with_output=True)
    assert not quarantine.finished("aborted", with_output=False)
    assert quarantine.settle({"early", "aborted"}, set()) == []
    off: SyncReadQuarantine[str] = SyncReadQuarantine(enabled=False)
    assert off.queued("r", "request r", [1, 2], 0) == []
    assert off.settle({"r"}, set()) == [] and not off.finished("r", with_output=True)


def view(**kw) -> FirstTokenRequest:
    fields = dict(num_prompt_tokens=64, num_output_tokens=0, max_tokens=8, max_model_len=512,
                  greedy=True, eos_token_id=2)
    fields.update(kw)
    return FirstTokenRequest(**fields)


def test_p_token_is_used_once_and_only_where_allowed():
    handoff, stats = FirstTokenHandoff(True, None), Stats()
    assert handoff.continues("d1", view(), 5, 64, "p1", stats)
    assert not handoff.continues("d2", view(), 5, 64, "p1", stats)    # already used
    assert not handoff.continues("d3", None, 5, 64, "p2", stats)      # pooling request
    assert stats.data == {"first_token_continued": [1], "first_token_already_used": [1],
                          "first_token_engine_unsupported": [1]}
    off = FirstTokenHandoff(False, None)
    assert off.unsupported and not off.continues("d", view(), 5, 64, "p", Stats())
    assert off.exported([5, 6], asked=True) is None
    assert handoff.exported([5, 6], asked=True) == 5 and handoff.exported([], True) is None
    assert handoff.exported([5], asked=False) is None


def test_early_decode_waits_for_p_then_goes_on_with_p_params():
    ctx = zmq.Context()
    inbox = EarlyDecodeInbox("tcp://127.0.0.1:*", timeout_s=30.0)
    inbox.endpoint = inbox._socket.getsockopt_string(zmq.LAST_ENDPOINT)
    early, stats = EarlyDecode(inbox), Stats()
    ours = SessionPayload(session_id="s", early_decode_id="e1")
    try:
        assert early.waiting(early.params_when_ready("r", ours, stats))
        p_side = EarlyDecode(None)
        out = {"do_remote_prefill": True, SESSIONKV_PARAMS_KEY: {"session_id": "s"}}
        asked = SessionPayload(early_decode_push=EarlyDecodePush(endpoint=inbox.endpoint,
                                                                 id="e1"))
        p_side.connect(asked)
        while not p_side._sender.connected(inbox.endpoint):
            pass
        p_side.push(asked, out, stats)
        assert out[SESSIONKV_PARAMS_KEY][EARLY_DECODE_PUSHED_KEY] is True
        while not inbox.wait(0.1):
            pass
        params = early.params_when_ready("r", ours, stats)
        assert params["do_remote_prefill"] and stats.data["early_decode_ready"] == [1]
        p_side.close()
    finally:
        early.close()
        ctx.term()
    # Without an inbox: refused, and the request is a plain session turn on D.
    alone = EarlyDecode(None).params_when_ready("r", ours, stats)
    assert payload_from_params(alone) == SessionPayload(session_id="s")
    assert EarlyDecode(None).params_when_ready(
        "r", SessionPayload(early_decode_id="e2"), stats) is None
