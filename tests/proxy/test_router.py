"""Router.plan around the pure policy: what it records of each decision."""

from __future__ import annotations

import re
import time

import pytest

from vllm_sessionkv.wire.hashing import request_keys

from sessionkv_proxy.config import load_config
from sessionkv_proxy.engines import EnginePool
from sessionkv_proxy.errors import ApiError
from sessionkv_proxy.index.memory import MemoryIndex
from sessionkv_proxy.policy import Mode, RouteReason
from sessionkv_proxy.router import DEFAULT_OUTPUT_ESTIMATE, RoutePlan, Router, engine_requests
from sessionkv_proxy.upstream import UpstreamPool

P_URL, D1, D2 = "http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11"
BS = 16


def _body(tokens: list[int], max_tokens: int = 8) -> dict:
    return {"model": "m", "prompt": tokens, "max_tokens": max_tokens}


def _one_p_one_d(**extra) -> tuple[Router, EnginePool, UpstreamPool]:
    """A router over one P and one D (``extra``: more config keys), with its pool and
    upstream (the caller closes the upstream)."""
    config = load_config(None, {"engines": [{"url": P_URL, "role": "prefill"},
                                            {"url": D1, "role": "decode"}],
                                "block_size": BS, "tokenizer": "none", **extra})
    upstream = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=1.0)
    pool = EnginePool.from_configs(config.engines)
    return Router(config, pool, MemoryIndex(), upstream), pool, upstream


async def test_only_placements_by_cost_are_counted_and_prefill_only_skips_d() -> None:
    config = load_config(None, {"engines": [{"url": P_URL, "role": "prefill"},
                                            {"url": D1, "role": "decode"},
                                            {"url": D2, "role": "decode"}],
                                "block_size": BS, "tokenizer": "none"})
    upstream = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=1.0)
    router = Router(config, EnginePool.from_configs(config.engines), MemoryIndex(),
                    upstream)

    def placements() -> dict[str, int]:
        return {u: n for u, n in router.recent.placement_counts(time.time()).items() if n}

    try:
        group = list(range(1000, 1640))          # 40 blocks, held by nobody yet
        first = await router.plan(_body(group + [1, 2, 3]), False, None)
        assert first.mode == "disaggregated" and placements() == {first.decode.url: 1}
        # The group's next request follows its prefix (credited from the decision
        # just recorded, before any KV event): not a placement.
        second = await router.plan(_body(group + [4, 5, 6]), False, None)
        assert second.decode is first.decode
        assert second.terms["detail"].startswith("prefix affinity")
        assert placements() == {first.decode.url: 1}
        # A new prompt is placed by cost, on the D that took no placement.
        other = await router.plan(_body(list(range(5000, 5640))), False, None)
        assert other.decode is not first.decode
        assert placements() == {first.decode.url: 1, other.decode.url: 1}
        # Prefill only: P serves it, so no D is credited its prefix or a placement.
        alone = list(range(9000, 9640))
        only = await router.plan(_body(alone, max_tokens=1), False, None)
        assert only.mode == "prefill_only"
        assert router.recent.overlaps(request_keys(alone, BS), time.time()) == {P_URL: 40}
        assert placements() == {first.decode.url: 1, other.decode.url: 1}
    finally:
        await upstream.close()


async def test_a_lone_healthy_decode_worker_is_chosen_without_reading_the_prompt() -> None:
    """No prefill pool and one healthy D: no choice to make, so no token ids, index
    lookup or policy (the upstream here is closed: a /tokenize call would fail)."""
    upstream = UpstreamPool(connect_timeout_s=0.2, request_timeout_s=0.2)
    await upstream.close()
    text = {"model": "m", "prompt": "x" * 300, "max_tokens": 4}

    def router_for(*decode_urls: str) -> Router:
        config = load_config(None, {"engines": [{"url": u, "role": "decode"}
                                                for u in decode_urls],
                                    "block_size": BS})
        return Router(config, EnginePool.from_configs(config.engines), MemoryIndex(),
                      upstream)

    lone = router_for(D1)
    plan = await lone.plan(text, False, None)
    assert (plan.mode, plan.reason, plan.decode.url) == ("decode_only",
                                                         "single_decode_worker", D1)
    assert plan.prompt_tokens == 100 and plan.max_output_tokens == 4

    # Two D, one of them down: the other is the lone healthy worker.
    pair = router_for(D1, D2)
    pair.pool.get(D1).healthy = False
    plan = await pair.plan(text, False, None)
    assert (plan.reason, plan.decode.url) == ("single_decode_worker", D2)

    # The only D is down: no shortcut; the policy answers that none is healthy
    # (until the next /metrics scrape finds it up again).
    lone.pool.get(D1).healthy = False
    with pytest.raises(ApiError) as err:
        await lone.plan({**text, "prompt": list(range(40))}, False, None)
    assert err.value.status == 503 and "no healthy decode" in str(err.value)


