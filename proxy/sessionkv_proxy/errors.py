"""OpenAI-style error responses."""

from __future__ import annotations

import msgspec

from sessionkv_proxy.server import Response

__all__ = ["ApiError", "error_response"]

_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    """An error the client caused or should see, with its HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code


def error_response(err: ApiError) -> Response:
    body = {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}
    return Response(err.status, _encoder.encode(body))
