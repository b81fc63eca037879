"""The installed vLLM: the releases this package was tested against, and the platform."""

from __future__ import annotations

import logging

from vllm.platforms import current_platform

__all__ = [
    "UntestedVllmVersion",
    "VLLM_VERSIONS_SURFACE_CHECKED",
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

# Releases whose wheel was only read, not run: their surface snapshot
# (``surfaces/vllm-X.json``) was compared with the tested release's, and what differs
# is named when the engine refuses them.  vLLM 0.33.0: every name, signature and
# private attribute our code touches is still there with the same parameters, but the
# code of four NIXL methods we override and five we patch or call changed, our
# subclasses would inherit new sleep-mode hooks, and BlockStored gained a trailing
# field (docs/vllm_0.33_surface.md).  None of it was run here.
VLLM_VERSIONS_SURFACE_CHECKED = ("0.33.0",)


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
    checked = ""
    if base in VLLM_VERSIONS_SURFACE_CHECKED:
        from vllm_sessionkv._vllm import surfaces

        found = surfaces.differences(VLLM_VERSION_TESTED, base)
        checked = (f"  vLLM {base}'s wheel was only read, never run with this connector: "
                   f"the names and signatures it touches differ from {VLLM_VERSION_TESTED} "
                   f"in: {'; '.join(found) or 'nothing'}; what changed behind them "
                   "is unchecked.")
    if not allow_untested:
        raise UntestedVllmVersion(
            f"SessionKVConnector was tested with vLLM {tested}, not {version}: it relies "
            f"on vLLM internals that change between releases.{checked}  Install a tested "
            "vLLM, or set allow_untested_vllm: true under "
            "kv_connector_extra_config.sessionkv to start anyway.")
    logger.warning("sessionkv: vLLM %s is not a tested release (tested: %s); starting "
                   "because allow_untested_vllm is set", version, tested)