async def test_a_handle_from_before_its_d_was_lost_is_not_used() -> None:
    """A D that refused connections and came back is a new process: P's read of the
    old handle would fail against its new NIXL agent, so the router does not send it."""
    from sessionkv_proxy.sessions import SessionRecord
    from vllm_sessionkv.wire.protocol import handle_from_params

    router, pool, upstream = _one_p_one_d()
    handle = handle_from_params({
        "do_remote_decode": True, "remote_engine_id": "d1",
        "sessionkv": {"engine_url": D1, "expires_at_unix_s": time.time() + 60}})
    try:
        record = SessionRecord(session_id="s", last_decode=D1, handle=handle)
        await router.sessions.save(record)
        loaded = await router.sessions.load("s", None)
        assert router.usable_handle(loaded, "s", None)[1] == "attached"
        d1 = pool.get(D1)
        pool.mark_failure(d1)
        pool.mark_failure(d1)          # refused twice: lost
        pool.mark_success(d1)          # answers again, a new process
        assert router.usable_handle(loaded, "s", None)[1] == "engine_lost"
        # A turn served after it came back leaves a usable handle again.
        await router.sessions.save(SessionRecord(session_id="s", last_decode=D1,
                                                handle=handle))
        loaded = await router.sessions.load("s", None)
        assert router.usable_handle(loaded, "s", None)[1] == "attached"
    finally:
        await upstream.close()



async def test_a_withdrawn_or_outlived_handle_is_not_attached_nor_given_back() -> None:
    """D withdrew the session's hold (its channel told this replica), or D has
    started again since the handle (a later epoch of its URL): the router does not
    send P the handle, the turn goes without it, and a channel copy it took is not
    handed back.  Control: the same handle, neither withdrawn nor outlived, is
    attached."""
    from sessionkv_proxy.sessions import SessionRecord
    from vllm_sessionkv.wire.protocol import encode_handle, handle_from_params

    def handle(token: int, epoch: int):
        return handle_from_params({
            "do_remote_decode": True, "remote_engine_id": "d1",
            "sessionkv": {"engine_url": D1, "expires_at_unix_s": time.time() + 60,
                          "hold_token": token, "engine_epoch": epoch}})

    prompt = _body(list(range(2000, 2160)))
    for case in ("control", "withdrawn", "engine_restarted"):
        router, pool, upstream = _one_p_one_d(
            routing={"params": {"decode_only_max_uncached_tokens": -1}})
        index = router.index
        try:
            await router.sessions.save(SessionRecord(session_id="s", last_decode=D1,
                                                    handle=handle(7, 100)))
            index.put_handle("-:s", encode_handle(handle(7, 100)), 60_000)
            if case == "withdrawn":
                index.withdraw_handle("-:s", 7, 60_000)
                index.put_handle("-:s", encode_handle(handle(7, 100)), 60_000)  # a copy
            elif case == "engine_restarted":
                index.note_epoch(D1, 200)
            plan = await router.plan(prompt, False, "s")
            expected = "attached" if case == "control" else case
            assert plan.handle_outcome == expected
            assert plan.mode == "disaggregated"
            assert plan.prefill_params.get("remote_engine_id") == (
                "d1" if case == "control" else None)
            await router.sessions.flush()
            assert index.take_handle("-:s", take=False)[0] is None   # taken, not back
        finally:
            await upstream.close()


@pytest.mark.parametrize("left_s, outcome", [(3.0, "expired"), (9.0, "expired"),
                                             (30.0, "attached")])
