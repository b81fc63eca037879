"""The proxy's KV block size: learned from the engines' events, or configured.

Events are the proxy's own msgspec copies encoded as vLLM sends them (a BlockStored's
``block_size`` is what tells the size).  The proxy test feeds batches to a running
proxy's subscriber (the bytes a ZMQ publisher would send) and reads ``/health`` and
``/metrics`` over HTTP.  The real-engine case is tests/e2e/test_block_size_learned.py.
"""

from __future__ import annotations

import logging
import time

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sessionkv_proxy.app import create_app
from sessionkv_proxy.block_size import UNLEARNED_TOKENS, BlockSize
from sessionkv_proxy.config import load_config
from sessionkv_proxy.consumer import ConsumerStats, EventApplier
from sessionkv_proxy.events import BlockStored, KVEventBatch
from sessionkv_proxy.index import MemoryIndex
from vllm_sessionkv.wire.hashing import request_keys


def stored(first_token: int, blocks: int, block_size: int) -> BlockStored:
    tokens = list(range(first_token, first_token + blocks * block_size))
    return BlockStored(block_hashes=[first_token * 100 + i for i in range(blocks)],
                       parent_block_hash=None, token_ids=tokens, block_size=block_size,
                       lora_id=None, medium="GPU", lora_name=None)


def test_the_first_event_teaches_the_size_and_another_size_is_refused(caplog):
    size = BlockSize(None)
    assert size.tokens == UNLEARNED_TOKENS and not size.known
    assert size.accept("e0", 64)
    assert size.tokens == 64 and size.report()["source"] == "learned from e0"
    assert size.accept("e1", 64)
    with caplog.at_level(logging.WARNING):
        assert not size.accept("e1", 16)
        assert not size.accept("e1", 16)  # warned once
    assert [r.getMessage() for r in caplog.records if "e1" in r.getMessage()] == [
        "KV events of e1 have block size 16, but the proxy routes in blocks of 64 "
        "(learned from e0): its events are dropped and routing ignores its cache. Start "
        "every engine with the same --block-size"]
    assert size.tokens == 64
    assert size.report()["refused"] == {"e1": [16]}
    assert size.problems() == ["kv events of e1 have block size 16, the proxy routes in "
                               "blocks of 64: not indexed"]


def test_a_configured_size_is_kept():
    size = BlockSize(32)
    assert size.known and size.tokens == 32
    assert not size.accept("e0", 64)
    assert size.tokens == 32 and size.report()["source"] == "configured"
    with pytest.raises(ValueError, match="block_size"):
        BlockSize(0)


async def test_events_index_in_the_learned_size_and_mismatches_are_counted():
    index = MemoryIndex()
    size = BlockSize(None)
    a_stats, b_stats = ConsumerStats(), ConsumerStats()
    a = EventApplier(index, "a", size, a_stats)
    b = EventApplier(index, "b", size, b_stats)
    assert await a.apply(stored(1000, 3, 64))
    assert not await b.apply(stored(5000, 2, 16))
    assert b_stats.dropped_by_reason == {"block_size_mismatch": 1}
    keys = request_keys(list(range(1000, 1000 + 3 * 64)), size.tokens)
    assert await index.lookup(keys) == {"a": {"GPU": 3}}
    # The negative control: a proxy configured at another size indexes nothing.
    wrong = EventApplier(MemoryIndex(), "a", BlockSize(32), ConsumerStats())
    assert not await wrong.apply(stored(1000, 3, 64))


async def test_health_and_metrics_show_the_size_and_what_was_dropped(free_port):
    port = free_port()
    engines = {"a": f"http://127.0.0.1:{free_port()}", "b": f"http://127.0.0.1:{free_port()}"}
    # Nothing listens at the engines' URLs: /health answers 503, with its report.
    config = load_config(None, {
        "host": "127.0.0.1", "port": port,
        "engines": [{"url": url, "role": "decode", "kv_events": f"tcp://127.0.0.1:{free_port()}"}
                    for url in engines.values()]})
    assert config.block_size is None
    proxy = create_app(config)
    await proxy.start()
    try:
        subscribers = proxy.services.consumer.subscribers
        for name, block_size in (("a", 64), ("b", 16)):
            payload = msgspec.msgpack.encode(
                KVEventBatch(ts=time.time(), events=[stored(1000, 2, block_size)]))
            await subscribers[engines[name]].handle_live(0, payload)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                health = await resp.json(content_type=None)
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
    finally:
        await proxy.stop(1.0)
    assert health["block_size"] == {"tokens": 64, "source": f"learned from {engines['a']}",
                                    "refused": {engines["b"]: [16]}}
    assert health["events"][engines["b"]]["dropped"] == {"block_size_mismatch": 1}
    assert health["events"][engines["a"]]["dropped"] == {}
    assert (f"kv events of {engines['b']} have block size 16, the proxy routes in blocks "
            "of 64: not indexed") in health["problems"]
    dropped = {s.labels["engine"]: s.value
               for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "sessionkv_proxy_events_dropped"}
    assert dropped == {engines["b"]: 1.0}
