"""The proxy's dependability settings are validated at start-up, naming the bad key;
session keys keep tenants apart."""

from __future__ import annotations

import pytest

from vllm_sessionkv.wire.protocol import session_store_key

from sessionkv_proxy.config import ConfigError, load_config

ENGINES = [{"url": "http://127.0.0.1:1", "role": "decode"}]


def _load(**raw):
    return load_config(None, {"engines": ENGINES, **raw})


def test_defaults_make_redis_an_accelerator_and_name_common_session_headers():
    cfg = _load()
    assert cfg.session_headers == ["X-Session-ID", "X-Session-Affinity"]
    assert cfg.engine_stall_s > 0 and not cfg.return_kv_transfer_params
    assert 0 < cfg.index.redis_timeout_s <= 1.0
    assert cfg.index.redis_max_connections >= 100
    cluster = _load(index={"backend": "redis", "redis_url": "redis+cluster://10.0.0.9:7000"})
    assert cluster.index.redis_namespace == "sessionkv"   # the engines' default too


@pytest.mark.parametrize("raw, key", [
    ({"index": {"redis_timeout_s": 0}}, "redis_timeout_s"),
    ({"index": {"redis_retry_interval_s": -1}}, "redis_retry_interval_s"),
    ({"index": {"redis_failures_to_open": 0}}, "redis_failures_to_open"),
    ({"index": {"redis_max_connections": 0}}, "redis_max_connections"),
    ({"engine_stall_s": -1}, "engine_stall_s"),
    ({"session_headers": ["X-Session-ID", "bad header"]}, "session_headers"),
    ({"session_headers": [""]}, "session_headers"),
    ({"return_kv_transfer_params": "maybe"}, "return_kv_transfer_params"),
    ({"index": {"backend": "redis", "redis_url": "http://10.0.0.9:6379"}}, "redis_url"),
    ({"index": {"backend": "redis", "redis_url": "redis+cluster://10.0.0.9:6379/2"}},
     "redis_url"),
    ({"index": {"backend": "redis", "redis_url": "redis+cluster:///tmp/redis.sock"}},
     "redis_url"),
    ({"index": {"redis_namespace": "a{b}"}}, "redis_namespace"),
    ({"index": {"redis_namespace": ""}}, "redis_namespace"),
    ({"request_timeout_s": -1}, "request_timeout_s"),
    ({"session_ttl_s": -60}, "session_ttl_s"),
    ({"log_level": "FOO"}, "log_level"),
    ({"block_size": 24}, "block_size"),
])
def test_bad_values_are_refused_naming_the_key(raw, key):
    with pytest.raises(ConfigError, match=key):
        _load(**raw)


@pytest.mark.parametrize("field", ["events", "replay", "early"])
def test_a_wildcard_engine_endpoint_is_refused_naming_the_key(field):
    """The engine binds tcp://*:PORT; the proxy connects, so it needs the host."""
    names = {"events": "kv_events", "replay": "kv_events_replay", "early": "early_decode"}
    engine = {"url": "http://10.0.0.3:8000", "role": "decode", names[field]: "tcp://*:5600"}
    with pytest.raises(ConfigError, match=names[field]):
        load_config(None, {"engines": [engine]})


def test_session_keys_differ_by_tenant_and_cannot_be_forged_by_a_session_id():
    plain = session_store_key("s1", None)
    a, b = session_store_key("s1", "tenant-a"), session_store_key("s1", "tenant-b")
    assert len({plain, a, b}) == 3
    assert session_store_key("s1", "tenant-a") == a          # stable
    # No session id without a tenant reproduces a tenant's key, and the tenant is not
    # stored in clear.
    tag = a.split(":", 1)[0]
    assert session_store_key(f"{tag}:s1", None) != a and "tenant-a" not in a
    assert session_store_key("s1", "") != plain


@pytest.mark.parametrize("argv, key", [
    (["--log-level", "FOO"], "log_level"),
    (["--block-size", "-32"], "block_size"),
    (["--decode", "url=http://127.0.0.1:1,evnts=tcp://127.0.0.1:2"], "evnts"),
])
def test_the_command_line_exits_2_naming_a_bad_value(argv, key, capsys):
    from sessionkv_proxy.__main__ import main

    assert main(["--decode", "http://127.0.0.1:1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sessionkv-proxy: ") and key in err and "Traceback" not in err