async def test_a_handle_in_its_last_seconds_is_not_consumed(left_s, outcome) -> None:
    """The router applies the engine's expiry rule and margin: a handle P would refuse
    (``expiry_margin_s``, 10 s) is neither sent to P nor consumed, so the turn goes
    without reuse instead of spending the single-use handle on a refusal."""
    from sessionkv_proxy.sessions import SessionRecord
    from vllm_sessionkv.config import SessionKVConfig
    from vllm_sessionkv.wire.protocol import handle_expired, handle_from_params

    config = load_config(None, {"engines": [{"url": P_URL, "role": "prefill"},
                                            {"url": D1, "role": "decode"}],
                                "block_size": BS, "tokenizer": "none",
                                "routing": {"params": {
                                    "decode_only_max_uncached_tokens": -1}}})
    upstream = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=1.0)
    router = Router(config, EnginePool.from_configs(config.engines), MemoryIndex(),
                    upstream)
    expires_at = time.time() + left_s
    # What P's scheduler will decide about this handle, with the engine's defaults.
    engine_refuses = handle_expired(expires_at, time.time(),
                                    SessionKVConfig().expiry_margin_s)
    handle = handle_from_params({
        "do_remote_decode": True, "remote_engine_id": "d1", "remote_block_ids": [[1]],
        "sessionkv": {"engine_url": D1, "expires_at_unix_s": expires_at,
                      "hash_chain": ""}})
    try:
        await router.sessions.save(SessionRecord(session_id="s", last_decode=D1,
                                                handle=handle, prompt_keys=[1]))
        plan = await router.plan(_body(list(range(100, 164))), False, "s")
        assert plan.mode == "disaggregated"
        assert plan.handle_outcome == outcome
        assert (outcome == "expired") == engine_refuses
        stored = await router.sessions.load("s", None)
        if outcome == "expired":
            # No reuse this turn, and the handle is left where it was.
            assert plan.prefill_params["remote_engine_id"] is None
            assert "sessionkv" not in plan.prefill_params
            assert stored.handle == handle
        else:
            assert plan.prefill_params["remote_engine_id"] == "d1"
            assert stored.handle is None        # consumed: single use
    finally:
        await upstream.close()


@pytest.mark.parametrize("case", ["alone", "no_room", "control"])
async def test_a_handle_that_would_expire_in_p_queue_is_not_sent(case) -> None:
    """A handle with 3 s past the margin, P's queue ~10 s (100,000 queued prompt tokens
    at 1e-4 s a token): the turn goes to the session's D alone, or, D without room,
    to P without the handle; either way the handle is left unconsumed and counted
    ``expires_in_queue``.  Control: the same handle with P idle is attached."""
    from vllm_sessionkv.wire.protocol import handle_from_params

    from sessionkv_proxy.metrics import ProxyMetrics
    from sessionkv_proxy.sessions import SessionRecord

    config = load_config(None, {"engines": [{"url": P_URL, "role": "prefill"},
                                            {"url": D1, "role": "decode"}],
                                "block_size": BS, "tokenizer": "none",
                                "routing": {"params": {"recompute": {
                                    "s_per_token": 1e-4,
                                    "s_per_token_per_context_token": 1e-9,
                                    "load_slowdown_per_unit": 0.0}}}})
    upstream = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=1.0)
    pool = EnginePool.from_configs(config.engines)
    router = Router(config, pool, MemoryIndex(), upstream)
    margin_s = router.params.handle_expiry_margin_s
    handle = handle_from_params({
        "do_remote_decode": True, "remote_engine_id": "d1", "remote_block_ids": [[1]],
        "sessionkv": {"engine_url": D1, "expires_at_unix_s": time.time() + margin_s + 3,
                      "hash_chain": ""}})
    # 8000 tokens, the first 4800 the session's earlier turns (D's handle): 3200 new,
    # more than D takes alone behind P's queue.
    prompt = list(range(100, 8100))
    if case != "control":
        pool.get(P_URL).active_prefill_work_tokens = 100_000.0
    if case == "no_room":
        pool.get(D1).kv_usage = 0.85
    try:
        await router.sessions.save(SessionRecord(
            session_id="s", last_decode=D1, handle=handle,
            prompt_keys=request_keys(prompt[:4800], BS)))
        plan = await router.plan(_body(prompt), False, "s")
        stored = await router.sessions.load("s", None)
        metrics = ProxyMetrics()
        metrics.count_route(plan.mode, plan.reason, plan.handle_outcome, 0.0, 1)
        get = metrics.registry.get_sample_value
        if case == "control":
            assert (plan.mode, plan.reason) == ("disaggregated", "increment_too_large")
            assert plan.handle_outcome == "attached"
            assert plan.prefill_params["remote_engine_id"] == "d1"
            assert stored.handle is None        # consumed: single use
            return
        assert plan.handle_outcome == "expires_in_queue"
        assert stored.handle == handle          # not consumed
        # 3 s left when the handle was made, less the time the test took to here.
        assert re.search(r"handle would expire in P's queue \((3\.0|2\.9) s left, "
                         r"~10\.0 s queued\)", plan.terms["detail"])
        assert get("sessionkv_proxy_session_handles_total",
                   {"outcome": "expires_in_queue"}) == 1.0
        if case == "alone":
            assert (plan.mode, plan.reason, plan.prefill) == \
                ("decode_only", "handle_expires_in_queue", None)
            assert plan.decode_prefill_tokens == 3200   # D computes the new tokens
            assert get("sessionkv_proxy_routing_decisions_total",
                       {"mode": "decode_only", "reason": "handle_expires_in_queue"}) == 1.0
        else:
            assert plan.mode == "disaggregated" and plan.prefill.url == P_URL
            assert plan.prefill_params["remote_engine_id"] is None
            assert "sessionkv" not in plan.prefill_params
            assert plan.prefill_work_tokens == 8000     # P recomputes it all
            assert "D has no room (kv usage 0.85 >= 0.8)" in plan.terms["detail"]
    finally:
        await upstream.close()


