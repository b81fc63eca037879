"""The vLLM releases the connector was tested with (``_vllm/version.py``).

The private vLLM 0.32 surface checked by name, and the patch or accessor checked on
vLLM's own objects.  With vLLM installed these tests fail, never skip: an ImportError
here is the likeliest sign of a vLLM upgrade.
"""

from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import version  # noqa: E402


def test_pinned_version_is_installed():
    import vllm

    assert vllm.__version__.startswith(version.VLLM_VERSION_TESTED)


def test_the_tested_vllm_starts_and_an_untested_one_is_refused(caplog):
    caplog.set_level(logging.INFO, logger="vllm.sessionkv")
    version.check_vllm_version(False)              # the installed one, pinned above
    version.check_vllm_version(False, "0.32.0+cpu")
    for release in ("0.33.0", "0.32.1", "0.31.9"):
        with pytest.raises(version.UntestedVllmVersion, match="allow_untested_vllm"):
            version.check_vllm_version(False, release)
    version.check_vllm_version(True, "0.33.0")     # the override starts, with a warning
    assert any(r.levelno == logging.WARNING and "0.33.0" in r.getMessage()
               for r in caplog.records)


def test_the_engine_refuses_an_untested_vllm_without_the_override(monkeypatch):
    """SessionKVConnector checks the version first thing, before it sets anything up."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_sessionkv.connector import SessionKVConnector

    monkeypatch.setattr(version, "vllm_version", lambda: "0.99.0")

    def engine(extra):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=extra))

    with pytest.raises(version.UntestedVllmVersion, match="0.99.0"):
        SessionKVConnector(engine({}), KVConnectorRole.SCHEDULER, None)
    # With the override the version check passes; the fake config then fails further on.
    with pytest.raises(AttributeError, match="parallel_config"):
        SessionKVConnector(engine({"sessionkv": {"allow_untested_vllm": True}}),
                           KVConnectorRole.SCHEDULER, None)


def test_a_surface_checked_release_is_refused_naming_what_differs():
    with pytest.raises(version.UntestedVllmVersion) as refused:
        version.check_vllm_version(False, "0.33.0")
    message = str(refused.value)
    assert "0.33.0's wheel was only read, never run" in message
    assert "kv_event_fields BlockStored: added lookahead_token_ids" in message
    assert "NixlPullConnectorScheduler.request_finished: code changed" in message
    with pytest.raises(version.UntestedVllmVersion) as refused:
        version.check_vllm_version(False, "0.34.0")   # no snapshot: the plain refusal
    assert "only read" not in str(refused.value)
