"""Operator endpoints.

``POST /admin/reset[?timeout_s=S]`` drops every session, then resets every engine's
prefix cache, session holds included, and answers 200 only when every engine said it
succeeded, else 502 naming the engines that did not.

Sessions go first: the proxy's session records and the handles the engines published
to Redis name D's held blocks, which the reset frees for other requests; a handle
left behind would have the session's next P read whatever those blocks hold then
(the hash check covers what a handle claims, not what freed memory holds).  When the
handles cannot all be withdrawn (Redis unavailable), nothing is reset: 503.

Who may call it: clients on loopback, and anyone sending ``Authorization: Bearer
<admin_token>`` when the proxy's ``admin_token`` is set; others get a 403.

Each engine gets vLLM's ``POST /reset_prefix_cache?reset_external=true`` (vLLM serves
it with ``VLLM_SERVER_DEV_MODE=1``).  vLLM answers HTTP 200 either way and says in
the body, ``{"success": bool}``, whether the cache was reset; it is not while any
block is in use.  ``reset_external`` makes vLLM call the connector's ``reset_cache``,
which drops the engine's session holds; vLLM resets its block pool *before* it asks
the connector, and the released blocks are freed in the engine's next step, so the
call that drops holds answers false and the next one succeeds.  An engine that
answers false is asked again until ``timeout_s``: running requests, or a P's
hand-off to D not yet read, also keep blocks in use until they end.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import parse_qs

import aiohttp
import msgspec

from sessionkv_proxy.auth import bearer_matches
from sessionkv_proxy.errors import ApiError
from sessionkv_proxy.index.base import KVIndex
from sessionkv_proxy.index.redis import delete_matching
from sessionkv_proxy.redis_link import RedisLink, RedisUnavailable
from sessionkv_proxy.server import Request

__all__ = ["RESET_PATH", "RESET_TIMEOUT_S", "authorize", "reset_engines",
           "timeout_from_query", "withdraw_sessions"]

logger = logging.getLogger("sessionkv_proxy.admin")

RESET_PATH = "/reset_prefix_cache?reset_external=true"
# How long one engine may keep answering {"success": false} before the reset fails.
RESET_TIMEOUT_S = 10.0
_RETRY_S = 0.05
_MAX_TIMEOUT_S = 600.0


def _success_field(raw: bytes) -> bool | None:
    """The body's boolean ``success``, or None when there is none."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    value = body.get("success") if isinstance(body, dict) else None
    return value if isinstance(value, bool) else None


async def _reset_one(http: aiohttp.ClientSession, url: str, timeout_s: float
                     ) -> dict[str, Any]:
    started = time.monotonic()
    attempts = 0
    while True:
        attempts += 1
        try:
            async with http.post(url + RESET_PATH,
                                 timeout=aiohttp.ClientTimeout(total=max(timeout_s, 5.0))
                                 ) as resp:
                status, raw = resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return {"success": False, "attempts": attempts,
                    "error": f"unreachable: {exc!r}"}
        if status != 200:
            hint = " (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)" if status == 404 else ""
            return {"success": False, "attempts": attempts, "status": status,
                    "error": f"HTTP {status}{hint}: {raw[:200].decode(errors='replace')}"}
        success = _success_field(raw)
        if success is None:
            return {"success": False, "attempts": attempts, "status": status,
                    "error": f"no boolean 'success' in {raw[:200].decode(errors='replace')!r}"}
        elapsed_s = time.monotonic() - started
        if success:
            return {"success": True, "attempts": attempts, "seconds": round(elapsed_s, 3)}
        if elapsed_s >= timeout_s:
            return {"success": False, "attempts": attempts, "status": status,
                    "error": f"blocks still in use after {timeout_s:g} s (running "
                             "requests or unread hand-offs)"}
        await asyncio.sleep(_RETRY_S)


async def reset_engines(http: aiohttp.ClientSession, engines: Sequence[str],
                        timeout_s: float = RESET_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """Reset every engine (by URL), in parallel; (status, JSON body) with a result
    per engine."""
    results = await asyncio.gather(*(_reset_one(http, url, timeout_s) for url in engines))
    by_engine = dict(zip(engines, results))
    failed = [url for url, result in by_engine.items() if not result["success"]]
    if failed:
        logger.warning("admin reset failed on %s: %s", ", ".join(failed),
                       "; ".join(by_engine[url]["error"] for url in failed))
    else:
        logger.info("admin reset: %d engine(s) reset", len(engines))
    body = {"success": not failed, "failed": failed, "engines": by_engine}
    return (502 if failed else 200), body


def timeout_from_query(query: str) -> float:
    values = parse_qs(query).get("timeout_s")
    if not values:
        return RESET_TIMEOUT_S
    try:
        seconds = float(values[-1])
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= _MAX_TIMEOUT_S:
        raise ApiError(400, f"timeout_s must be a number within [0, {_MAX_TIMEOUT_S:g}]",
                       param="timeout_s")
    return seconds


def authorize(admin_token: str | None, request: Request) -> None:
    """Refuse (403) an admin call that is neither from loopback nor carries the
    configured admin token."""
    if admin_token is not None and bearer_matches(request.headers.get("authorization", ""),
                                                  admin_token):
        return
    try:
        if ipaddress.ip_address(request.peer_host or "").is_loopback:
            return
    except ValueError:
        pass
    raise ApiError(403, "admin endpoints answer loopback clients, or a bearer token "
                   "when admin_token is set", type_="permission_error")


async def withdraw_sessions(flush: Callable[[], Awaitable[None]], index: KVIndex,
                            redis: RedisLink | None, handles_pattern: str
                            ) -> dict[str, int]:
    """Drop the session records and the published handles (see the module doc).
    ``flush`` first: the writes behind earlier requests (records, handles given
    back) land, so that they are withdrawn too."""
    await flush()
    try:
        records = await index.clear_sessions()
        handles = 0
        if redis is not None:
            client = redis.client
            handles = await redis.call_long(
                "withdraw_handles", lambda: delete_matching(client, handles_pattern))
    except RedisUnavailable as exc:
        raise ApiError(503, f"sessions could not be withdrawn, nothing was reset: {exc}",
                       type_="server_error") from None
    logger.info("admin reset: dropped %d session records and %d published handles",
                records, handles)
    return {"session_records": records, "published_handles": handles}
