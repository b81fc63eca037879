"""The scheduler half's hooks on vLLM's own objects, in one process, no engines:
a real ``SessionKVConnector`` (scheduler role) on a generated tiny model's config,
vLLM ``Request``s with vLLM's block hasher, vLLM's ``KVCacheBlocks``.  It follows a
session: a turn served on D leaves a held handle; P pulls it for the next turn when
pulling is cheaper; an edited history is refused by verification; a P->D load, an
unreadable handle, a host-tier restore and a first-token handoff go as designed; a
synchronous read's blocks stay out of vLLM's own prefix cache until the read is seen
good.
(The end-to-end tests check the same with real engines and NIXL.)"""

from __future__ import annotations

import copy
import importlib.util
import types

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv.wire.protocol import payload_from_params  # noqa: E402

BLOCK = 16
PROMPT = list(range(1, 70))   # 69 tokens: 4 full blocks and 5 tokens
CHEAP_PULLS = {"cost": {"per_transfer_s": 0.0, "link_bytes_per_s": 1e12,
                        "recompute_s_per_token": 0.01},
               "host_tier_bytes": 4 << 20, "host_copy_bytes_per_s": 1e12}


@pytest.fixture(autouse=True)
def _restored(connector_process_state_restored):
    """vLLM put back as it was after each test (``conftest.py``)."""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from vllm_sessionkv.dev.tiny_model import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("hooks") / "model")


class Engine:
    """The connector's scheduler half and just enough of vLLM's scheduler to call it."""

    def __init__(self, model_dir, sessionkv: dict) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )

        from vllm_sessionkv.connector import SessionKVConnector

        vllm_config = EngineArgs(
            model=str(model_dir), enable_prefix_caching=True, prefix_caching_hash_algo="sha256",
            block_size=BLOCK, max_model_len=1024,
            kv_transfer_config={"kv_connector": "SessionKVConnector", "kv_role": "kv_both",
                                "kv_load_failure_policy": "recompute",
                                "kv_connector_extra_config": {"sessionkv": sessionkv}},
        ).create_engine_config()
        layer = "model.layers.0.self_attn.attn"
        kv_cache_config = KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[KVCacheTensor(size=64 * 4096, layers=[layer],
                                            layer_stride=64 * 4096, block_stride=4096)],
            kv_cache_groups=[KVCacheGroupSpec([layer], FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32))])
        self.kv_cache_config = kv_cache_config
        self.connector = SessionKVConnector(vllm_config, KVConnectorRole.SCHEDULER,
                                            kv_cache_config)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)

    def request(self, request_id, prompt, params=None, session=None):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": copy.deepcopy(params)} if params is not None else None
        return Request(request_id, prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                          extra_args=extra),
                       None, block_hasher=self.hasher, session_id=session)

    def turn(self, request, computed_tokens, block_ids, output_tokens=()):
        """vLLM's calls for one request: (matched, the step's instructions, its answer)."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.request import RequestStatus

        conn = self.connector
        matched = conn.get_num_new_matched_tokens(request, computed_tokens)
        blocks = KVCacheBlocks(([KVCacheBlock(i) for i in block_ids],))
        conn.update_state_after_alloc(request, blocks, matched[0] or 0)
        instructions = conn.build_connector_meta(step(request.request_id)).sessionkv
        for token in output_tokens:
            request.append_output_token_ids(token)
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        request.num_computed_tokens = request.num_tokens - 1
        _, answer = conn.request_finished(request, list(block_ids))
        return matched, instructions, answer


def step(request_id):
    """vLLM's scheduler output for a step that runs one request."""
    return types.SimpleNamespace(
        num_scheduled_tokens={request_id: 1}, scheduled_new_reqs=[],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], num_output_tokens=[]),
        finished_req_ids=set(), free_encoder_mm_hashes=[])


def accounting(answer):
    return payload_from_params(answer).accounting


def pull_handle(answer):
    return dict(answer, do_remote_decode=True, do_remote_prefill=False,
                remote_engine_id="D", remote_host="127.0.0.1", remote_port=1,
                remote_request_id="d1", tp_size=1)


