"""The installed vLLM: the releases this package was tested against, and the platform."""

from __future__ import annotations

import logging

from vllm.platforms import current_platform

__all__ = [
    "UntestedVllmVersion",
    "VLLM_VERSIONS_TESTED",
    "VLLM_VERSION_TESTED",
    "check_vllm_version",
    "is_cpu_platform",
    "vllm_version",
]

logger = logging.getLogger("vllm.sessionkv")

VLLM_VERSION_TESTED = "0.32.0"


def is_cpu_platform() -> bool:
    return current_platform.device_type == "cpu"


# The vLLM releases this package's private accesses were written and tested against
# (the adapter tests in tests/engine check each).  A local build suffix ("+cpu") is
# ignored.  VLLM_VERSION_TESTED above is the first of them.
VLLM_VERSIONS_TESTED = (VLLM_VERSION_TESTED,)


class UntestedVllmVersion(RuntimeError):
    """The installed vLLM is not one this connector was tested against."""


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_vllm_version(allow_untested: bool, version: str | None = None) -> None:
    """Log the installed vLLM against the tested releases; refuse an untested one
    unless ``allow_untested`` (the ``allow_untested_vllm`` config key).

    Every private attribute this package touches was checked against the tested
    releases only: under another, the likeliest failure is not an error at start but a
    request that hangs or loads the wrong blocks."""
    version = vllm_version() if version is None else version
    base = version.split("+", 1)[0]
    tested = ", ".join(VLLM_VERSIONS_TESTED)
    if base in VLLM_VERSIONS_TESTED:
        logger.info("sessionkv: vLLM %s (tested: %s)", version, tested)
        return
    if not allow_untested:
        raise UntestedVllmVersion(
            f"SessionKVConnector was tested with vLLM {tested}, not {version}: it relies "
            "on vLLM internals that change between releases.  Install a tested vLLM, or "
            "set allow_untested_vllm: true under kv_connector_extra_config.sessionkv to "
            "start anyway.")
    logger.warning("sessionkv: vLLM %s is not a tested release (tested: %s); starting "
                   "because allow_untested_vllm is set", version, tested)
