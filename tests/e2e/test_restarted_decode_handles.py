"""A proxy replica that never saw D restart attaches none of the old D's handles
(issue 47 must-show 2b), on the shared 1P+1D cluster (``pd_cluster``: Redis, every
request disaggregated).

Replica A is the cluster's proxy; replica B is a second proxy process on the same
engines and Redis that never looks at D's health (``metrics_scrape_interval_s`` an
hour) and sends nothing while D is down, so it cannot learn the restart from its own
failed checks.  Two sessions take a turn through A, which leaves D's handle in each
session's record in Redis; D is SIGKILLed and the supervisor restarts it.  The new
process writes its start-up epoch to Redis under its URL, so B's routing read finds
the record's handle outlived (``x-sessionkv-handle: engine_restarted``) and P makes
no read of the new D with it (P's accounting names no ``d_to_p`` decision, and P's
``sessionkv_pull_failures_total`` does not move).  Negative control: a third replica started after B's turn (so
D's handle channel has told it nothing) with the epoch gone from Redis (what a D
without ``withdraw_handles`` leaves) attaches the second session's old handle, and
P's read of it fails (its claim refused, or NIXL's handshake with the new agent) and is
recomputed.  Every answer equals the co-located server's.
"""

from __future__ import annotations

import json
import subprocess

import redis

import pytest

from cluster import free_port_block, kill_engine, launcher_child, start_proxy_process, \
    wait_engine_restarted, wait_proxy_sees
from helpers import assert_same, completion_body, metric_sum, post, reset_prefix_cache, \
    wait_until

from vllm_sessionkv.wire.redis_keys import RedisKeys

pytestmark = pytest.mark.cluster

COMPLETIONS = "/v1/completions"


def _start_replica(cluster, tmp_path) -> tuple[subprocess.Popen, str]:
    """Replica B: replica A's command line on another port, blind to D's health."""
    argv = launcher_child(cluster, argv_has="sessionkv_proxy").cmdline()
    port = free_port_block(1)
    argv[argv.index("--port") + 1] = str(port)
    config = tmp_path / "replica-b.json"
    config.write_text(json.dumps({"metrics_scrape_interval_s": 3600.0}))
    return start_proxy_process([*argv, "--config", str(config)], port)


def test_a_replica_that_never_saw_d_restart_attaches_no_old_handle(pd_cluster, tmp_path):
    c = pd_cluster
    (d_url,), (p_url,) = c.decode, c.prefill
    replica_b, b_url = _start_replica(c, tmp_path)
    prompts = {s: [10 + (7 * s + i) % 900 for i in range(400 + 40 * s)] for s in (1, 2)}

    def turn(proxy: str, s: int, tokens: list[int]):
        body = completion_body(c.model, tokens)
        got = post(proxy, COMPLETIONS, body, headers={"X-Session-ID": f"restart-b-{s}"})
        assert_same(got, post(c.colocated, COMPLETIONS, body), f"session {s}")
        return got

    def failed_pulls() -> float:
        return metric_sum(p_url, "sessionkv_pull_failures_total")

    def p_decision(got) -> str:
        return json.loads(got.headers.get("x-sessionkv-prefill") or "{}").get("decision", "")

    try:
        answers = {s: turn(c.proxy, s, prompts[s]) for s in (1, 2)}   # through A
        # P forgets the prompts, so that for the next turns a pull of D's handle is
        # cheaper than recompute: an attached handle is claimed.
        reset_prefix_cache(p_url)
        old_pid, since = kill_engine(c, d_url)
        wait_engine_restarted(c, "decode0", d_url, old_pid, since)
        wait_proxy_sees(c.proxy, decode=1)
        keys = RedisKeys()
        store = redis.Redis.from_url(c.redis)
        wait_until(lambda: store.hget(keys.epochs, d_url) is not None, 30,
                   "the new D's epoch in Redis")

        before = failed_pulls()
        got = turn(b_url, 1, prompts[1] + answers[1].token_ids + [11, 12, 13])
        assert got.headers["x-sessionkv-handle"] == "engine_restarted"
        assert got.headers["x-sessionkv-prefill-engine"] == p_url
        assert not p_decision(got).startswith("d_to_p"), p_decision(got)   # no read of D

        # Negative control: a replica that has no epoch to compare with (a third,
        # started now, so the channel has told it nothing; the epoch gone from Redis,
        # as a D without withdraw_handles leaves it) attaches the old handle.
        replica_c, c_url = _start_replica(c, tmp_path)
        try:
            assert store.hdel(keys.epochs, d_url) == 1
            got = turn(c_url, 2, prompts[2] + answers[2].token_ids + [11, 12, 13])
        finally:
            replica_c.terminate()
            replica_c.wait(timeout=30)
        assert got.headers["x-sessionkv-handle"] == "attached"
        # P tried to read the old D's blocks from the new process and failed (its claim
        # refused, or NIXL's handshake with the new agent failed first, as for a P
        # that had not read from it yet), then recomputed: counted as P's one failed
        # pull since ``before``, so B's turn, earlier, made none.
        assert p_decision(got).startswith("d_to_p:pull_failed"), p_decision(got)
        wait_until(lambda: failed_pulls() >= before + 1, 60,
                   "the control's failed pull in P's counters")
        assert failed_pulls() == before + 1, \
            f"a read of the old D's handle was tried: {before} -> {failed_pulls()}"
        store.close()
    finally:
        replica_b.terminate()
        replica_b.wait(timeout=30)
