"""The start-up check of the aiohttp internals the front door and the client use.

The installed aiohttp passes.  For each internal, a fake aiohttp that differs in that
one place (a subclass of the real class, changed as a release might change it) fails
the check naming that internal and only it; the start-up path refuses to run on it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
from aiohttp import web_protocol, web_server
from aiohttp.client_proto import ResponseHandler
from aiohttp.streams import StreamReader

from sessionkv_proxy import _aiohttp
from sessionkv_proxy.__main__ import main


class ServerWithoutKwargs(web_server.Server):
    def __init__(self, handler, *, loop=None, **kwargs):
        super().__init__(handler, loop=loop)   # keeps the handler keywords elsewhere
        self.handler_kwargs = kwargs


class HandlerWithoutLoop(web_protocol.RequestHandler):
    def __init__(self, manager, *, event_loop, **kwargs):  # loop renamed
        super().__init__(manager, loop=event_loop, **kwargs)


class HandlerWithListMessages(web_protocol.RequestHandler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._messages = []


class HandlerWithOldHandleError(web_protocol.RequestHandler):
    def handle_error(self, request, status=500, exc=None):  # no message
        return super().handle_error(request, status, exc)


class RequestMessageWithoutMethod(NamedTuple):
    verb: str
    path: str
    headers: dict


class ClientWithoutAutoDecompress(ResponseHandler):
    def set_response_params(self, *, read_timeout=None, decompress=True):
        super().set_response_params(read_timeout=read_timeout)


class ClientWithRenamedTimeoutHandle(ResponseHandler):
    def __init__(self, loop):
        super().__init__(loop)
        self._read_timeout_timer = self._read_timeout_handle   # renamed
        del self._read_timeout_handle


class ResponseMessageWithStatus(NamedTuple):
    status: int
    headers: dict


class ReaderWithoutReadchunk:
    read = StreamReader.read
    at_eof = StreamReader.at_eof
    iter_chunks = StreamReader.iter_chunks


FAKES = {
    "web_server.Server._loop/_kwargs": ("Server", ServerWithoutKwargs),
    "web_protocol.RequestHandler.__init__/_manager": ("RequestHandler", HandlerWithoutLoop),
    "web_protocol.RequestHandler._messages": ("RequestHandler", HandlerWithListMessages),
    "web_protocol.RequestHandler hooks": ("RequestHandler", HandlerWithOldHandleError),
    "http_parser.RawRequestMessage": ("RawRequestMessage", RequestMessageWithoutMethod),
    "client_proto.ResponseHandler": ("ResponseHandler", ClientWithoutAutoDecompress),
    "client_proto.ResponseHandler per-read hooks": ("ResponseHandler",
                                                    ClientWithRenamedTimeoutHandle),
    "http_parser.RawResponseMessage": ("RawResponseMessage", ResponseMessageWithStatus),
    "streams.StreamReader": ("StreamReader", ReaderWithoutReadchunk),
}


def test_the_installed_aiohttp_passes_and_is_in_the_tested_range():
    surface = _aiohttp.installed_surface()
    assert _aiohttp.check(surface) == []
    low, high = _aiohttp.TESTED
    assert low <= _aiohttp._version_tuple(surface.version) < high


def test_every_internal_has_a_fake():
    assert set(FAKES) == set(_aiohttp.INTERNALS)


@pytest.mark.parametrize("internal", sorted(FAKES))
def test_a_changed_internal_fails_the_check_by_name(internal):
    field, fake = FAKES[internal]
    surface = dataclasses.replace(_aiohttp.installed_surface(), **{field: fake})
    problems = _aiohttp.check(surface)
    # (a changed constructor also fails the checks that build the class: named first)
    assert problems and problems[0].startswith(internal + ": "), problems


def test_start_up_refuses_a_changed_aiohttp(monkeypatch, capsys):
    surface = dataclasses.replace(_aiohttp.installed_surface(), version="3.16.0",
                                  RequestHandler=HandlerWithListMessages)
    monkeypatch.setattr(_aiohttp, "installed_surface", lambda: surface)
    _aiohttp.check_installed.cache_clear()
    try:
        with pytest.raises(_aiohttp.AiohttpInternalsChanged,
                           match=r"aiohttp 3\.16\.0 .*RequestHandler\._messages: "
                                 "RequestHandler._messages is list, not a deque"):
            _aiohttp.check_installed()
        assert main(["--decode", "http://127.0.0.1:9"]) == 1
        assert "RequestHandler._messages" in capsys.readouterr().err
    finally:
        _aiohttp.check_installed.cache_clear()


def test_a_release_outside_the_range_only_warns(monkeypatch, caplog):
    surface = dataclasses.replace(_aiohttp.installed_surface(), version="3.15.0")
    monkeypatch.setattr(_aiohttp, "installed_surface", lambda: surface)
    _aiohttp.check_installed.cache_clear()
    try:
        _aiohttp.check_installed()
    finally:
        _aiohttp.check_installed.cache_clear()
    assert "aiohttp 3.15.0 is outside the tested range" in caplog.text
