"""The recompute price the router puts on a P's work: pure.

Each connector engine calibrates its own price per new token from its prefill steps
and exports it (``sessionkv_recompute_seconds_per_token``; the connector's
``pricing.py``).  The proxy's ``routing.params.recompute`` defaults to the
connector's built-in prior, sized for the tiny test model, which on a real model is
off by orders of magnitude.  So where the operator did not configure ``recompute``
(``RoutingParams.recompute_from_engines``), a P's own reported price stands in for
``s_per_token``; a configured price is an override, as in the connector.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from sessionkv_proxy.route_types import RoutingParams
from vllm_sessionkv.wire.cost import RecomputeModel

__all__ = ["recompute_price", "routing_params_from_config"]


def recompute_price(params: RoutingParams, reported_s_per_token: float | None
                    ) -> RecomputeModel:
    """``params.recompute`` with ``s_per_token`` the engine's reported price when the
    router takes prices from the engines and the engine reported a positive one."""
    if (not params.recompute_from_engines or reported_s_per_token is None
            or not reported_s_per_token > 0):
        return params.recompute
    return msgspec.structs.replace(params.recompute, s_per_token=reported_s_per_token)


def routing_params_from_config(raw: Mapping[str, Any]) -> RoutingParams:
    """``RoutingParams`` from the proxy config; the connector's cost defaults where
    ``recompute`` and ``link`` are unset, and a configured ``recompute`` rules over
    the engines' prices unless ``recompute_from_engines`` says otherwise.
    ``kv_bytes_per_token`` is a request-level input, not a policy parameter, and is
    skipped here."""
    from vllm_sessionkv.wire.cost import DEFAULT_LINK, DEFAULT_RECOMPUTE

    values = {k: v for k, v in raw.items() if k != "kv_bytes_per_token"}
    if "recompute" in values:
        values.setdefault("recompute_from_engines", False)
    values.setdefault("recompute", msgspec.to_builtins(DEFAULT_RECOMPUTE))
    values.setdefault("link", msgspec.to_builtins(DEFAULT_LINK))
    try:
        return msgspec.convert(values, RoutingParams)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"invalid routing.params: {exc}") from None
