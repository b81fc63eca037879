"""Load scrape of the engines' /metrics: a slow engine stays routable, a dead one does not."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from sessionkv_proxy.config import EngineConfig, Role
from sessionkv_proxy.engines import (
    EnginePool,
    parse_num_gpu_blocks,
    parse_vllm_metrics,
    reclaimable_share,
)

METRICS = (
    'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
    'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
)


def test_parse_sums_label_sets_and_skips_nan():
    text = METRICS + 'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n' \
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} NaN\n'
    got = parse_vllm_metrics(text)
    assert got == {"vllm:num_requests_waiting": 2.0, "vllm:num_requests_running": 4.0,
                   "vllm:kv_cache_usage_perc": 0.25}


def test_kv_usage_of_a_data_parallel_engine_is_the_mean_of_its_ranks():
    """Two ranks a quarter and three quarters full: the engine is half full (summed,
    it read 1.0: full, and no turn went to it alone)."""
    text = METRICS + 'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n' \
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
    got = parse_vllm_metrics(text)
    assert got["vllm:kv_cache_usage_perc"] == 0.5
    assert got["vllm:num_requests_waiting"] == 3.0


# Our connector's D: vLLM's cache config (the info gauge, as vLLM writes it) and the
# blocks only session holds keep.
HELD_METRICS = METRICS + (
    'vllm:cache_config_info{block_size="16",engine="0",kv_offloading="{\'a\': 1}",'
    'num_gpu_blocks="201",'
    'num_gpu_blocks_override="None"} 1.0\n'
    '# HELP sessionkv_session_hold_blocks KV blocks only session holds keep.\n'
    'sessionkv_session_hold_blocks{engine="0",model_name="m"} 80.0\n')


def test_the_share_only_holds_keep_is_over_the_blocks_vllm_usage_divides_by():
    assert parse_vllm_metrics(HELD_METRICS)["sessionkv_session_hold_blocks"] == 80.0
    assert parse_num_gpu_blocks(HELD_METRICS) == 201
    # vLLM's usage is 1 - free / (num_gpu_blocks - 1): its null block is no one's.
    assert reclaimable_share(80.0, 201) == 0.4
    # Stock vLLM or an older connector (no gauge), no cache config: nothing reclaimed.
    assert parse_num_gpu_blocks(METRICS) is None
    assert reclaimable_share(None, 201) == reclaimable_share(80.0, None) == 0.0
    assert reclaimable_share(500.0, 201) == 1.0


async def _serve(port: int, delay_s: dict[str, float],
                 text: str = METRICS) -> tuple[web.AppRunner, str]:
    """An engine's /metrics, answered after ``delay_s["s"]`` (changeable while it runs)."""
    async def metrics(_request):
        await asyncio.sleep(delay_s["s"])
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_slow_scrape_keeps_engine_healthy_and_its_last_load(free_port):
    async def main():
        delay = {"s": 0.0}
        runner, url = await _serve(free_port(), delay)
        pool = EnginePool.from_configs([EngineConfig(url=url, role=Role.DECODE)])
        engine = pool.engines[0]
        slow = []
        async with aiohttp.ClientSession() as http:
            await pool._scrape(http, engine, 1.0)
            assert (engine.running_requests, engine.kv_usage) == (3.0, 0.25)
            delay["s"] = 0.5
            for _ in range(3):
                await pool._scrape(http, engine, 0.1, on_slow=slow.append)
            await runner.cleanup()
        return engine, slow

    engine, slow = asyncio.run(main())
    assert engine.healthy and len(slow) == 3
    assert (engine.running_requests, engine.kv_usage) == (3.0, 0.25)


def test_refused_scrapes_mark_engine_unhealthy_until_it_answers(free_port):
    async def main():
        port = free_port()
        dead = f"http://127.0.0.1:{port}"
        pool = EnginePool.from_configs([EngineConfig(url=dead, role=Role.DECODE)])
        engine = pool.engines[0]
        async with aiohttp.ClientSession() as http:
            await pool._scrape(http, engine, 1.0)
            after_one = engine.healthy
            await pool._scrape(http, engine, 1.0)
            after_two = engine.healthy
            # The engine comes back on its port.
            runner, _ = await _serve(port, {"s": 0.0})
            await pool._scrape(http, engine, 1.0)
            await runner.cleanup()
        return after_one, after_two, engine.healthy

    assert asyncio.run(main()) == (True, False, True)


def test_a_scrape_reads_the_share_only_holds_keep_and_none_from_a_stock_engine(free_port):
    async def main():
        shares = []
        for text in (HELD_METRICS, METRICS):
            runner, url = await _serve(free_port(), {"s": 0.0}, text)
            pool = EnginePool.from_configs([EngineConfig(url=url, role=Role.DECODE)])
            async with aiohttp.ClientSession() as http:
                await pool._scrape(http, pool.engines[0], 1.0)
            await runner.cleanup()
            shares.append((pool.engines[0].kv_usage, pool.engines[0].kv_reclaimable))
        return shares

    assert asyncio.run(main()) == [(0.25, 0.4), (0.25, 0.0)]
