"""Whether a session's handle would expire in P's queue (issue 47): pure, on plain data.

A handle lets P pull the session's earlier turns from the D that holds them, but P
checks the handle only when its scheduler takes the request up, after the work
queued before it, and refuses one then within ``expiry_margin_s`` of its end
(``protocol.handle_expired``, as vLLM's NIXL reader does): it recomputes the whole
history instead.  :func:`handle_expires_in_queue` compares what is left of the
handle with the wait the proxy expects in the chosen P's queue, and
:func:`expiry_route` says what to do then: the session's D serves the turn alone, or
P recomputes it without the handle (``policy.route`` applies it; docs/routing.md).
"""

from __future__ import annotations

import msgspec

from sessionkv_proxy.prices import recompute_price
from sessionkv_proxy.route_types import DecodeTerms, PrefillTerms, RouteInput, RoutingParams
from vllm_sessionkv.wire.cost import RecomputeModel

__all__ = ["QueueExpiry", "expiry_route", "handle_expires_in_queue", "prefill_queue_wait_s"]


class QueueExpiry(msgspec.Struct, frozen=True, kw_only=True):
    """A handle that would expire before P starts the request, with the figures."""

    left_s: float  # the handle's life past the engines' margin, now
    queued_s: float  # the wait expected in P's queue

    def __str__(self) -> str:
        return (f"handle would expire in P's queue ({self.left_s:.1f} s left, "
                f"~{self.queued_s:.1f} s queued)")


def prefill_queue_wait_s(queued_prefill_blocks: float, block_size: int,
                         recompute: RecomputeModel) -> float:
    """The wait before P starts a request routed to it now: P's queued prompt compute
    (``PrefillTerms.queued_prefill_blocks``, the proxy's count of what it routed
    there and has not seen answered) at ``recompute``: P's own calibrated price, or
    the configured one (``prices.recompute_price``).

    Only the price per token on an idle engine: the queued requests' contexts (the
    attention term) and the engine's load are unknown here, so this is a lower bound,
    and the rule errs towards sending the handle, as before it."""
    return max(0.0, queued_prefill_blocks) * block_size * recompute.s_per_token


def handle_expires_in_queue(inp: RouteInput, prefill: PrefillTerms,
                            params: RoutingParams) -> QueueExpiry | None:
    """The figures when the session's handle (``SessionView.expires_at_s``) has less
    life left past the engines' margin (``handle_expiry_margin_s``) than the wait in
    ``prefill``'s queue (:func:`prefill_queue_wait_s`), so that P would refuse it as
    ``expired_handle`` when it takes the request up; None when it outlives the wait,
    or no handle with a known end goes with the request.  An idle P waits 0 s, and
    the router never offers a handle already inside the margin."""
    session = inp.session
    if session is None or session.expires_at_s is None:
        return None
    left_s = session.expires_at_s - inp.now_s - params.handle_expiry_margin_s
    queued_s = prefill_queue_wait_s(prefill.queued_prefill_blocks, inp.block_size,
                                    recompute_price(params, prefill.recompute_s_per_token))
    if queued_s <= left_s:
        return None
    return QueueExpiry(left_s=left_s, queued_s=queued_s)


def expiry_route(expiry: QueueExpiry | None, decode: DecodeTerms, room: tuple[bool, str],
                 params: RoutingParams) -> tuple[bool, str]:
    """(D alone, the route reason's words) for a turn whose handle would expire in
    P's queue (``expiry``; ``(False, "")`` when it would not).

    D serves the turn alone when ``decode`` is the session's D, which holds the
    history (it computes only the new tokens), decode only is not off
    (``decode_only_max_uncached_tokens: -1``) and D has room by the decode-only room
    rules (``room``: ``policy._room``'s answer for ``decode``, with its figure).
    Otherwise P recomputes the turn without the handle, which it would refuse anyway;
    the words say why not D.  Nothing here claims D would refuse the handle: only
    that P would, by the time it takes the request up."""
    if expiry is None:
        return False, ""
    has_room, figure = room
    if not decode.affinity:
        refused = "the session's D was not chosen"
    elif params.decode_only_max_uncached_tokens < 0:
        refused = "decode only is off"
    elif not has_room:
        refused = f"D has no room ({figure})"
    else:
        return True, f"{expiry}; D holds the session's KV{f', {figure}' if figure else ''}"
    return False, f"P without the handle: {expiry}, {refused}"
