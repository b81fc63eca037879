"""Engines added and removed while the proxy runs (issue 49 item 6), on the real proxy
with aiohttp stub engines: through ``PUT /admin/engines`` and through a watched
``engines_file``.  Real vLLM engines: ``tests/e2e/test_engine_set_cluster.py``.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from aiohttp import web
from test_route_round_trips import PROMPT, StubEngine

from sessionkv_proxy.app import create_app
from sessionkv_proxy.config import load_config
from sessionkv_proxy.index.base import TIER_DEVICE


class CountingEngine(StubEngine):
    """A stub that counts the completions it serves; ``hold`` makes them wait."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.served = 0
        self.hold: asyncio.Event | None = None
        self.arrived = asyncio.Event()

    async def completions(self, request: web.Request) -> web.Response:
        self.arrived.set()
        if self.hold is not None:
            await self.hold.wait()
        self.served += 1
        return await super().completions(request)


async def _engines(free_port, roles):
    stubs, runners, configs = [], [], []
    for role in roles:
        stub, port = CountingEngine(role), free_port()
        runner = web.AppRunner(stub.app(), handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        stubs.append(stub)
        runners.append(runner)
        configs.append({"url": f"http://127.0.0.1:{port}", "role": role})
    return stubs, runners, configs


async def _wait(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


BODY = {"model": "stub", "prompt": PROMPT, "max_tokens": 2}


async def _send(http, url: str, n: int) -> list[str]:
    """``n`` requests; the D that served each (x-sessionkv-decode-engine)."""
    served = []
    for _ in range(n):
        async with http.post(f"{url}/v1/completions", json=BODY) as resp:
            assert resp.status == 200, await resp.text()
            served.append(resp.headers["x-sessionkv-decode-engine"])
    return served


async def test_added_engine_gets_traffic_removed_one_none_in_flight_finishes(
        free_port, tmp_path):
    """Must-show 5 on the real proxy: with P and D0 from an engines_file, D1 added
    through PUT /admin/engines takes requests at once; D0 removed by rewriting the
    file (no restart) gets no new request, while the request it had in flight
    finishes with a 200 (D0 draining in /health until then); D0's index entries are
    dropped; /health and the metrics show the set.  A list without a decode engine is
    refused, the set unchanged."""
    stubs, runners, configs = await _engines(free_port, ["prefill", "decode", "decode"])
    prefill, d0, d1 = stubs
    p_cfg, d0_cfg, d1_cfg = configs
    engines_file = tmp_path / "engines.json"
    engines_file.write_text(json.dumps([p_cfg, d0_cfg]))
    port = free_port()
    proxy = create_app(load_config(None, {
        "engines_file": str(engines_file), "engines_file_poll_s": 0.05,
        "host": "127.0.0.1", "port": port, "tokenizer": "none", "block_size": 16,
        "routing": {"policy": "round_robin"}}))
    await proxy.start()
    url = f"http://127.0.0.1:{port}"
    index = proxy.services.index
    try:
        async with aiohttp.ClientSession() as http:
            assert set(await _send(http, url, 4)) == {d0_cfg["url"]}
            assert d1.served == 0

            # Added through the admin endpoint: D1 serves from the next request.
            async with http.put(f"{url}/admin/engines",
                                json={"engines": [p_cfg, d0_cfg, d1_cfg]}) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["added"] == [d1_cfg["url"]]
            served = await _send(http, url, 4)
            assert served.count(d1_cfg["url"]) == 2 and d1.served == 2

            # D0 holds a request; the file drops D0 while it is in flight.
            await index.store(d0_cfg["url"], TIER_DEVICE, [(101, 1), (102, 2)])
            assert (await index.route_read(None, [1, 2])).matches.get(d0_cfg["url"])
            d0.hold = asyncio.Event()
            d0.arrived.clear()
            before_d0 = d0.served
            in_flight = None
            for _ in range(2):   # round robin: one of the next two goes to D0
                task = asyncio.create_task(_send(http, url, 1))
                done, _ = await asyncio.wait([task, asyncio.create_task(d0.arrived.wait())],
                                             return_when=asyncio.FIRST_COMPLETED)
                if d0.arrived.is_set():
                    in_flight = task
                    break
                await task
            assert in_flight is not None, "no request reached D0"
            engines_file.write_text(json.dumps([p_cfg, d1_cfg]))
            await _wait(lambda: proxy.services.pool.get(d0_cfg["url"]) is None,
                        "the file's change to remove D0")
            async with http.get(f"{url}/health") as resp:
                health = await resp.json()
            assert [e["url"] for e in health["engines"]] == [p_cfg["url"], d1_cfg["url"]]
            assert health["draining"] == [{"url": d0_cfg["url"], "role": "decode",
                                           "in_flight": 1}]
            assert set(await _send(http, url, 4)) == {d1_cfg["url"]}
            d0.hold.set()
            assert await in_flight == [d0_cfg["url"]]
            assert d0.served == before_d0 + 1
            assert not (await index.route_read(None, [1, 2])).matches.get(d0_cfg["url"])
            async with http.get(f"{url}/health") as resp:
                assert (await resp.json())["draining"] == []
            async with http.get(f"{url}/metrics") as resp:
                text = await resp.text()
            assert 'sessionkv_proxy_engines{role="decode",state="serving"} 1.0' in text
            assert 'sessionkv_proxy_engines{role="decode",state="draining"} 0.0' in text
            assert 'sessionkv_proxy_engine_set_changes_total{outcome="applied"} 2.0' in text
            assert f'sessionkv_proxy_engine_available{{engine="{d0_cfg["url"]}"}}' not in text

            # A list the config would refuse changes nothing.
            async with http.put(f"{url}/admin/engines",
                                json={"engines": [p_cfg]}) as resp:
                assert resp.status == 400 and "decode" in await resp.text()
            async with http.put(f"{url}/admin/engines",
                                json={"engines": [{"url": "x", "role": "decode"}]}) as resp:
                assert resp.status == 400
            async with http.get(f"{url}/admin/engines") as resp:
                listed = await resp.json()
            assert [e["url"] for e in listed["engines"]] == [p_cfg["url"], d1_cfg["url"]]
            async with http.get(f"{url}/metrics") as resp:
                assert 'sessionkv_proxy_engine_set_changes_total{outcome="invalid"} 2.0' \
                    in await resp.text()
            # So does a file that does not parse, or lists no decode engine.
            invalid = proxy.services.metrics.engine_set_changes.labels("invalid")
            for content in ("[{not json", json.dumps([p_cfg])):
                seen = invalid._value.get()
                engines_file.write_text(content)
                await _wait(lambda: invalid._value.get() > seen, "the file refused")
            assert [c.url for c in proxy.services.engine_set.configs] == \
                [p_cfg["url"], d1_cfg["url"]]
    finally:
        await proxy.stop(1.0)
        for runner in runners:
            await runner.cleanup()
