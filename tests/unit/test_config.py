from __future__ import annotations

import pytest

from vllm_sessionkv.config import ConfigError, parse_config


def test_defaults():
    cfg = parse_config({})
    assert cfg.session_pulls and cfg.cost.min_pull_tokens == 1


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="sesion_lease_s"):
        parse_config({"sessionkv": {"sesion_lease_s": 3}})


def test_nested_bad_type_is_named():
    with pytest.raises(ConfigError, match=r"cost.per_transfer_s"):
        parse_config({"sessionkv": {"cost": {"per_transfer_s": "fast"}}})


def test_engine_pacing_defaults_depend_on_platform():
    cfg = parse_config({})
    assert cfg.busy_poll_cap_s(cpu_platform=True) == 0.002
    assert cfg.busy_poll_cap_s(cpu_platform=False) is None
    assert cfg.holding_step_interval(cpu_platform=True) == 0.02
    assert cfg.holding_step_interval(cpu_platform=False) == 0.0
    cfg = parse_config({"sessionkv": {"engine_busy_poll_s": 1.0, "holding_step_interval_s": 0}})
    assert cfg.busy_poll_cap_s(cpu_platform=True) == 1.0
    assert cfg.holding_step_interval(cpu_platform=True) == 0.0
    assert cfg.engine_spin_while_busy is True
    assert parse_config({"sessionkv": {"engine_spin_while_busy": False}}
                        ).engine_spin_while_busy is False


@pytest.mark.parametrize("key,value", [("engine_busy_poll_s", -0.1),
                                       ("holding_step_interval_s", 1.5),
                                       ("holding_step_interval_s", -1),
                                       ("engine_spin_while_busy", "sometimes")])
def test_bad_pacing_values_are_named(key, value):
    with pytest.raises(ConfigError, match=key):
        parse_config({"sessionkv": {key: value}})


@pytest.mark.parametrize("raw,key", [({"sync_load_timeout_s": 0}, "sync_load_timeout_s"),
                                     ({"cost": {"sync_load_max_stall_s": -0.001}},
                                      "cost.sync_load_max_stall_s"),
                                     ({"cost": {"sync_load_max_stall_s": 2}},
                                      "cost.sync_load_max_stall_s")])
def test_bad_sync_load_values_are_named(raw, key):
    with pytest.raises(ConfigError, match=key):
        parse_config({"sessionkv": raw})


@pytest.mark.parametrize("raw,key", [({"redis_url": "10.0.0.9:6379"}, "redis_url"),
                                     ({"redis_url": "redis+cluster://h:7000/1"}, "redis_url"),
                                     ({"redis_namespace": "{x}"}, "redis_namespace")])
def test_bad_redis_values_are_named(raw, key):
    with pytest.raises(ConfigError, match=key):
        parse_config({"sessionkv": raw})


@pytest.mark.parametrize("raw,key", [
    ({"early_decode_bind_host": "dhost"}, "early_decode_bind_host"),
    ({"advertise_url": "10.0.0.2:8000"}, "advertise_url"),
    ({"advertise_url": "http://:8000"}, "advertise_url")])
def test_bad_addresses_are_named(raw, key):
    with pytest.raises(ConfigError, match=key):
        parse_config({"sessionkv": raw})


def test_a_cluster_url_and_the_proxys_default_namespace_are_accepted():
    config = parse_config({"sessionkv": {"redis_url": "redis+cluster://10.0.0.9:7000"}})
    assert config.redis_namespace == "sessionkv"


def test_addresses_of_another_host_are_taken():
    cfg = parse_config({"sessionkv": {"early_decode_bind_host": "10.0.0.2",
                                      "advertise_url": "http://10.0.0.2:8000"}})
    assert cfg.early_decode_bind_host == "10.0.0.2"


@pytest.mark.parametrize("raw, key", [
    ({"session_lease_s": -1}, "session_lease_s"),
    ({"superseded_hold_grace_s": -0.5}, "superseded_hold_grace_s"),
    ({"expiry_margin_s": -10}, "expiry_margin_s"),
    ({"cost": {"per_transfer_s": -1e-3}}, "cost.per_transfer_s"),
    ({"cost": {"link_bytes_per_s": -1}}, "cost.link_bytes_per_s"),
])
def test_negative_values_are_refused_by_name(raw, key):
    with pytest.raises(ConfigError, match=rf"{key} must be >= 0"):
        parse_config({"sessionkv": raw})
    parse_config({"sessionkv": {"session_lease_s": 0}})   # zero is a value


def test_a_sessionkv_key_outside_sessionkv_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.session_lease_s is a "
                                          r"sessionkv key: put it under kv_connector_extra_"
                                          r"config\.sessionkv\.session_lease_s"):
        parse_config({"session_lease_s": 30, "sessionkv": {}})
    # stock NIXL keys stay where vLLM reads them
    assert parse_config({"backends": ["UCX"], "bidirectional_kv_xfer": True,
                         "sessionkv": {"session_lease_s": 30}}).session_lease_s == 30
