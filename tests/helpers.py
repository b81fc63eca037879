"""Test helpers: OpenAI calls, the correctness comparison, metrics scraping.

The comparison is the project's yardstick: token ids *and* the top-5 logprob values at
every position, against a co-located vLLM server at temperature 0.  The tiny model's
text is degenerate, so text equality alone proves nothing, and wrong KV often shows
only as logprob differences of a few hundredths with equal tokens.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import requests

# Two runs on the same KV agree exactly on CPU; wrong KV differs by >= 1e-2.
LOGPROB_TOLERANCE = 2e-3


def completion_body(model: str, prompt, max_tokens: int = 16, **extra) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 5, "ignore_eos": True, "return_token_ids": True, **extra}


def chat_body(model: str, messages, max_tokens: int = 16, **extra) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": 5, "ignore_eos": True, "return_token_ids": True,
            **extra}


@dataclass
class Generation:
    token_ids: list[int]
    top_logprobs: list[list[float]]   # per position, the top-5 values sorted
    text: str
    raw: Any = None
    headers: dict[str, str] = field(default_factory=dict)


def _sorted_values(entry) -> list[float]:
    if isinstance(entry, dict):
        return sorted(entry.values(), reverse=True)
    return sorted((e["logprob"] for e in entry), reverse=True)


def parse_generation(out: dict[str, Any], headers: dict[str, str] | None = None) -> Generation:
    choice = out["choices"][0]
    logprobs = choice.get("logprobs") or {}   # none when the request asked for none
    if "message" in choice:  # chat
        tops = [_sorted_values(c["top_logprobs"]) for c in logprobs.get("content") or ()]
        text = choice["message"]["content"] or ""
    else:
        tops = [_sorted_values(t) for t in logprobs.get("top_logprobs") or ()]
        text = choice["text"]
    return Generation(token_ids=list(choice.get("token_ids") or []), top_logprobs=tops,
                      text=text, raw=out, headers=dict(headers or {}))


def parse_stream(raw: str, headers: dict[str, str] | None = None) -> Generation:
    """Reassemble an SSE stream (completions or chat) into one Generation."""
    token_ids: list[int] = []
    tops: list[list[float]] = []
    text: list[str] = []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices", []):
            token_ids.extend(choice.get("token_ids") or [])
            lp = choice.get("logprobs") or {}
            if "delta" in choice:  # chat
                tops.extend(_sorted_values(c["top_logprobs"]) for c in lp.get("content") or [])
                text.append((choice.get("delta") or {}).get("content") or "")
            else:
                tops.extend(_sorted_values(t) for t in lp.get("top_logprobs") or [])
                text.append(choice.get("text") or "")
    return Generation(token_ids=token_ids, top_logprobs=tops, text="".join(text),
                      headers=dict(headers or {}))


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         timeout: float = 300.0) -> Generation:
    resp = requests.post(url + path, json=body, headers=headers or {}, timeout=timeout,
                         stream=bool(body.get("stream")))
    if resp.status_code != 200:
        raise AssertionError(f"{url}{path} -> {resp.status_code}: {resp.text[:800]}")
    if body.get("stream"):
        return parse_stream(resp.text, dict(resp.headers))
    return parse_generation(resp.json(), dict(resp.headers))


@dataclass
class Comparison:
    positions: int
    token_mismatches: int
    max_logprob_diff: float
    first_mismatch: int | None

    @property
    def equal(self) -> bool:
        return self.token_mismatches == 0 and self.max_logprob_diff <= LOGPROB_TOLERANCE

    def __str__(self) -> str:
        return (f"{self.token_mismatches}/{self.positions} token mismatches, max |dlogprob| "
                f"{self.max_logprob_diff:.4g}, first mismatch at {self.first_mismatch}")


def compare(candidate: Generation, baseline: Generation) -> Comparison:
    """Compare two generations position by position (token ids and top-5 logprobs)."""
    n = max(len(candidate.token_ids), len(baseline.token_ids))
    mismatches, first = 0, None
    for i in range(n):
        a = candidate.token_ids[i] if i < len(candidate.token_ids) else None
        b = baseline.token_ids[i] if i < len(baseline.token_ids) else None
        if a != b:
            mismatches += 1
            first = i if first is None else first
    max_diff = 0.0
    if len(candidate.top_logprobs) != len(baseline.top_logprobs):
        max_diff = float("inf")
    for ca, cb in zip(candidate.top_logprobs, baseline.top_logprobs):
        if len(ca) != len(cb):
            max_diff = float("inf")
            continue
        for x, y in zip(ca, cb):
            max_diff = max(max_diff, abs(x - y))
    if not candidate.token_ids or not candidate.top_logprobs:
        mismatches = max(mismatches, 1)
    return Comparison(positions=n, token_mismatches=mismatches, max_logprob_diff=max_diff,
                      first_mismatch=first)


def assert_same(candidate: Generation, baseline: Generation, what: str = "") -> Comparison:
    result = compare(candidate, baseline)
    assert result.equal, f"{what}: differs from the co-located baseline: {result}"
    return result


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series over label sets matching ``labels``."""
    return _sum_in(requests.get(url + "/metrics", timeout=30).text, name, **labels)


