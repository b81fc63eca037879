"""The proxy under faults and load, on the session's real P and D engines.

Each test starts its own proxy over ``pd_cluster``'s engines (and, where Redis is
the subject, its own redis-server that it kills, stops and restarts), so the faults
never reach the cluster the other tests share.  What must hold:

* Redis killed, stopped (SIGSTOP) or restarted under concurrent session traffic:
  no request fails, every answer equals the co-located server's, ``/health`` and the
  metrics show the outage while it lasts and return to normal after it;
* 300 concurrent requests through a Redis-backed proxy: no errors;
* a stopped (SIGSTOP) prefill engine gets no new requests once it has been silent
  for the stall bound, and ``/health`` names it; it rejoins when it answers again;
* the pool's only P stopped and resumed with requests sent to it meanwhile: none
  fails (the connections it resets as it resumes are replaced).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
import requests

from cluster import OwnRedis, free_port_block
from helpers import (assert_same, completion_body, engine_pid, metric_sum, parse_generation,
                     post, signal_tree)

from vllm_sessionkv.dev.launch import ManagedProcess, start_process, stop_all, wait_healthy

pytestmark = pytest.mark.cluster

COMPLETIONS = "/v1/completions"
# Short bounds so that each fault shows within seconds.
FAST_CONFIG = {"engine_stall_s": 2.0, "metrics_scrape_interval_s": 0.5,
               "metrics_scrape_timeout_s": 1.0,
               "index": {"redis_timeout_s": 0.2, "redis_retry_interval_s": 0.2}}


def _engine_spec(cluster, url: str) -> str:
    spec = f"url={url}"
    if url in cluster.kv_events:   # the perturbed P publishes none
        spec += f",events={cluster.kv_events[url]}"
    if url in cluster.early_decode:
        spec += f",early={cluster.early_decode[url]}"
    return spec


def start_proxy(cluster, log_dir, *, prefill: list[str], redis_url: str | None = None,
                extra_config: dict | None = None) -> tuple[ManagedProcess, str]:
    port = free_port_block(1)
    config_path = log_dir / f"proxy-{port}.json"
    config_path.write_text(json.dumps({**FAST_CONFIG, **(extra_config or {})}))
    argv = [sys.executable, "-m", "sessionkv_proxy", "--port", str(port),
            "--config", str(config_path), "--block-size", "32",
            "--decode-only-max-uncached-tokens", "-1", "--tokenizer", cluster.model]
    argv += [a for url in prefill for a in ("--prefill", _engine_spec(cluster, url))]
    argv += [a for url in cluster.decode for a in ("--decode", _engine_spec(cluster, url))]
    if redis_url:
        argv += ["--redis-url", redis_url]
    proc = start_process(f"proxy-{port}", argv, log_dir)
    url = f"http://127.0.0.1:{port}"
    wait_healthy([(proc, url)], timeout_s=60)
    return proc, url


def health(url: str) -> tuple[int, dict]:
    resp = requests.get(url + "/health", timeout=10)
    return resp.status_code, resp.json()


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


class SessionTraffic:
    """Concurrent sessions, each sending turn after turn with its history growing,
    every answer checked against the co-located server; runs until stopped."""

    def __init__(self, cluster, proxy: str, sessions: int, max_turns: int = 40) -> None:
        self.cluster, self.proxy = cluster, proxy
        self.sessions, self.max_turns = sessions, max_turns
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.mismatches: list[str] = []
        self.ok = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(sessions)
        self._futures = []

    def __enter__(self) -> SessionTraffic:
        self._futures = [self._pool.submit(self._session, i) for i in range(self.sessions)]
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for f in self._futures:
            f.result(timeout=300)
        self._pool.shutdown()

    def _session(self, i: int) -> None:
        model = self.cluster.model
        history = f"session {i} of the fault drill: the kato is of rimu and senlo. " * 3
        sid = f"faults-{os.getpid()}-{i}-{time.monotonic_ns()}"
        for turn in range(self.max_turns):
            if self.stop.is_set():
                return
            history += f" turn {turn}: the vaqu is of zipe and dramon?"
            body = completion_body(model, history, max_tokens=6)
            try:
                got = post(self.proxy, COMPLETIONS, body, headers={"X-Session-ID": sid},
                           timeout=120)
            except Exception as exc:  # a non-200 answer or a broken connection
                with self._lock:
                    self.errors.append(f"{time.strftime('%X')} session {i} turn {turn}: "
                                       f"{exc}"[:400])
                continue
            base = post(self.cluster.colocated, COMPLETIONS, body)
            try:
                assert_same(got, base, f"session {i} turn {turn}")
            except AssertionError as exc:
                with self._lock:
                    self.mismatches.append(str(exc)[:400])
            with self._lock:
                self.ok += 1
            history += got.text

    def run_for(self, seconds: float) -> None:
        """Let traffic flow for ``seconds`` and at least one more answer."""
        before = self.ok
        time.sleep(seconds)
        wait_for(lambda: self.ok > before, 60, "traffic to make progress")


@pytest.fixture
def own_redis(tmp_path):
    server = OwnRedis(free_port_block(1), tmp_path)
    yield server
    server.stop()


@pytest.fixture
def redis_proxy(pd_cluster, own_redis, tmp_path):
    proc, url = start_proxy(pd_cluster, tmp_path, prefill=pd_cluster.prefill,
                            redis_url=own_redis.url)
    yield url
    stop_all([proc])


def _redis_state(proxy: str) -> str:
    status, body = health(proxy)
    assert status == 200, body   # the proxy serves throughout
    return body["redis"]["state"]


def test_redis_outages_under_session_traffic_fail_no_request(pd_cluster, own_redis,
                                                             tmp_path):
    proc, proxy = start_proxy(pd_cluster, tmp_path, prefill=pd_cluster.prefill,
                              redis_url=own_redis.url)
    try:
        _redis_drill(pd_cluster, own_redis, proxy)
    finally:
        stop_all([proc])


def _redis_drill(cluster, own_redis, proxy: str) -> None:
    sent_before = metric_sum(proxy, "sessionkv_proxy_requests_total")
    with SessionTraffic(cluster, proxy, sessions=8) as traffic:
        traffic.run_for(2.0)
        assert _redis_state(proxy) == "up"
        assert metric_sum(proxy, "sessionkv_proxy_redis_up") == 1

        # Killed: the next calls fail, the breaker opens, routing goes on locally.
        own_redis.kill()
        wait_for(lambda: _redis_state(proxy) == "down", 15, "/health to show redis down")
        status, body = health(proxy)
        assert body["status"] == "degraded" and any("redis" in p for p in body["problems"])
        assert metric_sum(proxy, "sessionkv_proxy_redis_up") == 0
        traffic.run_for(2.0)
        assert metric_sum(proxy, "sessionkv_proxy_degraded_requests_total",
                          reason="redis_unavailable") > 0

        # Back (empty, same port): the proxy re-publishes and stops degrading.
        own_redis.start()
        wait_for(lambda: _redis_state(proxy) == "up", 30, "/health to show redis up")
        assert metric_sum(proxy, "sessionkv_proxy_redis_republishes_total") >= 1
        traffic.run_for(2.0)

        # Stopped (SIGSTOP): calls time out instead of failing fast; same outcome.
        own_redis.pause()
        wait_for(lambda: _redis_state(proxy) == "down", 15, "/health to show redis down")
        traffic.run_for(2.0)
        own_redis.resume()
        wait_for(lambda: _redis_state(proxy) == "up", 30, "/health to show redis up")
        traffic.run_for(2.0)

    assert traffic.errors == [], traffic.errors[:5]
    assert traffic.mismatches == [], traffic.mismatches[:5]
    assert traffic.ok > 0
    status, body = health(proxy)
    assert status == 200 and body["status"] == "ok", body
    assert metric_sum(proxy, "sessionkv_proxy_redis_up") == 1
    assert metric_sum(proxy, "sessionkv_proxy_errors_total", kind="redis_timeout") + \
        metric_sum(proxy, "sessionkv_proxy_errors_total", kind="redis_error") > 0
    # Every request is counted, and each was a 200.
    counted = metric_sum(proxy, "sessionkv_proxy_requests_total") - sent_before
    assert counted == traffic.ok == metric_sum(proxy, "sessionkv_proxy_requests_total",
                                               status="200") - sent_before


async def _burst(proxy: str, model: str, n: int) -> list[tuple[int, str, str]]:
    """``n`` concurrent completions; (status, prompt, text) each."""
    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str, str]:
        prompt = f"burst prompt {i % 30}: the kato is of rimu and senlo. " * 2
        headers = {"X-Session-ID": f"burst-{i}"} if i % 2 else {}
        async with session.post(proxy + COMPLETIONS, headers=headers,
                                json=completion_body(model, prompt, max_tokens=4)) as resp:
            data = await resp.read()
            text = json.loads(data)["choices"][0]["text"] if resp.status == 200 else \
                data.decode(errors="replace")[:300]
            return resp.status, prompt, text

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await asyncio.gather(*(one(session, i) for i in range(n)))


def test_300_concurrent_requests_through_a_redis_backed_proxy(pd_cluster, redis_proxy):
    results = asyncio.run(_burst(redis_proxy, pd_cluster.model, 300))
    failed = [(s, t) for s, _, t in results if s != 200]
    assert failed == [], failed[:5]
    # The same prompt gives the co-located server's text (temperature 0).
    by_prompt = {p: t for _, p, t in results}
    for prompt, text in list(by_prompt.items())[:10]:
        base = post(pd_cluster.colocated, COMPLETIONS,
                    completion_body(pd_cluster.model, prompt, max_tokens=4))
        assert text == base.text, prompt
    assert metric_sum(redis_proxy, "sessionkv_proxy_requests_total", status="200") >= 300


def _engine_state(proxy: str, url: str) -> str:
    status, body = health(proxy)
    return next(e["state"] for e in body["engines"] if e["url"] == url)


def test_a_stopped_prefill_engine_gets_no_new_requests(pd_cluster, tmp_path):
    """The perturbed-model P stands in for a second P: while it is stopped nothing
    may reach it (its KV would change the answers), and the real P serves."""
    stopped = pd_cluster.extras["perturbed_prefill"]
    pid = engine_pid(stopped)
    proc, proxy = start_proxy(pd_cluster, tmp_path, prefill=[pd_cluster.prefill[0], stopped])
    try:
        signal_tree(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: _engine_state(proxy, stopped) == "stalled", 20,
                     "/health to show the stopped P stalled")
            status, body = health(proxy)
            assert status == 200 and body["status"] == "degraded", body
            assert metric_sum(proxy, "sessionkv_proxy_engine_available", engine=stopped) == 0
            for i in range(6):
                body = completion_body(pd_cluster.model,
                                       f"stall drill {i}: the vaqu is of zipe. " * 8,
                                       max_tokens=6)
                got = post(proxy, COMPLETIONS, body, timeout=60)
                assert got.headers["x-sessionkv-prefill-engine"] == pd_cluster.prefill[0]
                assert_same(got, post(pd_cluster.colocated, COMPLETIONS, body), f"turn {i}")
        finally:
            signal_tree(pid, signal.SIGCONT)
        wait_for(lambda: _engine_state(proxy, stopped) == "up", 30,
                 "/health to show the P back")
        status, body = health(proxy)
        assert status == 200 and body["status"] == "ok", body
        assert metric_sum(proxy, "sessionkv_proxy_errors_total", kind="engine_stalled") >= 1
    finally:
        stop_all([proc])


def test_the_only_prefill_engine_stopped_and_resumed_costs_no_request(pd_cluster, tmp_path):
    """The pool's only P stopped (SIGSTOP) right after six turns, nine requests sent
    to it meanwhile on the connections those turns left open, then resumed.  uvicorn
    back from the stop resets each connection that was idle when it stopped (its
    overdue keep-alive timer runs before it reads the request): each of those requests
    goes out again on a new connection, and all nine are served through P, with the
    co-located server's answers (before: 502 ``no prefill engine reachable``)."""
    p_url = pd_cluster.prefill[0]
    pid = engine_pid(p_url)
    # The nine reach P before the stall bound would send them to D alone.
    proc, proxy = start_proxy(pd_cluster, tmp_path, prefill=[p_url],
                              extra_config={"engine_stall_s": 10.0})

    def body(tag: str, i: int) -> dict:
        return completion_body(pd_cluster.model,
                               f"stop drill {tag}{i}: the kato is of rimu and senlo. " * 8,
                               max_tokens=6)

    def send(tag: str, i: int):
        resp = requests.post(proxy + COMPLETIONS, json=body(tag, i), timeout=180,
                             headers={"X-Session-ID": f"stop-drill-{tag}{i}"})
        return resp.status_code, resp.headers.get("x-sessionkv-route"), resp

    try:
        with ThreadPoolExecutor(9) as pool:
            six = list(pool.map(lambda i: send("a", i), range(6)))
            assert [s for s, _, _ in six] == [200] * 6, [r.text for _, _, r in six]
            signal_tree(pid, signal.SIGSTOP)
            try:
                nine = [pool.submit(send, "b", i) for i in range(9)]
                time.sleep(8.0)   # past uvicorn's 5 s keep-alive
            finally:
                signal_tree(pid, signal.SIGCONT)
            answers = [f.result() for f in nine]
        assert [(s, route) for s, route, _ in answers] == [(200, "disaggregated")] * 9, \
            [r.text[:200] for _, _, r in answers]
        for i, (_, _, resp) in enumerate(answers):
            got = parse_generation(resp.json(), dict(resp.headers))
            assert_same(got, post(pd_cluster.colocated, COMPLETIONS, body("b", i)), f"b{i}")
        assert metric_sum(proxy, "sessionkv_proxy_errors_total", kind="prefill_connect") == 0
    finally:
        stop_all([proc])


