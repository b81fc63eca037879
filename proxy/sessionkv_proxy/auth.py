"""The front door's API key: ``Authorization: Bearer <api_key>`` on the routes that
serve the model or describe the deployment.

With the config's ``api_key`` (or ``SESSIONKV_PROXY_API_KEY``) set, the generation
endpoints, ``/v1/models``, ``/tokenize``, ``/detokenize`` and ``/metrics`` answer a
request without the key with a 401 in OpenAI's error shape (``WWW-Authenticate:
Bearer``), counted in ``sessionkv_proxy_unauthorized_requests{endpoint}``.  ``/health``
stays open for load balancers' and Kubernetes' probes; ``/admin/*`` keeps its own
rule (loopback, or ``admin_token``: :func:`sessionkv_proxy.admin.authorize`).  The
key is compared in constant time (over SHA-256 digests, so the time does not depend
on where the strings differ nor on their lengths).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable

from sessionkv_proxy.errors import ApiError, error_response
from sessionkv_proxy.server import Request, Response

__all__ = ["OPEN_PATHS", "bearer_matches", "requiring_key"]

# Routes that never ask for the API key (``/admin/*`` has its own rule).
OPEN_PATHS = ("/health",)


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (the scheme in
    any case, as RFC 6750 allows), compared in constant time."""
    scheme, _, sent = authorization.partition(" ")
    return hmac.compare_digest(_digest(sent.strip()), _digest(key)) \
        and scheme.lower() == "bearer"


def requiring_key(handler: Callable[[Request], Awaitable[Response | None]], key: str,
                  on_refused: Callable[[str], None]
                  ) -> Callable[[Request], Awaitable[Response | None]]:
    """``handler`` behind the key; ``on_refused(path)`` counts each 401."""
    async def authorized(request: Request) -> Response | None:
        if bearer_matches(request.headers.get("authorization", ""), key):
            return await handler(request)
        on_refused(request.path)
        response = error_response(ApiError(
            401, "missing or wrong API key: send Authorization: Bearer <key>",
            type_="invalid_request_error", code="invalid_api_key"))
        response.headers.append(("WWW-Authenticate", "Bearer"))
        return response
    return authorized