def test_a_session_turn_is_held_and_pulled_only_where_it_matches(tiny_model_dir):
    engine = Engine(tiny_model_dir, CHEAP_PULLS)
    matched, _, answer = engine.turn(engine.request("plain", PROMPT), 0, range(5))
    assert matched == (0, False) and answer is None        # no session: nothing held
    # A turn served on D: its blocks held, the handle carries the hash chain.
    _, _, held = engine.turn(engine.request("d1", PROMPT, {"sessionkv": {"session_id": "s"}},
                                            session="s"), 0, range(8), output_tokens=[5, 6, 7])
    payload = payload_from_params(held)
    assert held["do_remote_decode"] and payload.session_id == "s" and payload.hold_token
    assert payload.num_tokens == 71 and payload.hash_chain
    handle = pull_handle(held)
    history = [*PROMPT, 5, 6, 7, *range(200, 230)]
    # The next turn on P: 64 tokens hit locally, the 7 verified beyond are pulled,
    # asynchronously (no read from this D yet), under the guard's token.
    matched, step, answer = engine.turn(engine.request("p1", history, handle), 64,
                                        range(10, 17))
    assert matched == (7, True) and step.read_guards == {"p1": payload.hold_token}
    assert accounting(answer).decision == "d_to_p:pull:ok"
    assert accounting(answer).pulled_from_peer_tokens == 7
    # The request ends in the step that queued its read (no step report came between):
    # the read is timed to the end, not left at 0.
    assert accounting(answer).pull_ms > 0
    # The same handle on an edited history: verification keeps the first block only.
    edited = list(history)
    edited[20] = 999
    matched, _, answer = engine.turn(engine.request("p2", edited, handle), 0, range(20, 27))
    assert matched == (16, True)
    assert accounting(answer).decision == "d_to_p:pull:prefix_mismatch"
    assert accounting(answer).refused_by_verification_tokens == 55
    # A handle of an unknown protocol version is refused whole.
    unreadable = dict(handle, sessionkv={"version": 99})
    matched, _, answer = engine.turn(engine.request("p3", PROMPT, unreadable), 0, range(40, 45))
    assert matched == (0, False)
    assert accounting(answer).decision == "d_to_p:refused:unsupported_version"


def test_p_to_d_host_restore_and_first_token(tiny_model_dir):
    engine = Engine(tiny_model_dir, CHEAP_PULLS)
    p_to_d = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": [[1, 2, 3, 4]], "remote_engine_id": "P",
              "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "p9",
              "remote_num_tokens": 69, "tp_size": 1}
    matched, _, answer = engine.turn(engine.request("d1", PROMPT, p_to_d), 0, range(30, 35))
    assert matched == (69, True)
    acct = accounting(answer)
    assert acct.decision == "p_to_d:pull:unverified_p_to_d"
    # vLLM computes the last prompt token again, for the first logits.
    assert (acct.pulled_from_peer_tokens, acct.recomputed_tokens) == (68, 1)
    # With P's sampled token, D loads the whole prompt and continues from it.
    handed = dict(p_to_d, remote_request_id="p10", sessionkv={"first_token_id": 5})
    matched, _, answer = engine.turn(engine.request("d2", PROMPT, handed), 0, range(30, 35))
    acct = accounting(answer)
    assert matched == (69, True) and acct.first_token_from_prefill
    assert (acct.pulled_from_peer_tokens, acct.recomputed_tokens) == (69, 0)
    # A session turn on D goes to the host tier too; a plain request on the same
    # prompt restores its full blocks from there instead of recomputing them.
    engine.turn(engine.request("d3", PROMPT, {"sessionkv": {"session_id": "s"}}, session="s"),
                0, range(8), output_tokens=[5, 6, 7])
    matched, step, answer = engine.turn(engine.request("h1", PROMPT), 0, range(50, 55))
    assert matched == (64, False)
    # This step's copies: the turn's offload, then the restore into h1's blocks.
    assert [(c.kind.value, c.dst) for c in step.host_copies][-1] == ("load", [50, 51, 52, 53])
    assert answer is None   # no session: counted in the engine's stats only
    stats = engine.connector.get_kv_connector_stats().data
    assert stats["prompt_tokens_pulled_from_host"] == [64]
    assert stats["host_restored_blocks"] == [4]


