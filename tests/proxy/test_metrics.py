"""The proxy's per-request metrics: plain counts exported by a collector at scrape
time, with the names, labels, help texts and buckets prometheus_client's own Counter
and Histogram give (less ``_created``), and ``le`` buckets (value <= bound)."""

from __future__ import annotations

import math

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sessionkv_proxy.app import create_app
from sessionkv_proxy.config import load_config
from sessionkv_proxy.metrics import ProxyMetrics
from sessionkv_proxy.policy import Mode, RouteReason

DECISION_BOUNDS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2)
PROMPT_BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


def _samples(registry) -> dict[tuple, float]:
    """Every sample of the exposition text, keyed by (name, sorted labels)."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _families(registry) -> dict[str, tuple[str, str]]:
    text = generate_latest(registry).decode()
    return {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(text)}


def _buckets(samples: dict, name: str) -> list[tuple[str, float]]:
    return [(dict(labels)["le"], v) for (n, labels), v in samples.items()
            if n == name + "_bucket"]


def test_request_counts_by_endpoint_and_status():
    m = ProxyMetrics()
    for endpoint, status in [("completions", 200), ("completions", 200), ("chat", 400),
                             ("completions", 503)]:
        m.count_request(endpoint, status)
    r = m.registry
    get = r.get_sample_value
    name = "sessionkv_proxy_requests_total"
    assert get(name, {"endpoint": "completions", "status": "200"}) == 2.0
    assert get(name, {"endpoint": "chat", "status": "400"}) == 1.0
    assert get(name, {"endpoint": "completions", "status": "503"}) == 1.0
    assert get(name, {"endpoint": "chat", "status": "200"}) is None
    assert _families(r)["sessionkv_proxy_requests"] == ("counter",
                                                        "Requests by endpoint and status.")


def test_route_counts_decisions_and_handles():
    m = ProxyMetrics()
    # The app passes the enum members; their values are the labels, and a member
    # adds up with the string it reads as.
    m.count_route(Mode.DISAGGREGATED, RouteReason.INCREMENT_TOO_LARGE, "none", 1e-4, 3)
    m.count_route("disaggregated", "increment_too_large", "attached", 1e-4, 3)
    m.count_route(Mode.DECODE_ONLY, RouteReason.SMALL_INCREMENT, "attached", 1e-4, 3)
    get = m.registry.get_sample_value
    dec = "sessionkv_proxy_routing_decisions_total"
    assert get(dec, {"mode": "disaggregated", "reason": "increment_too_large"}) == 2.0
    assert get(dec, {"mode": "decode_only", "reason": "small_increment"}) == 1.0
    hnd = "sessionkv_proxy_session_handles_total"
    assert get(hnd, {"outcome": "attached"}) == 2.0
    assert get(hnd, {"outcome": "none"}) == 1.0
    fam = _families(m.registry)
    assert fam["sessionkv_proxy_routing_decisions"] == (
        "counter", "Routing decisions by mode and reason.")
    assert fam["sessionkv_proxy_session_handles"] == (
        "counter", "Session handles by outcome: attached, expired, other_tenant, none.")


def test_histograms_are_cumulative_with_sum_and_count():
    m = ProxyMetrics()
    blocks = [0, 3, 3, 17, 5000]
    seconds = [2e-6, 7e-5, 3e-3, 0.5, 2e-4]
    for b, secs in zip(blocks, seconds):
        m.count_route("decode_only", "load", "none", secs, b)
    s = _samples(m.registry)

    pb = _buckets(s, "sessionkv_proxy_prompt_blocks")
    assert [le for le, _ in pb] == [str(float(b)) for b in PROMPT_BOUNDS] + ["+Inf"]
    values = [v for _, v in pb]
    assert values == sorted(values), "buckets are cumulative"
    assert dict(pb) == {"0.0": 1, "1.0": 1, "2.0": 1, "4.0": 3, "8.0": 3, "16.0": 3,
                        "32.0": 4, "64.0": 4, "128.0": 4, "256.0": 4, "1024.0": 4,
                        "+Inf": 5}
    assert s[("sessionkv_proxy_prompt_blocks_count", ())] == 5
    assert s[("sessionkv_proxy_prompt_blocks_sum", ())] == sum(blocks)

    ds = _buckets(s, "sessionkv_proxy_routing_decision_seconds")
    assert [float(le) for le, _ in ds] == list(DECISION_BOUNDS) + [math.inf]
    got = dict(ds)
    assert got == {"1e-05": 1, "5e-05": 1, "0.0001": 2, "0.00025": 3, "0.0005": 3,
                   "0.001": 3, "0.005": 4, "0.01": 4, "0.05": 4, "+Inf": 5}
    assert s[("sessionkv_proxy_routing_decision_seconds_count", ())] == 5
    assert s[("sessionkv_proxy_routing_decision_seconds_sum", ())] == pytest.approx(
        sum(seconds))
    assert _families(m.registry)["sessionkv_proxy_prompt_blocks"] == (
        "histogram", "Full prompt blocks per routed request.")
    assert _families(m.registry)["sessionkv_proxy_routing_decision_seconds"] == (
        "histogram", "Time to make a routing decision.")


@pytest.mark.parametrize("bound_index", range(len(PROMPT_BOUNDS)))
def test_observation_on_a_bound_lands_in_that_bucket(bound_index):
    m = ProxyMetrics()
    bound = PROMPT_BOUNDS[bound_index]
    d_bound = DECISION_BOUNDS[min(bound_index, len(DECISION_BOUNDS) - 1)]
    m.count_route("decode_only", "load", "none", d_bound, bound)
    get = m.registry.get_sample_value
    pb = "sessionkv_proxy_prompt_blocks_bucket"
    assert get(pb, {"le": str(float(bound))}) == 1.0
    if bound_index:
        assert get(pb, {"le": str(float(PROMPT_BOUNDS[bound_index - 1]))}) == 0.0
    ds = "sessionkv_proxy_routing_decision_seconds_bucket"
    d_index = DECISION_BOUNDS.index(d_bound)
    assert get(ds, {"le": repr(d_bound)}) == 1.0
    if d_index:
        assert get(ds, {"le": repr(DECISION_BOUNDS[d_index - 1])}) == 0.0


def test_same_samples_as_prometheus_client_objects():
    """The collector's exposition equals that of Counter and Histogram fed the same
    events, ``_created`` aside."""
    ours = ProxyMetrics()
    ref = CollectorRegistry()
    req = Counter("sessionkv_proxy_requests", "Requests by endpoint and status.",
                  ["endpoint", "status"], registry=ref)
    dec = Counter("sessionkv_proxy_routing_decisions", "Routing decisions by mode and reason.",
                  ["mode", "reason"], registry=ref)
    hnd = Counter("sessionkv_proxy_session_handles",
                  "Session handles by outcome: attached, expired, other_tenant, none.",
                  ["outcome"], registry=ref)
    ds = Histogram("sessionkv_proxy_routing_decision_seconds",
                   "Time to make a routing decision.", buckets=DECISION_BOUNDS, registry=ref)
    pb = Histogram("sessionkv_proxy_prompt_blocks", "Full prompt blocks per routed request.",
                   buckets=PROMPT_BOUNDS, registry=ref)
    routes = [("disaggregated", "prefix", "none", 1e-4, 4),
              ("decode_only", "session", "attached", 3e-6, 0),
              ("disaggregated", "prefix", "expired", 0.2, 2000),
              ("disaggregated", "load", "none", 5e-5, 1024),
              ("prefill_only", "load", "other_tenant", 0.0, 1)]
    for mode, reason, outcome, secs, blocks in routes:
        ours.count_route(mode, reason, outcome, secs, blocks)
        dec.labels(mode, reason).inc()
        hnd.labels(outcome).inc()
        ds.observe(secs)
        pb.observe(blocks)
    for endpoint, status in [("completions", 200), ("chat", 400), ("completions", 200)]:
        ours.count_request(endpoint, status)
        req.labels(endpoint, str(status)).inc()

    def lines(registry):
        names = ("sessionkv_proxy_requests", "sessionkv_proxy_routing_decisions",
                 "sessionkv_proxy_session_handles", "sessionkv_proxy_routing_decision_seconds",
                 "sessionkv_proxy_prompt_blocks")
        return sorted(line for line in generate_latest(registry).decode().splitlines()
                      if "_created" not in line and any(n in line for n in names))

    assert lines(ours.registry) == lines(ref)
    assert len(lines(ref)) > 30


def test_fresh_registry_exports_empty_counters_and_zero_histograms():
    s = _samples(ProxyMetrics().registry)
    assert not [k for k in s if k[0].startswith("sessionkv_proxy_requests")]
    assert s[("sessionkv_proxy_prompt_blocks_count", ())] == 0
    assert s[("sessionkv_proxy_routing_decision_seconds_bucket", (("le", "+Inf"),))] == 0
    assert not [k for k in s if "overlap" in k[0]]
    fam = _families(ProxyMetrics().registry)
    assert "sessionkv_proxy_requests" in fam and "sessionkv_proxy_session_handles" in fam


def test_rare_path_metrics_stay_in_the_same_registry():
    m = ProxyMetrics()
    m.errors.labels("upstream_timeout").inc()
    m.retries.labels("decode").inc()
    m.in_flight.labels("http://e").set(3)
    get = m.registry.get_sample_value
    assert get("sessionkv_proxy_errors_total", {"kind": "upstream_timeout"}) == 1.0
    assert get("sessionkv_proxy_upstream_retries_total", {"role": "decode"}) == 1.0
    assert get("sessionkv_proxy_in_flight_requests", {"engine": "http://e"}) == 3.0


# ----------------------------------------------------------------- through the proxy
def _stub_engine() -> web.Application:
    completion = {"id": "cmpl-stub", "object": "text_completion", "created": 0,
                  "model": "stub", "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                             "total_tokens": 2},
                  "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]}

    async def complete(request):
        await request.read()
        return web.json_response(completion)

    async def models(_request):
        return web.json_response({"object": "list", "data": [
            {"id": "stub", "object": "model", "max_model_len": 4096}]})

    async def tokenize(request):
        body = await request.json()
        ids = [20 + i % 1000 for i in range(len(str(body.get("prompt", "")).split()))]
        return web.json_response({"count": len(ids), "max_model_len": 4096,
                                  "tokens": ids})

    async def metrics(_request):
        return web.Response(text="# TYPE vllm:num_requests_running gauge\n"
                                 'vllm:num_requests_running{model_name="stub"} 0.0\n')

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    return app


async def test_proxy_metrics_endpoint_counts_routed_requests(free_port):
    runner = web.AppRunner(_stub_engine())
    await runner.setup()
    # Two decode workers (one stub on two ports), so the router tokenizes and decides.
    stub_ports, proxy_port = (free_port(), free_port()), free_port()
    for port in stub_ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    config = load_config(None, {"engines": [{"url": f"http://127.0.0.1:{port}",
                                             "role": "decode"} for port in stub_ports],
                                "host": "127.0.0.1", "port": proxy_port,
                                "block_size": 16})
    proxy = create_app(config)
    await proxy.start()
    try:
        base = f"http://127.0.0.1:{proxy_port}"
        async with aiohttp.ClientSession() as http:
            prompt = " ".join(f"w{i}" for i in range(40))  # 40 tokens: 2 full blocks
            for _ in range(3):
                async with http.post(base + "/v1/completions",
                                     json={"model": "stub", "prompt": prompt,
                                           "max_tokens": 1}) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.post(base + "/v1/completions", json={"prompt": 3}) as resp:
                assert resp.status == 400
            async with http.get(base + "/metrics") as resp:
                assert resp.status == 200
                text = await resp.text()
    finally:
        await proxy.stop(1.0)
        await runner.cleanup()
    s = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            s[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert s[("sessionkv_proxy_requests_total",
              (("endpoint", "completions"), ("status", "200")))] == 3
    assert s[("sessionkv_proxy_requests_total",
              (("endpoint", "completions"), ("status", "400")))] == 1
    decisions = {k: v for k, v in s.items() if k[0] == "sessionkv_proxy_routing_decisions_total"}
    assert sum(decisions.values()) == 3
    handles = {k: v for k, v in s.items() if k[0] == "sessionkv_proxy_session_handles_total"}
    assert handles == {("sessionkv_proxy_session_handles_total", (("outcome", "none"),)): 3}
    assert s[("sessionkv_proxy_routing_decision_seconds_count", ())] == 3
    assert s[("sessionkv_proxy_routing_decision_seconds_sum", ())] > 0
    assert s[("sessionkv_proxy_prompt_blocks_count", ())] == 3
    assert s[("sessionkv_proxy_prompt_blocks_sum", ())] == 6
    assert s[("sessionkv_proxy_prompt_blocks_bucket", (("le", "2.0"),))] == 3
    assert s[("sessionkv_proxy_prompt_blocks_bucket", (("le", "1.0"),))] == 0
