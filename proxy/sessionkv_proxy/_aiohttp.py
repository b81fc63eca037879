"""Every aiohttp internal the front door (``server.py``) and the upstream client
(``upstream.py``) rely on, checked at start-up.

Both use aiohttp below its public API: the front door subclasses
``web_protocol.RequestHandler`` (reads ``_messages`` and ``_manager``, overrides
``data_received``, ``connection_lost`` and ``handle_error``) and ``web.Server``
(builds its handlers from ``_loop`` and ``_kwargs``); the client drives
``client_proto.ResponseHandler`` directly (``set_response_params``,
``start_timeout``, ``read``) and overrides its read timeout and ``resume_reading``
(``upstream.py``'s ``_Connection``).  aiohttp may change any of these in a release, so
``check_installed()`` inspects them once per process, on real objects where that is
cheap, and stops the proxy naming each internal that differs, instead of failing on
the first request.  ``pyproject.toml`` pins the tested range (``TESTED``); a release
outside it only logs a warning while every internal still checks out.

One check per internal, each a function of a ``Surface`` (the classes the code
uses), so ``tests/proxy/test_aiohttp_internals.py`` feeds each a fake that lacks
what it checks.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["AiohttpInternalsChanged", "INTERNALS", "Surface", "TESTED", "check",
           "check_installed", "installed_surface"]

logger = logging.getLogger(__name__)

# The releases the front door and the client were tested with; pyproject.toml's proxy
# extra pins the same range.  3.14.4 has the fixes for GHSA-cq5v-8q36-5273 (C response
# parser), GHSA-mfx4-hv73-q22v, PYSEC-2026-4371 (smuggling), PYSEC-2026-4369 (scheme).
TESTED = ((3, 14, 4), (3, 15, 0))


class AiohttpInternalsChanged(RuntimeError):
    """An aiohttp internal the proxy relies on is not what it was tested with."""


@dataclass(frozen=True)
class Surface:
    """The aiohttp classes the proxy uses below the public API."""

    version: str
    RequestHandler: type
    Server: type
    RawRequestMessage: type
    ResponseHandler: type
    RawResponseMessage: type
    StreamReader: type


def installed_surface() -> Surface:
    import aiohttp
    from aiohttp import web_protocol, web_server
    from aiohttp.client_proto import ResponseHandler
    from aiohttp.http_parser import RawRequestMessage, RawResponseMessage
    from aiohttp.streams import StreamReader

    return Surface(version=aiohttp.__version__, RequestHandler=web_protocol.RequestHandler,
                   Server=web_server.Server, RawRequestMessage=RawRequestMessage,
                   ResponseHandler=ResponseHandler, RawResponseMessage=RawResponseMessage,
                   StreamReader=StreamReader)


def _params(func: Callable) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(func).parameters)


def _lacks(func: Callable, names: tuple[str, ...]) -> list[str]:
    """The parameters ``func`` cannot take by these names (none when it passes
    ``*args, **kwargs`` through: the probes then call it)."""
    params = _params(func)
    kinds = {p.kind for p in params.values()}
    if inspect.Parameter.VAR_KEYWORD in kinds and inspect.Parameter.VAR_POSITIONAL in kinds:
        return []
    return [n for n in names if n not in params]


def _with_loop(probe: Callable[[asyncio.AbstractEventLoop], str | None]) -> str | None:
    loop = asyncio.new_event_loop()
    try:
        return probe(loop)
    finally:
        loop.close()


# server.py's _Server.__init__ passes these to web.Server, which hands them to each
# RequestHandler.
_SERVER_KWARGS = {"keepalive_timeout": 75.0, "max_line_size": 8190, "max_field_size": 8190,
                  "max_headers": 128, "lingering_time": 10.0, "access_log": None}


def _server_kwargs_and_loop(s: Surface) -> str | None:
    """web.Server keeps ``_loop`` and ``_kwargs``: server.py's _Server.__call__ builds
    its own handler from them."""
    def probe(loop):
        server = s.Server(lambda request: None, loop=loop, **_SERVER_KWARGS)
        if getattr(server, "_loop", None) is not loop:
            return "Server._loop is not the loop it was given"
        if getattr(server, "_kwargs", None) != _SERVER_KWARGS:
            return "Server._kwargs does not hold the handler keywords it was given"
        if _lacks(s.Server.shutdown, ("timeout",)):
            return "Server.shutdown takes no timeout"
        return None
    return _with_loop(probe)


def _request_handler_init(s: Surface) -> str | None:
    """RequestHandler(manager, loop=..., **limits): how _Server.__call__ builds it."""
    missing = _lacks(s.RequestHandler.__init__, ("manager", "loop"))
    if missing:
        return f"RequestHandler.__init__ takes no {', '.join(missing)}"
    def probe(loop):
        server = s.Server(lambda request: None, loop=loop)
        handler = s.RequestHandler(server, loop=loop, **_SERVER_KWARGS)
        if getattr(handler, "_manager", None) is not server:
            return "RequestHandler._manager is not the Server that made it"
        return None
    return _with_loop(probe)


def _request_handler_messages(s: Surface) -> str | None:
    """RequestHandler._messages: the deque of parsed (message, payload) pairs that
    _Protocol.data_received inspects (head deadline, pause after a parse error)."""
    def probe(loop):
        handler = s.RequestHandler(s.Server(lambda request: None, loop=loop), loop=loop)
        messages = getattr(handler, "_messages", None)
        if not isinstance(messages, collections.deque):
            return f"RequestHandler._messages is {type(messages).__name__}, not a deque"
        return None
    return _with_loop(probe)


def _request_handler_hooks(s: Surface) -> str | None:
    """The methods _Protocol overrides and calls: data_received, connection_lost,
    force_close, handle_error(request, status, exc, message), and its transport."""
    for name in ("data_received", "connection_lost", "force_close", "handle_error"):
        if not callable(getattr(s.RequestHandler, name, None)):
            return f"RequestHandler.{name} is gone"
    missing = _lacks(s.RequestHandler.handle_error, ("request", "status", "exc", "message"))
    if missing:
        return f"RequestHandler.handle_error takes no {', '.join(missing)}"
    if not hasattr(s.RequestHandler, "transport"):
        return "RequestHandler.transport is gone"
    return None


def _raw_request_message(s: Surface) -> str | None:
    """RawRequestMessage: the type data_received tells a parsed head by."""
    # (With aiohttp's C extension it is the C parser's class, not the named tuple.)
    missing = [n for n in ("method", "path", "headers")
               if not hasattr(s.RawRequestMessage, n)]
    if not isinstance(s.RawRequestMessage, type) or missing:
        return f"RawRequestMessage is not a message type with {', '.join(missing)}"
    return None


def _response_handler(s: Surface) -> str | None:
    """client_proto.ResponseHandler(loop) with set_response_params(read_timeout,
    auto_decompress), start_timeout(), read() -> (message, payload), should_close,
    is_connected(), close(): upstream.py's whole connection."""
    if _lacks(s.ResponseHandler.__init__, ("loop",)):
        return "ResponseHandler.__init__ takes no loop"
    missing = _lacks(s.ResponseHandler.set_response_params, ("read_timeout", "auto_decompress"))
    if missing:
        return f"ResponseHandler.set_response_params takes no {', '.join(missing)}"
    for name in ("start_timeout", "is_connected", "close"):
        if not callable(getattr(s.ResponseHandler, name, None)):
            return f"ResponseHandler.{name} is gone"
    if not inspect.iscoroutinefunction(getattr(s.ResponseHandler, "read", None)):
        return "ResponseHandler.read is not a coroutine function"
    def probe(loop):
        handler = s.ResponseHandler(loop)
        if not isinstance(getattr(handler, "should_close", None), bool):
            return "ResponseHandler.should_close is not a bool"
        return None
    return _with_loop(probe)


