"""tests/known_state.py against a scripted cluster (no engines, under a second): a
cluster in shape passes after one reset; each way of being off (an engine down, the
proxy counting a D short, a request left running, a reset refused, a hold left)
fails, naming the engine and what is off."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import known_state

P, D, CO, PERT, PROXY = ("http://p:1", "http://d:2", "http://co:3", "http://pert:4",
                         "http://proxy:5")


class FakeCluster:
    """What the engines and the proxy answer; each test spoils one thing."""

    def __init__(self) -> None:
        self.health = {P: 200, D: 200, CO: 200, PERT: 200, PROXY: 200}
        self.proxy_counts = {"prefill": 1, "decode": 1}
        self.metrics = {(url, name): 0.0 for url in (P, D, CO, PERT)
                        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                     "sessionkv_session_holds")}
        self.metrics[(D, "sessionkv_session_holds")] = 2.0     # until the reset
        self.admin_status = 200
        self.baseline_reset = {"success": True}
        self.keep_holds = False
        self.resets = 0

    def get(self, url: str, timeout: float):
        base = url.rsplit("/", 1)[0]
        body = {"healthy": self.proxy_counts, "redis": {"state": "up"}} if base == PROXY else {}
        return SimpleNamespace(status_code=self.health[base], text=json.dumps(body),
                               json=lambda: body)

    def post(self, url: str, params=None, timeout: float = 0):
        base = url.rsplit("/", 2)[0] if url.endswith("/admin/reset") else url.rsplit("/", 1)[0]
        if base == PROXY:
            self.resets += 1
            if self.admin_status == 200 and not self.keep_holds:
                self.metrics[(D, "sessionkv_session_holds")] = 0.0
            return SimpleNamespace(status_code=self.admin_status, text="{}")
        return SimpleNamespace(json=lambda: self.baseline_reset)

    def metric_sum(self, url: str, name: str) -> float:
        return self.metrics[(url, name)]

    def cluster(self):
        return SimpleNamespace(prefill=[P], decode=[D], colocated=CO,
                               extras={"perturbed_prefill": PERT}, proxy=PROXY, redis="r",
                               launcher=SimpleNamespace(poll=lambda: None))


@pytest.fixture
def fake(monkeypatch) -> FakeCluster:
    fake = FakeCluster()
    monkeypatch.setattr(known_state, "requests", SimpleNamespace(
        get=fake.get, post=fake.post, RequestException=OSError))
    monkeypatch.setattr(known_state, "metric_sum", fake.metric_sum)
    for name in ("HEALTHY_TIMEOUT_S", "IDLE_TIMEOUT_S", "RESET_TIMEOUT_S"):
        monkeypatch.setattr(known_state, name, 0.0)
    monkeypatch.setattr(known_state, "_POLL_S", 0.0)
    return fake


def test_a_cluster_in_shape_passes_after_its_reset(fake):
    known_state.restore_known_state(fake.cluster())
    assert fake.resets == 1


@pytest.mark.parametrize("spoil, named", [
    (lambda f: f.health.__setitem__(D, 503), "D http://d:2: /health -> 503"),
    (lambda f: f.proxy_counts.__setitem__("decode", 0), "proxy counts"),
    (lambda f: f.metrics.__setitem__((P, "vllm:num_requests_running"), 1.0),
     "P http://p:1: 1 requests running"),
    (lambda f: setattr(f, "admin_status", 502), "proxy /admin/reset -> 502"),
    (lambda f: setattr(f, "baseline_reset", {"success": False}),
     "co-located baseline http://co:3: /reset_prefix_cache"),
    (lambda f: setattr(f, "keep_holds", True), "D http://d:2: 2 session holds"),
])
def test_each_way_of_being_off_fails_naming_it(fake, spoil, named):
    spoil(fake)
    with pytest.raises(AssertionError, match="not in its known state") as err:
        known_state.restore_known_state(fake.cluster())
    assert named in str(err.value), str(err.value)
