"""The deployment's observability on a running cluster (the session's ``pd_cluster``).

* Every metric name ``deploy/grafana/vllm-sessionkv.json`` queries is one the proxy or
  an engine exports: read from their ``/metrics`` after a two-turn session went through
  the proxy.  A family declared with ``# TYPE`` but without a sample yet (a labelled
  counter nothing has incremented, such as ``sessionkv_proxy_errors``) counts as
  exported under the names its type gives it (``_total``; ``_bucket``, ``_sum``,
  ``_count``).
* The probe paths of ``deploy/helm/vllm-sessionkv`` answer 200 on the real proxy and
  engines.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from helpers import completion_body, metric_names, metric_sum, post, wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "vllm-sessionkv.json"
CHART = REPO / "deploy" / "helm" / "vllm-sessionkv"

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("", "_sum", "_count"), "gauge": ("",), "unknown": ("",),
             "info": ("_info",), "stateset": ("",), "gaugehistogram": ("_bucket",)}


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every target's PromQL expression, rows' nested panels included."""
    exprs: list[str] = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return exprs


def exported_names(exposition: str) -> tuple[set[str], set[str]]:
    """(names with samples, names of families declared without a sample)."""
    sampled, declared = set(), set()
    for family in text_string_to_metric_families(exposition):
        if family.samples:
            sampled.update(s.name for s in family.samples)
        else:
            declared.update(family.name + s for s in _SUFFIXES[family.type])
    return sampled, declared


def unknown_names(exprs: list[str], exported: set[str]) -> dict[str, set[str]]:
    """Per query, the names it selects that nothing exports."""
    return {e: missing for e in exprs if (missing := metric_names(e) - exported)}


def test_metric_names_are_read_from_promql():
    expr = ('histogram_quantile(0.99, sum by (le, instance) (rate('
            'vllm:time_to_first_token_seconds_bucket{job="x", a=~"b|c"}[$__rate_interval])))'
            ' / on (instance) group_left sum(sessionkv_proxy_index_blocks) > 1e-3')
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket",
                                  "sessionkv_proxy_index_blocks"}


def _session_through_proxy(cluster) -> None:
    """Two turns of one session through the proxy: the second carries D's handle."""
    prompt = [(i * 104729) % 990 + 20 for i in range(200)]
    headers = {"X-Session-ID": "deploy-observability"}
    first = post(cluster.proxy, "/v1/completions",
                 completion_body(cluster.model, prompt, max_tokens=8), headers=headers)
    prompt = prompt + first.token_ids + [(i * 7919) % 990 + 20 for i in range(40)]
    post(cluster.proxy, "/v1/completions",
         completion_body(cluster.model, prompt, max_tokens=8), headers=headers)


def test_every_metric_the_dashboard_queries_is_exported(pd_cluster):
    cluster = pd_cluster
    engines = cluster.prefill + cluster.decode
    before = sum(metric_sum(url, "sessionkv_prompt_tokens_total") for url in engines)
    _session_through_proxy(cluster)
    # Engines report their token accounting with their stats, a step or so later.
    wait_until(lambda: sum(metric_sum(url, "sessionkv_prompt_tokens_total")
                           for url in engines) > before,
               60, "the engines' sessionkv_prompt_tokens_total to count the session")
    sampled: set[str] = set()
    declared: set[str] = set()
    for url in [cluster.proxy, *engines]:
        got = exported_names(requests.get(url + "/metrics", timeout=30).text)
        sampled |= got[0]
        declared |= got[1]
    exported = sampled | declared
    exprs = dashboard_queries(json.loads(DASHBOARD.read_text()))
    queried = set().union(*map(metric_names, exprs))
    assert not unknown_names(exprs, exported), unknown_names(exprs, exported)
    # The traffic above gave these series samples (not only a declaration).
    for name in ("sessionkv_proxy_requests_total", "sessionkv_proxy_routing_decisions_total",
                 "sessionkv_proxy_session_handles_total", "sessionkv_prompt_tokens_total",
                 "sessionkv_proxy_channel_handles_total",
                 "sessionkv_proxy_routing_decision_seconds_bucket",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in queried and name in sampled, name
    # What the dashboard covers, by the list.
    for group in (
            {"sessionkv_prompt_tokens_total"},                       # reuse by source
            {"sessionkv_pull_decisions_total"},                      # pull or recompute
            {"sessionkv_proxy_session_handles_total", "sessionkv_handles_published_total",
             "sessionkv_session_holds_released_total",
             "sessionkv_proxy_channel_handles_total"},               # handle outcomes
            {"sessionkv_proxy_routing_decisions_total",
             "sessionkv_proxy_routing_decision_seconds_bucket"},     # routes, added latency
            {"sessionkv_proxy_index_blocks", "sessionkv_proxy_event_lag_seconds"},
            {"vllm:num_requests_waiting", "vllm:num_requests_running",
             "vllm:kv_cache_usage_perc"}):
        assert group <= queried, group - queried
    # The check fails on a misspelled name, against this same scrape.
    typo = [e.replace("sessionkv_prompt_tokens_total", "sessionkv_prompt_token_total")
            for e in exprs]
    assert {"sessionkv_prompt_token_total"} <= set().union(
        *unknown_names(typo, exported).values())


def test_the_charts_probe_paths_answer_on_the_running_cluster(pd_cluster):
    helm = shutil.which("helm")
    if helm is None:
        pytest.skip("helm is not installed (python ci/install_chart_tools.py)")
    done = subprocess.run([helm, "template", "skv", str(CHART)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    targets = {"proxy": [pd_cluster.proxy], "prefill": pd_cluster.prefill,
               "decode": pd_cluster.decode}
    checked = 0
    for doc in filter(None, yaml.safe_load_all(done.stdout)):
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
        if component not in targets:
            continue  # the bundled Redis: a redis-cli ping and a TCP probe
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        for key in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(key)
            if probe is None:
                continue
            path = probe["httpGet"]["path"]
            for url in targets[component]:
                resp = requests.get(url + path, timeout=30)
                assert resp.status_code == 200, (component, key, url + path, resp.status_code)
                checked += 1
    assert checked >= 5  # proxy readiness and liveness, each pool's three probes