@pytest.mark.parametrize("reported, outcome", [(1e-4, "expires_in_queue"),
                                                (None, "attached")])
async def test_p_queue_is_priced_at_the_recompute_price_p_reports(reported, outcome) -> None:
    """No ``recompute`` configured: P's scraped ``sessionkv_recompute_seconds_per_token``
    (the engine's ``recompute_s_per_token``) prices its queue.  100,000 queued tokens
    at P's 1e-4 s are ~10 s, past the handle's 3 s: not sent.  Control: P reports no
    price, the prior (2e-5 s) makes it ~2 s, and the handle is attached."""
    from vllm_sessionkv.wire.protocol import handle_from_params

    from sessionkv_proxy.sessions import SessionRecord

    config = load_config(None, {"engines": [{"url": P_URL, "role": "prefill"},
                                            {"url": D1, "role": "decode"}],
                                "block_size": BS, "tokenizer": "none"})
    upstream = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=1.0)
    pool = EnginePool.from_configs(config.engines)
    router = Router(config, pool, MemoryIndex(), upstream)
    assert router.params.recompute_from_engines
    handle = handle_from_params({
        "do_remote_decode": True, "remote_engine_id": "d1", "remote_block_ids": [[1]],
        "sessionkv": {"engine_url": D1, "hash_chain": "",
                      "expires_at_unix_s": time.time() + router.params.handle_expiry_margin_s
                      + 3}})
    prompt = list(range(100, 8100))
    p = pool.get(P_URL)
    p.active_prefill_work_tokens, p.recompute_s_per_token = 100_000.0, reported
    try:
        await router.sessions.save(SessionRecord(
            session_id="s", last_decode=D1, handle=handle,
            prompt_keys=request_keys(prompt[:4800], BS)))
        plan = await router.plan(_body(prompt), False, "s")
        assert plan.handle_outcome == outcome, plan.terms["detail"]
    finally:
        await upstream.close()


def test_router_policy_and_engine_share_one_expiry_margin() -> None:
    from sessionkv_proxy.policy import RoutingParams
    from vllm_sessionkv.config import SessionKVConfig
    from vllm_sessionkv.wire.cost import DEFAULT_LINK, DEFAULT_RECOMPUTE
    from vllm_sessionkv.wire.protocol import HANDLE_EXPIRY_MARGIN_S, handle_expired

    params = RoutingParams(recompute=DEFAULT_RECOMPUTE, link=DEFAULT_LINK)
    assert params.handle_expiry_margin_s == SessionKVConfig().expiry_margin_s \
        == HANDLE_EXPIRY_MARGIN_S
    assert not handle_expired(0.0, 1e9)            # no expiry known
    assert handle_expired(100.0, 95.0, 10.0) and not handle_expired(100.0, 89.0, 10.0)


@pytest.mark.parametrize("body,is_chat,count", [
    ({"prompt": "a b c"}, False, 1),
    ({"prompt": [5, 6, 7]}, False, 1),                     # token ids: one prompt
    ({"prompt": "a b c", "n": 2}, False, 2),
    ({"prompt": ["a", "b", "c"]}, False, 3),               # a batch of strings
    ({"prompt": [[5, 6], [7, 8]], "n": 3}, False, 6),       # a batch of id lists, n each
    ({"prompt": "a", "n": 1, "use_beam_search": True}, False, 2),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 4}, True, 4),
    ({"messages": [{"role": "user", "content": "hi"}]}, True, 1),
])
def test_engine_requests_counts_what_vllm_runs(body, is_chat, count) -> None:
    assert engine_requests(body, is_chat) == count