def _response_handler_per_read(s: Surface) -> str | None:
    """What upstream.py's ``_Connection`` overrides to take per-read costs off a
    stream: ``data_received`` restarting the read timeout through
    ``_reschedule_timeout`` (``_read_timeout``, ``_read_timeout_handle``,
    ``_drop_timeout``, ``_on_read_timeout``, ``_loop``), and
    ``resume_reading(resume_parser)`` with the pause flags ``_reading_paused`` and
    ``_buffer_paused``."""
    for name in ("_reschedule_timeout", "_drop_timeout", "_on_read_timeout"):
        if not callable(getattr(s.ResponseHandler, name, None)):
            return f"ResponseHandler.{name} is gone"
    try:
        source = inspect.getsource(s.ResponseHandler.data_received)
    except (OSError, TypeError):
        source = ""
    if "_reschedule_timeout" not in source:
        return "ResponseHandler.data_received does not call _reschedule_timeout"
    if _lacks(s.ResponseHandler.resume_reading, ("resume_parser",)):
        return "ResponseHandler.resume_reading takes no resume_parser"

    def probe(loop):
        handler = s.ResponseHandler(loop)
        handler.set_response_params(read_timeout=1.0, auto_decompress=False)
        missing = [n for n in ("_read_timeout", "_read_timeout_handle", "_loop",
                               "_reading_paused", "_buffer_paused")
                   if not hasattr(handler, n)]
        if missing:
            return f"ResponseHandler has no {', '.join(missing)}"
        if handler._read_timeout != 1.0 or handler._loop is not loop:
            return "ResponseHandler._read_timeout or _loop is not what it was given"
        return None
    return _with_loop(probe)