def _sum_in(text: str, name: str, **labels: str) -> float:
    """``metric_sum`` over a /metrics page already read."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line)
        if not m or m.group(1) != name:
            continue
        label_text = m.group(2) or ""
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(m.group(3))
    return total


PROMPT_SOURCES = ("local_hit", "pulled_from_peer", "pulled_from_host", "recomputed")


def prompt_sources(url: str) -> dict[str, float]:
    """An engine's ``sessionkv_prompt_tokens_total`` by source (the four that add up
    to its prompt tokens), from one read of its /metrics, so they are of one moment."""
    text = requests.get(url + "/metrics", timeout=30).text
    return {s: _sum_in(text, "sessionkv_prompt_tokens_total", source=s)
            for s in PROMPT_SOURCES}


def prefill_accounting(got: Generation, p_url: str, before: dict[str, float],
                       prompt_tokens: int) -> dict[str, float]:
    """P's accounting of one request: its ``x-sessionkv-prefill`` header, or, on a stream
    whose first chunk came from D before P's answer reached the proxy (no header then),
    the growth of P's own counters since ``before`` once they count the whole prompt.
    Only for a test that sends P one request at a time."""
    header = got.headers.get("x-sessionkv-prefill")
    if header:
        return json.loads(header)
    grown: dict[str, float] = {}

    def counted() -> bool:
        now = prompt_sources(p_url)
        grown.update({f"{s}_tokens": now[s] - before[s] for s in PROMPT_SOURCES})
        return sum(grown.values()) >= prompt_tokens
    wait_until(counted, 60, f"P's counters to count a {prompt_tokens}-token prompt")
    return {"prompt_tokens": sum(grown.values()), **grown}


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)


def reset_prefix_cache(url: str, timeout_s: float = 60.0) -> None:
    """Empty the engine's prefix cache, and wait until it says it did.

    vLLM answers 200 with ``{"success": false}`` while any block is in use (a running
    request, a P's hand-off D has not read yet, a hold released in the step just
    begun), and then keeps every cached block: a test that went on would find its
    prompt cached where it expected none.  ``reset_external`` also drops our
    connector's session holds and host tier (a stock connector ignores it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = requests.post(url + "/reset_prefix_cache", params={"reset_external": "true"},
                             timeout=30)
        resp.raise_for_status()
        if resp.json() == {"success": True}:
            return
        assert time.monotonic() < deadline, (
            f"{url}/reset_prefix_cache still answers {resp.text} after {timeout_s} s")
        time.sleep(0.1)


def token_ids(seed: int, n: int) -> list[int]:
    """Deterministic 'text' token ids away from the tiny model's special tokens."""
    return [(seed * 7919 + i * 104729 + (i * i) % 13) % 990 + 20 for i in range(n)]


def fresh_prefill_params() -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def connector_prom_metrics():
    """(registry, metrics): the connector's ``SessionKVPromMetrics`` for one engine
    (label ``engine="0"``), its series in a registry of their own, built as vLLM builds
    them but without vLLM's multiprocess mode."""
    import types

    import prometheus_client

    from vllm_sessionkv.stats import SessionKVPromMetrics

    registry = prometheus_client.CollectorRegistry()

    def bind(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("registry", registry)
                kwargs.pop("multiprocess_mode", None)
                super().__init__(*args, **kwargs)
        return Bound

    metric_types = {cls: bind(cls) for cls in (prometheus_client.Gauge,
                                               prometheus_client.Counter,
                                               prometheus_client.Histogram)}
    config = types.SimpleNamespace(kv_transfer_config=None)
    return registry, SessionKVPromMetrics(config, metric_types, ["engine"], {0: ["0"]})


# --------------------------------------------------------------- metrics, as registered

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                 "and", "or", "unless", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels, keywords)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)               # string literals
    text = re.sub(r"\{[^}]*\}", "", text)                       # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)                      # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        name = m.group(0)
        if name.lower() in PROMQL_WORDS or re.match(r"\s*\(", text[m.end():]):
            continue  # a keyword or a function call
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue  # the exponent or unit of a number
        names.add(name)
    return names


def registered_series(registry) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exported name -> (type, label names) of every series a prometheus_client
    registry holds, read from its collectors (a metric with no samples yet included);
    a counter under its ``_total`` name."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for collector in list(registry._collector_to_names):
        if hasattr(collector, "_labelnames") and hasattr(collector, "_type"):
            found = [(collector._name, collector._type, tuple(collector._labelnames))]
        else:
            found = [(f.name, f.type, tuple(getattr(f, "_labelnames", ())))
                     for f in collector.describe()]
        for name, kind, labels in found:
            out[name + "_total" if kind == "counter" else name] = (kind, labels)
    return out


def proxy_series() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every series the proxy can export: ``ProxyMetrics`` with Redis, and the handle
    channel's collector, which the app registers when a decode engine has one."""
    from sessionkv_proxy import handle_subscriber
    from sessionkv_proxy.metrics import ProxyMetrics

    metrics = ProxyMetrics(redis=True)
    metrics.registry.register(handle_subscriber._ChannelCollector([]))
    return registered_series(metrics.registry)


def connector_series() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every series the connector registers on an engine (NIXL's own included)."""
    registry, _ = connector_prom_metrics()
    return registered_series(registry)


def connection_refused(address: str, port: int) -> bool:
    """Whether a TCP connection to ``address:port`` is refused (nothing listens on
    that address), as opposed to accepted."""
    import socket

    try:
        with socket.create_connection((address, port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


def engine_pid(url: str) -> int:
    """The pid of the process listening on an engine URL's port (its API server)."""
    port = int(url.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp")
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN)


def signal_tree(pid: int, sig: int) -> None:
    """Send a signal to a process and all its descendants (vLLM's API server and its
    engine core): SIGSTOP freezes an engine mid-request, SIGCONT resumes it."""
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