@pytest.mark.parametrize("policy_name", ["cost", "round_robin"])
async def test_several_engine_requests_go_to_d_alone(policy_name) -> None:
    """n > 1 (or a batch) is not split over P and D under either policy: P's one
    hand-off names one engine request's KV."""
    config = load_config(None, {"engines": [{"url": P_URL, "role": "prefill"},
                                            {"url": D1, "role": "decode"}],
                                "block_size": BS, "tokenizer": "none",
                                "routing": {"policy": policy_name}})
    upstream = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=1.0)
    router = Router(config, EnginePool.from_configs(config.engines), MemoryIndex(),
                    upstream)
    try:
        one = await router.plan(_body(list(range(1000, 1640))), False, None)
        assert one.mode == "disaggregated"
        two = await router.plan({**_body(list(range(3000, 3640))), "n": 2}, False, None)
        assert (two.mode, two.reason, two.prefill) == (
            "decode_only", "several_engine_requests", None)
        assert two.decode.url == D1
    finally:
        await upstream.close()


def test_decode_work_counts_what_d_computes_not_its_cached_prefix():
    # The queued work the session-affinity yield rule weighs: outputs only when P
    # prefills; the uncached prompt too when D prefills; the whole prompt where no
    # policy said what is cached.
    d = object()
    pd = RoutePlan(Mode.DISAGGREGATED, None, d, RouteReason.ROUND_ROBIN,
                   prompt_tokens=3000, max_output_tokens=100, uncached_tokens=3000)
    assert pd.decode_work_tokens == 100
    alone = RoutePlan(Mode.DECODE_ONLY, None, d, RouteReason.SMALL_INCREMENT,
                      prompt_tokens=3000, max_output_tokens=100, uncached_tokens=200)
    assert alone.decode_work_tokens == 300
    unknown = RoutePlan(Mode.DECODE_ONLY, None, d, RouteReason.COLOCATED, prompt_tokens=3000)
    assert unknown.decode_work_tokens == 3000 + DEFAULT_OUTPUT_ESTIMATE


async def test_prefill_work_is_counted_and_a_queued_p_sends_a_turn_to_d_alone() -> None:
    """The plan carries what P computes of the prompt; while P's load guard holds that
    work, the next large turn goes to D alone (``prefill_queued``), and once P has
    answered, P -> D again."""
    from sessionkv_proxy.relay import Load, load_guard

    router, pool, upstream = _one_p_one_d()
    p = pool.get(P_URL)
    try:
        first = await router.plan(_body(list(range(1000, 1640))), False, None)
        assert first.mode == "disaggregated" and first.prefill_work_tokens == 640
        assert first.decode_prefill_tokens == 0
        with load_guard(p, Load(prefill_tokens=first.prompt_tokens,
                                prefill_work_tokens=first.prefill_work_tokens)):
            queued = await router.plan(_body(list(range(3000, 3640))), False, None)
            assert (queued.mode, queued.reason) == ("decode_only", "prefill_queued")
            assert queued.decode_prefill_tokens == 640
            assert "P's queue 40.0 + 40.0" in queued.terms["detail"]
        assert p.active_prefill_work_tokens == 0
        after = await router.plan(_body(list(range(5000, 5640))), False, None)
        assert after.mode == "disaggregated"
    finally:
        await upstream.close()


@pytest.mark.parametrize("reclaimable, mode", [(0.4, "decode_only"), (0.0, "disaggregated")])
async def test_the_router_reads_d_s_kv_usage_net_of_its_holds(reclaimable, mode) -> None:
    """D at 95% KV usage, 40 points of it only session holds keep (the scrape's
    ``kv_reclaimable``): a small turn goes to D alone.  Control: without the share
    (stock vLLM), D has no room and the turn goes through P."""
    router, pool, upstream = _one_p_one_d()
    d = pool.get(D1)
    d.kv_usage, d.kv_reclaimable = 0.95, reclaimable
    try:
        plan = await router.plan(_body(list(range(1000, 1010))), False, None)
        assert plan.mode == mode
        assert ("kv usage 0.55: 0.95 less 0.40" in plan.terms["detail"]) is (mode == "decode_only")
    finally:
        await upstream.close()