def test_every_way_a_request_ends_is_counted(pd_cluster):
    """A streamed answer the client reads to the end and then closes is a 200; a client
    that leaves mid-stream is a 499; a bad body a 400."""
    proxy = pd_cluster.proxy

    def count(status: str) -> float:
        return metric_sum(proxy, "sessionkv_proxy_requests_total", endpoint="completions",
                          status=status)

    statuses = ("200", "499", "400", "502", "500")
    before = {s: count(s) for s in statuses}
    body = completion_body(pd_cluster.model, "count me: the kato is of rimu. " * 6,
                           max_tokens=8, stream=True)
    for _ in range(3):   # read to [DONE], then close at once
        with requests.post(proxy + COMPLETIONS, json=body, stream=True, timeout=120) as r:
            assert r.status_code == 200
            assert b"data: [DONE]" in b"".join(r.iter_content(None))
    long_body = dict(body, max_tokens=2000)
    with requests.post(proxy + COMPLETIONS, json=long_body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_content(64))   # the first bytes, then leave
    requests.post(proxy + COMPLETIONS, data=b"{not json", timeout=30)
    counted = lambda: {s: count(s) - before[s] for s in statuses}  # noqa: E731
    wait_for(lambda: counted()["499"] >= 1, 30, f"the 499 to be counted ({counted()})")
    assert counted() == {"200": 3, "499": 1, "400": 1, "502": 0, "500": 0}, counted()