def test_a_synchronous_read_stays_out_of_the_prefix_cache_until_seen_good(tiny_model_dir):
    """On vLLM's own ``KVCacheManager``, bound as vLLM binds it: a warm peer's pull
    runs inside the step; the blocks vLLM hashed at its allocation are found by no
    other request until the step's report says the read ran and no invalid block
    names it, or the request finished on an output first.  A failed read's blocks
    stay out, also once its request is aborted."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from vllm_sessionkv._vllm import nixl_state
    from vllm_sessionkv.metadata import WorkerReport

    engine = Engine(tiny_model_dir, dict(CHEAP_PULLS, cost=dict(CHEAP_PULLS["cost"],
                                                                sync_load_max_stall_s=1.0)))
    conn = engine.connector
    manager = KVCacheManager(engine.kv_cache_config, max_model_len=1024,
                             scheduler_block_size=BLOCK, hash_block_size=BLOCK)
    conn.bind_kv_cache_manager(manager)
    _, _, held = engine.turn(engine.request("d1", PROMPT, {"sessionkv": {"session_id": "s"}},
                                            session="s"), 0, range(8), output_tokens=[5, 6, 7])
    handle = pull_handle(held)
    history = [*PROMPT, 5, 6, 7, *range(200, 230)]   # 102 tokens: 6 full blocks

    def found() -> int:
        return manager.get_computed_blocks(engine.request("probe", history))[1]

    # The first read from D is asynchronous; once it is received, D is warm.
    first = engine.request("p0", history, handle)
    matched = conn.get_num_new_matched_tokens(first, 0)
    assert matched == (71, True)
    conn.update_state_after_alloc(first, KVCacheBlocks(([KVCacheBlock(i) for i in
                                                         range(40, 47)],)), matched[0])
    conn.build_connector_meta(step("p0"))
    conn.update_connector_output(KVConnectorOutput(finished_recving={"p0"}))

    def sync_read(request_id):
        request = engine.request(request_id, history, handle)
        assert found() == 0
        matched = conn.get_num_new_matched_tokens(request, 0)
        assert matched == (71, False)                 # inside the step
        assert manager.allocate_slots(request, request.num_tokens - matched[0],
                                      num_external_computed_tokens=matched[0])
        assert found() == 96                          # vLLM hashed them at allocation
        conn.update_state_after_alloc(request, manager.get_blocks(request_id), matched[0])
        assert found() == 0                           # ours: out until seen good
        assert conn.build_connector_meta(step(request_id)).sessionkv.sync_loads == {
            request_id}
        request.num_computed_tokens = request.num_tokens
        return request

    def report(request_id, **output):
        done = nixl_state.worker_metadata(WorkerReport(sync_loads_done=frozenset({request_id})))
        conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=done,
                                                       **output))

    def finish(request, status):
        request.status = status
        conn.request_finished(request, manager.get_block_ids(request.request_id))

    def forget(request):
        """vLLM frees the request's blocks; the cache is emptied for the next case."""
        manager.free(request)
        assert manager.reset_prefix_cache() and found() == 0

    good = sync_read("p1")
    report("p1")
    assert found() == 96                              # back in the cache with the report
    finish(good, RequestStatus.FINISHED_LENGTH_CAPPED)
    forget(good)
    # Finished on an output before its step's report came: the read did not fail.
    early = sync_read("p2")
    finish(early, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert found() == 96
    report("p2")
    forget(early)
    # Aborted before its report: its blocks stay out.
    aborted = sync_read("p3")
    finish(aborted, RequestStatus.FINISHED_ABORTED)
    report("p3")
    assert found() == 0
    forget(aborted)
    # Failed (its blocks reported invalid): they stay out, and once it is aborted too.
    failed = sync_read("p4")
    report("p4", invalid_block_ids=set(manager.get_block_ids("p4")[0]))
    assert found() == 0
    finish(failed, RequestStatus.FINISHED_ABORTED)
    assert found() == 0


def test_the_hold_blocks_gauge_is_what_ending_the_holds_frees(tiny_model_dir, monkeypatch):
    """``sessionkv_session_hold_blocks`` on vLLM's own ``KVCacheManager``: a D turn's
    hold keeps its 5 blocks; a running request that hits the held prefix shares 4 of
    them, which ending the hold would not free; once the hold is released and vLLM
    frees its blocks, vLLM's KV usage drops by exactly the gauge's blocks over
    ``num_blocks - 1`` (the share the proxy takes off the usage it reads)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from vllm_sessionkv.scheduling import session_holds

    monkeypatch.setattr(session_holds, "HOLD_BLOCKS_EVERY_S", 0.0)   # count every step
    engine = Engine(tiny_model_dir, {})
    conn = engine.connector
    manager = KVCacheManager(engine.kv_cache_config, max_model_len=1024,
                             scheduler_block_size=BLOCK, hash_block_size=BLOCK)
    conn.bind_kv_cache_manager(manager)
    reported = [0]

    def gauge() -> int:
        stats = conn.get_kv_connector_stats()
        reported.extend((stats.data if stats else {}).get("session_hold_blocks", ()))
        return reported[-1]

    held = engine.request("d1", PROMPT, {"sessionkv": {"session_id": "s"}}, session="s")
    assert conn.get_num_new_matched_tokens(held, 0) == (0, False)
    assert manager.allocate_slots(held, held.num_tokens) is not None   # 5 blocks
    conn.update_state_after_alloc(held, manager.get_blocks("d1"), 0)
    conn.build_connector_meta(step("d1"))
    held.append_output_token_ids(5)
    held.num_computed_tokens = held.num_tokens - 1
    held.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, _ = conn.request_finished_all_groups(held, manager.get_block_ids("d1"))
    assert delay_free and gauge() == 5
    # A running request on the same prompt hits the 4 full held blocks.
    running = engine.request("r2", PROMPT)
    hit, hit_tokens = manager.get_computed_blocks(running)[:2]
    assert hit_tokens == 4 * BLOCK
    assert manager.allocate_slots(running, running.num_tokens - hit_tokens, hit_tokens,
                                  hit) is not None
    assert gauge() == 1                       # only the partial last block is the hold's
    manager.free(running)
    assert gauge() == 5
    # The hold ends: NIXL reports the send done, then vLLM frees the blocks.
    usage = manager.usage
    conn.update_connector_output(KVConnectorOutput(finished_sending={"d1"}))
    manager.free(held)
    assert gauge() == 0
    assert usage - manager.usage == pytest.approx(5 / (engine.kv_cache_config.num_blocks - 1))
