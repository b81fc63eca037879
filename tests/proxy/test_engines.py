"""Load scrape of the engines' /metrics: a slow engine stays routable, a dead one does not."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from sessionkv_proxy.config import EngineConfig, Role
from sessionkv_proxy.engines import EnginePool, parse_vllm_metrics

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


async def _serve(port: int, delay_s: dict[str, float]) -> tuple[web.AppRunner, str]:
    """An engine's /metrics, answered after ``delay_s["s"]`` (changeable while it runs)."""
    async def metrics(_request):
        await asyncio.sleep(delay_s["s"])
        return web.Response(text=METRICS)

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