def _raw_response_message(s: Surface) -> str | None:
    """RawResponseMessage.code and .headers: the status and headers upstream.py relays."""
    missing = [n for n in ("code", "headers") if not hasattr(s.RawResponseMessage, n)]
    if missing:
        return f"RawResponseMessage has no {', '.join(missing)}"
    return None


def _stream_reader(s: Surface) -> str | None:
    """StreamReader.readchunk(), read(), at_eof(): how a response body is relayed."""
    if not inspect.iscoroutinefunction(getattr(s.StreamReader, "readchunk", None)):
        return "StreamReader.readchunk is not a coroutine function"
    for name in ("read", "at_eof"):
        if not callable(getattr(s.StreamReader, name, None)):
            return f"StreamReader.{name} is gone"
    return None


INTERNALS: dict[str, Callable[[Surface], str | None]] = {
    "web_server.Server._loop/_kwargs": _server_kwargs_and_loop,
    "web_protocol.RequestHandler.__init__/_manager": _request_handler_init,
    "web_protocol.RequestHandler._messages": _request_handler_messages,
    "web_protocol.RequestHandler hooks": _request_handler_hooks,
    "http_parser.RawRequestMessage": _raw_request_message,
    "client_proto.ResponseHandler": _response_handler,
    "client_proto.ResponseHandler per-read hooks": _response_handler_per_read,
    "http_parser.RawResponseMessage": _raw_response_message,
    "streams.StreamReader": _stream_reader,
}


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check(surface: Surface) -> list[str]:
    """Each internal that differs, as "name: what differs" (empty: all as tested)."""
    problems = []
    for name, probe in INTERNALS.items():
        try:
            problem = probe(surface)
        except Exception as exc:  # a changed constructor, a property that raises
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            problems.append(f"{name}: {problem}")
    return problems


@functools.cache
def check_installed() -> None:
    """Raise ``AiohttpInternalsChanged`` naming every internal the installed aiohttp
    changed; warn when its release is outside ``TESTED``.  Once per process."""
    surface = installed_surface()
    problems = check(surface)
    if problems:
        raise AiohttpInternalsChanged(
            f"aiohttp {surface.version} differs from what sessionkv-proxy was tested with "
            f"(>={'.'.join(map(str, TESTED[0]))},<{'.'.join(map(str, TESTED[1][:2]))}): "
            + "; ".join(problems))
    low, high = TESTED
    if not low <= _version_tuple(surface.version) < high:
        logger.warning("aiohttp %s is outside the tested range %s - %s; every internal "
                       "the proxy uses checked out", surface.version, low, high)

