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
