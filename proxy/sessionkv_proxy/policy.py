"""Pure routing policy: which prefill (P) and decode (D) worker serve a request.

Each pool goes through the same three steps as Dynamo's selector: **filter**
(unhealthy workers out; :class:`NoWorkerAvailable` if none is left), **score** (one
terms struct per candidate, every number the cost came from), **pick** (argmin, ties
and ``temperature > 0`` drawn from the caller's RNG).  :func:`route` returns a
:class:`RouteDecision` that carries those terms, so the caller logs one structured
line per decision.  No clock, I/O, globals or hidden randomness: time is
``RouteInput.now_s`` and randomness is the ``rng`` argument.

The cost model (P's linear cost with its overlap credit and hot-spot decay, D's
cost with its placement surcharge), session and prefix affinity, conditional
disaggregation and prefill-only requests are explained, with the measurements that
set their defaults, in ``docs/routing.md``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import msgspec

from sessionkv_proxy.index.base import TIER_DEVICE, TIER_HOST, TIER_STORAGE, PrefixMatch
from sessionkv_proxy.queue_expiry import expiry_route, handle_expires_in_queue
from sessionkv_proxy.route_types import (
    DecodeTerms,
    Mode,
    NoWorkerAvailable,
    PrefillTerms,
    Role,
    RouteDecision,
    RouteInput,
    RouteReason,
    RoutingParams,
    SessionView,
    Tier,
    TierOverlap,
    WorkerLoad,
)
from vllm_sessionkv.wire.cost import (
    PullQuote,
    decide_restore_for_pull,
    overlap_credit_blocks,
    peer_credit_weight,
)
from vllm_sessionkv.wire.protocol import handle_expired

# The structs and enums it decides on are ``route_types``' (imported above, and
# reachable from here as before).
__all__ = [
    "healthy_workers",
    "net_kv_usage",
    "overlaps_from_match",
    "pick",
    "route",
    "score_decode",
    "score_prefill",
]

# Costs closer than this (relative) count as equal, so float noise cannot break a tie.
_TIE_RTOL = 1e-9


# --------------------------------------------------------------------------- filter


def healthy_workers(workers: Sequence[WorkerLoad], role: Role) -> list[WorkerLoad]:
    """The healthy workers of ``role``; raises :class:`NoWorkerAvailable` if none."""
    kept = [w for w in workers if w.role is role and w.healthy]
    if not kept:
        raise NoWorkerAvailable(role)
    return kept


def net_kv_usage(w: WorkerLoad) -> float:
    """The KV usage the pressure and decode-only room checks read: vLLM's
    ``kv_usage`` less ``kv_reclaimable``, the share only session holds keep (D ends
    them for a request it cannot admit), floored at 0.  vLLM counts held blocks as
    used, so without this a D full only of holds looks full, loses its sessions and
    refuses the turns it would serve alone.  Equal to ``kv_usage`` for an engine
    that does not report its holds (``kv_reclaimable`` 0)."""
    return max(0.0, w.kv_usage - w.kv_reclaimable)


def _kv_figure(t: DecodeTerms) -> str:
    """The usage a check read, for a route reason: net of the holds where there are
    any."""
    if t.kv_reclaimable <= 0:
        return f"kv usage {t.kv_usage:.2f}"
    return (f"kv usage {t.net_kv_usage:.2f}: {t.kv_usage:.2f} less "
            f"{t.kv_reclaimable:.2f} only session holds keep")


def overlaps_from_match(match: PrefixMatch) -> dict[str, TierOverlap]:
    """The index's ``lookup`` answer as :class:`TierOverlap` per engine: device
    (``GPU``), host (``CPU``) and disk (``STORAGE``, the medium of the connector's
    disk tier and of vLLM's file tier)."""
    return {
        engine: TierOverlap(tiers.get(TIER_DEVICE, 0), tiers.get(TIER_HOST, 0),
                            tiers.get(TIER_STORAGE, 0))
        for engine, tiers in match.items()
    }


def _live_session_holder(inp: RouteInput, healthy_decode: set[str],
                         params: RoutingParams) -> str | None:
    # The session's D counts only while its handle is usable (protocol.handle_expired)
    # and it is up: after that its blocks may be freed, and a pull from it would fail.
    s = inp.session
    if s is None or s.last_decode is None or s.last_decode not in healthy_decode:
        return None
    if s.expires_at_s is not None and handle_expired(s.expires_at_s, inp.now_s,
                                                     params.handle_expiry_margin_s):
        return None
    return s.last_decode


# --------------------------------------------------------------------------- score


def _restore_weight(tier: Tier, blocks: int, context_blocks: int, inp: RouteInput,
                    params: RoutingParams) -> float:
    """Credit per block restored from ``tier`` (host or disk): the share of its
    recompute a restore saves (``peer_credit_weight`` over that tier's link,
    ``routing.params.host_link`` or ``disk_link``), or the tier's fixed weight
    (``weights.host``, ``weights.disk``) while the model's KV size is unknown."""
    if blocks <= 0:
        return 0.0
    if inp.kv_bytes_per_token <= 0:
        return params.weights.disk if tier is Tier.DISK else params.weights.host
    link = params.disk_link if tier is Tier.DISK else params.host_link
    return peer_credit_weight(blocks * inp.block_size, context_blocks * inp.block_size,
                              inp.kv_bytes_per_token, params.recompute, link)


def _tier_increments(ov: TierOverlap, device: int, prompt_blocks: int) -> tuple[int, int]:
    """(host, disk) blocks beyond ``device``: each tier's prefix counts only where it
    extends the faster tiers' (the index reports each from block 0)."""
    host_reach = max(device, min(max(0, ov.host_blocks), prompt_blocks))
    disk_reach = max(host_reach, min(max(0, ov.disk_blocks), prompt_blocks))
    return host_reach - device, disk_reach - host_reach


def score_prefill(
    inp: RouteInput, workers: Sequence[WorkerLoad], params: RoutingParams
) -> tuple[PrefillTerms, ...]:
    """Filter and score the P pool; one :class:`PrefillTerms` per healthy P, by URL."""
    prefill = sorted(healthy_workers(workers, Role.PREFILL), key=lambda w: w.url)
    healthy_decode = {w.url for w in workers if w.role is Role.DECODE and w.healthy}
    holder = _live_session_holder(inp, healthy_decode, params)
    peer_total = min(max(0, inp.peer_pullable_blocks), inp.prompt_blocks) if holder else 0
    prompt_blocks = inp.prompt_blocks
    least_loaded = min(w.active_prefill_blocks for w in prefill)
    out = []
    for w in prefill:
        ov = inp.overlaps.get(w.url, TierOverlap())
        device = min(max(0, ov.device_blocks), prompt_blocks)
        host, disk = _tier_increments(ov, device, prompt_blocks)
        host_weight = _restore_weight(Tier.HOST, host, device, inp, params)
        disk_weight = _restore_weight(Tier.DISK, disk, device + host, inp, params)
        disk = disk if disk_weight > 0 else 0   # priced above recompute: recomputed
        reach = device + host + disk
        peer = max(0, peer_total - reach)
        if peer and inp.kv_bytes_per_token > 0:
            # Engine load 0: the load term below already charges for a busy worker.
            peer_weight = peer_credit_weight(
                peer * inp.block_size, reach * inp.block_size, inp.kv_bytes_per_token,
                params.recompute, params.link,
            )
        else:
            peer_weight = params.weights.peer if peer else 0.0
        raw_credit = overlap_credit_blocks(device, host, peer, params.weights, peer_weight,
                                           host_weight, disk, disk_weight)
        excess = w.active_prefill_blocks - least_loaded
        decay = 1.0 / (1.0 + params.overlap_credit_decay * excess / max(1, prompt_blocks))
        credit = decay * raw_credit
        adjusted = max(0.0, w.active_prefill_blocks + prompt_blocks - credit)
        cost = (params.prefill_load_scale * adjusted
                + params.decode_load_scale * w.active_decode_blocks)
        out.append(PrefillTerms(
            url=w.url, active_prefill_blocks=w.active_prefill_blocks,
            prompt_blocks=prompt_blocks, device_blocks=device, host_blocks=host,
            host_weight=host_weight, peer_blocks=peer, peer_weight=peer_weight, raw_credit_blocks=raw_credit,
            excess_blocks=excess, decay=decay, credit_blocks=credit,
            adjusted_prefill_blocks=adjusted, active_decode_blocks=w.active_decode_blocks,
            cost=cost, queued_prefill_blocks=w.queued_prefill_blocks,
            recompute_s_per_token=w.recompute_s_per_token,
            disk_blocks=disk, disk_weight=disk_weight,
        ))
    return tuple(out)


def score_decode(
    inp: RouteInput, workers: Sequence[WorkerLoad], params: RoutingParams
) -> tuple[DecodeTerms, ...]:
    """Filter and score the D pool; one :class:`DecodeTerms` per healthy D, by URL."""
    decode = sorted(healthy_workers(workers, Role.DECODE), key=lambda w: w.url)
    holder = _live_session_holder(inp, {w.url for w in decode}, params)
    prompt_blocks = inp.prompt_blocks
    fewest_placed = min(w.recent_placements for w in decode)
    out = []
    for w in decode:
        ov = inp.overlaps.get(w.url, TierOverlap())
        device = ov.device_blocks
        if w.url == holder:
            # The index may lag D's own events; the session's verified blocks do not.
            device = max(device, inp.peer_pullable_blocks)
        device = min(max(0, device), prompt_blocks)
        host, disk = _tier_increments(ov, device, prompt_blocks)
        host_weight = _restore_weight(Tier.HOST, host, device, inp, params)
        disk_weight = _restore_weight(Tier.DISK, disk, device + host, inp, params)
        # A disk read priced above recompute is not a restore: the engine recomputes.
        disk = disk if disk_weight > 0 else 0
        new = prompt_blocks - device - host - disk
        net = net_kv_usage(w)
        out.append(DecodeTerms(
            url=w.url, active_decode_blocks=w.active_decode_blocks,
            queued_decode_blocks=w.queued_decode_blocks,
            queued_prefill_blocks=w.queued_prefill_blocks, device_blocks=device,
            host_blocks=host, host_weight=host_weight,
            disk_blocks=disk, disk_weight=disk_weight,
            new_blocks=new, kv_usage=w.kv_usage, kv_reclaimable=w.kv_reclaimable,
            net_kv_usage=net, active_requests=w.active_requests,
            affinity=w.url == holder, over_pressure=net > params.decode_kv_pressure_threshold,
            recent_placements=w.recent_placements,
            # The placements surcharge prices the work this request adds here (its
            # new blocks), not its whole prompt: a worker that already holds the
            # prefix adds little work however many placements it took lately.
            # A host or disk block is a restore, priced at the share of a recompute
            # it costs.
            cost=params.decode_load_scale * (
                w.active_decode_blocks
                + (1.0 - host_weight) * host
                + (1.0 - disk_weight) * disk
                + new * (1.0 + params.decode_recent_weight
                         * (w.recent_placements - fewest_placed))),
        ))
    return tuple(out)


# --------------------------------------------------------------------------- pick


def pick(costs: Mapping[str, float], temperature: float, rng: random.Random) -> str:
    """The URL to use: argmin at ``temperature == 0``, else a softmax draw.

    Ties at the minimum are drawn uniformly, so equal workers share the load instead of
    the first one in the list taking it all.  The softmax runs over costs normalised to
    [0, 1] by their spread, so ``temperature`` means the same whatever the cost scale.
    """
    if not costs:
        raise ValueError("pick() needs at least one candidate")
    urls = sorted(costs)  # input order must not matter for a given seed
    lo, hi = min(costs.values()), max(costs.values())
    tol = _TIE_RTOL * max(1.0, abs(lo))
    if temperature == 0 or hi - lo <= tol:
        return rng.choice([u for u in urls if costs[u] - lo <= tol])
    spread = hi - lo
    weights = [math.exp(-(costs[u] - lo) / spread / temperature) for u in urls]
    return rng.choices(urls, weights=weights)[0]


def _prefix_holder(terms: Sequence[DecodeTerms], params: RoutingParams) -> DecodeTerms | None:
    """The worker holding the longest prefix, if that prefix is worth keeping the
    request there and the worker's load is within the bound."""
    if params.decode_affinity_load_bound <= 0 or len(terms) < 2:
        return None
    # Reach: the prompt blocks a worker need not compute, on device, host or disk.
    ranked = sorted(terms, key=lambda t: (t.new_blocks, t.cost, t.url))
    best, runner_up = ranked[0], ranked[1]
    prompt_blocks = best.device_blocks + best.host_blocks + best.disk_blocks + best.new_blocks
    gain = runner_up.new_blocks - best.new_blocks
    if gain <= 0 or gain < params.decode_affinity_min_gain * prompt_blocks:
        return None  # nobody, several alike, or too little to be worth a hot spot
    # With the new request counted: at most ``bound`` times the mean, or ``slack``
    # requests above it, so that at low concurrency a short burst of one prefix
    # group stays where its prefix is.
    total = sum(t.active_requests for t in terms) + 1
    mean = total / len(terms)
    limit = max(params.decode_affinity_load_bound * mean,
                mean + params.decode_affinity_load_slack)
    return best if best.active_requests + 1 <= limit else None


def _lighter_than_holder(holder: DecodeTerms, under: Sequence[DecodeTerms],
                         params: RoutingParams) -> DecodeTerms | None:
    """The cheapest other D (not over kv pressure; by ``cost``, as any placement) if
    the session's holder has more work queued than it by more than the session's
    reuse there is worth; else None.

    Queued work, not in-flight KV: a running request's cached prefix costs its D
    nothing more, so weighing whole contexts moved sessions (and the prefix groups
    routed after them) off engines that had little left to do."""
    if params.session_affinity_yield_weight <= 0:
        return None
    others = sorted((t for t in under if t.url != holder.url), key=lambda t: (t.cost, t.url))
    if not others:
        return None
    best = others[0]
    work_gap = holder.queued_decode_blocks - best.queued_decode_blocks
    reuse = best.new_blocks - holder.new_blocks
    return best if work_gap > params.session_affinity_yield_weight * max(0, reuse) else None


def _pick_decode(
    terms: tuple[DecodeTerms, ...], params: RoutingParams, rng: random.Random
) -> tuple[str, str, bool]:
    """(url, reason, chosen for its prefix)."""
    holder = next((t for t in terms if t.affinity), None)
    under = [t for t in terms if not t.over_pressure]
    threshold = params.decode_kv_pressure_threshold
    if holder is not None and not holder.over_pressure:
        lighter = _lighter_than_holder(holder, under, params)
        if lighter is None:
            # Say the figure where vLLM's own usage alone would have dropped it.
            kept = (f" ({_kv_figure(holder)} <= {threshold})"
                    if holder.kv_usage > threshold else "")
            return holder.url, f"session affinity{kept}", False
        return (lighter.url, f"session affinity yielded to load ({holder.queued_decode_blocks:.0f}"
                f" vs {lighter.queued_decode_blocks:.0f} queued decode blocks, "
                f"{lighter.new_blocks - holder.new_blocks} blocks reuse)", False)
    if holder is not None and not under:
        return (holder.url, "session affinity kept: every decode worker over kv pressure "
                f"({_kv_figure(holder)} > {threshold})", False)
    if holder is not None:
        reason = f"session affinity dropped: kv pressure ({_kv_figure(holder)} > {threshold})"
    elif under:
        reason = "least loaded decode"
        prefix = _prefix_holder(under, params)
        if prefix is not None:
            restored = _restored_note(prefix, "on")
            return prefix.url, f"prefix affinity{f' ({restored})' if restored else ''}", True
    else:
        reason = "least loaded decode: every decode worker over kv pressure"
    pool = under or list(terms)
    return pick({t.url: t.cost for t in pool}, params.temperature, rng), reason, False


def route(
    inp: RouteInput,
    workers: Sequence[WorkerLoad],
    params: RoutingParams,
    rng: random.Random,
) -> RouteDecision:
    """Choose D, decide whether P is needed, then choose P.

    D comes first (as in llm-d's P/D handler) because whether to skip P depends on
    what the chosen D already holds.  Raises :class:`NoWorkerAvailable` when no D is
    healthy, or when P is needed, none is healthy and ``decode_only_without_prefill``
    is off.
    """
    decode_terms = score_decode(inp, workers, params)
    decode_url, decode_reason, by_prefix = _pick_decode(decode_terms, params, rng)
    if by_prefix:
        decode_terms = tuple(msgspec.structs.replace(t, prefix_affinity=True)
                             if t.url == decode_url else t for t in decode_terms)
    chosen = next(t for t in decode_terms if t.url == decode_url)
    uncached = max(0, inp.prompt_tokens - (chosen.device_blocks + chosen.host_blocks
                                           + chosen.disk_blocks) * inp.block_size)
    no_decode = (params.prefill_only_without_decode and inp.max_output_tokens is not None
                 and inp.max_output_tokens <= 1)

    def decode_only(reason: str, label: RouteReason) -> RouteDecision:
        return RouteDecision(
            mode=Mode.DECODE_ONLY, prefill_url=None, decode_url=decode_url,
            reason=f"{decode_reason}; decode only: {reason}", label=label,
            uncached_tokens=uncached, decode_candidates=decode_terms)

    alone = _decode_alone(inp, workers, params, chosen, uncached, no_decode)
    if alone is not None:
        return decode_only(*alone)
    try:
        # A prefill-only request is a plain request on P: no handle, so no peer pull.
        prefill_terms, prefill_chosen = _pick_prefill(inp, workers, params, rng, no_decode)
    except NoWorkerAvailable:
        if not params.decode_only_without_prefill:
            raise
        return decode_only("no healthy prefill worker", RouteReason.NO_PREFILL_WORKER)
    prefill_url = prefill_chosen.url
    if no_decode:
        return RouteDecision(
            mode=Mode.PREFILL_ONLY, prefill_url=prefill_url, decode_url=decode_url,
            reason=f"{decode_reason}; prefill only: at most {inp.max_output_tokens} new "
                   f"token, computed by the prefill ({uncached} tokens uncached on D)",
            label=RouteReason.NO_DECODE,
            uncached_tokens=uncached, prefill_candidates=prefill_terms,
            decode_candidates=decode_terms,
        )
    queued = _prefill_queued(chosen, prefill_chosen, params, inp.block_size)
    expiry = handle_expires_in_queue(inp, prefill_chosen, params) if queued is None else None
    alone, expiry_words = (expiry_route(expiry, chosen, _room(chosen, params), params)
                           if expiry is not None else (False, ""))
    if queued is not None or alone:
        return RouteDecision(
            mode=Mode.DECODE_ONLY, prefill_url=None, decode_url=decode_url,
            reason=f"{decode_reason}; decode only: {queued or expiry_words}",
            label=RouteReason.HANDLE_EXPIRES_IN_QUEUE if alone else RouteReason.PREFILL_QUEUED,
            uncached_tokens=uncached, prefill_candidates=prefill_terms,
            decode_candidates=decode_terms, handle_expires_in_queue=alone)
    if expiry is not None:
        # P recomputes what it would have pulled: priced, picked and counted so.
        prefill_terms, prefill_chosen = _pick_prefill(inp, workers, params, rng, True)
        prefill_url = prefill_chosen.url
    why, label, restore, not_asked = _disaggregated_why(inp, workers, params, chosen,
                                                        prefill_chosen, uncached)
    return RouteDecision(
        mode=Mode.DISAGGREGATED, prefill_url=prefill_url, decode_url=decode_url,
        reason=f"{decode_reason}; disaggregated: {why} ({uncached} uncached tokens)"
               f"{not_asked}{f'; {expiry_words}' if expiry_words else ''}",
        label=label, uncached_tokens=uncached, restore_tokens=restore,
        prefill_candidates=prefill_terms, decode_candidates=decode_terms,
        handle_expires_in_queue=expiry is not None,
    )


def _pick_prefill(inp: RouteInput, workers: Sequence[WorkerLoad], params: RoutingParams,
                  rng: random.Random, without_handle: bool
                  ) -> tuple[tuple[PrefillTerms, ...], PrefillTerms]:
    """The P pool scored, and the chosen P's terms.  ``without_handle``: no session
    handle goes to P (a prefill-only request, or a handle that would expire in P's
    queue), so no pull from the session's D is credited."""
    terms = score_prefill(msgspec.structs.replace(inp, peer_pullable_blocks=0)
                          if without_handle else inp, workers, params)
    url = pick({t.url: t.cost for t in terms}, params.temperature, rng)
    return terms, next(t for t in terms if t.url == url)


def _decode_alone(inp: RouteInput, workers: Sequence[WorkerLoad], params: RoutingParams,
                  chosen: DecodeTerms, uncached: int, no_decode: bool
                  ) -> tuple[str, RouteReason] | None:
    """(reason, label) when D serves the request alone before P is scored: a small
    increment D has room for, several engine requests, or no prefill pool."""
    small = uncached <= params.decode_only_max_uncached_tokens
    room, room_note = _room(chosen, params)
    if small and room:
        notes = ", ".join(n for n in (_restored_note(chosen, "restored from"), room_note) if n)
        return (f"{uncached} uncached tokens{f', {notes}' if notes else ''}",
                _RESTORE_REASON.get(chosen.restored_from, RouteReason.SMALL_INCREMENT))
    if inp.engine_requests > 1 and not no_decode:
        # P answers with one hand-off, naming one engine request's KV (vLLM returns one
        # set of kv_transfer_params per client request), while D would run several:
        # the others would compute their prompts anyway, after verification refused
        # P's blocks, or wait out an early-decode hold meant for one.  D computes them
        # from the start instead.  (Prefill only is fine: P serves them all.)
        return (f"{inp.engine_requests} engine requests (n or a batch of prompts), one "
                "P -> D hand-off carries one", RouteReason.SEVERAL_ENGINE_REQUESTS)
    # A deployment without P (co-located) is not one whose P are down.
    if not any(w.role is Role.PREFILL for w in workers):
        return "co-located, no prefill pool", RouteReason.COLOCATED
    return None


def _prefill_queued(decode: DecodeTerms, prefill: PrefillTerms, params: RoutingParams,
                    block_size: int) -> str | None:
    """Why the turn goes to D alone because of P's queue, or None (load-aware
    conditional disaggregation; ``decode_only_prefill_queued_max_tokens``).

    The rule, in blocks of prompt compute: the turn's prompt is computed after
    whatever is queued before it on that engine, so through P it is ready at
    ``P's queued work + what P computes for it`` (the prompt less what P holds, a pull
    from D counted at its price: the share of a recompute it costs), and on D alone
    at ``D's queued prefill work + what D computes for it`` (its uncached blocks, a
    host-tier restore at its price).  D serves it alone when that is sooner, while

    * P has work queued at all: an idle P keeps the static rule's decisions (through
      an idle P the pull's price alone would make D look sooner, and the split's
      point, D's decodes untouched by prefills, is worth that price);
    * D's queued prefill work with this turn's stays within the bound: D's running
      decodes share every step with that prefill, so the bound is what D may take on
      before they slow too much (Dynamo's disaggregated router holds the same line
      from the other side: remote prefill only while P's queue is below a limit);
    * D has room (``decode_only_max_kv_usage``, ``decode_only_max_active_requests``),
      as for a small increment.

    Both queues are the proxy's own counts of what it routed and has not seen
    finish, so the rule needs no engine metrics and holds for any trace; D's is
    counted until each request ends, so it errs towards P.
    """
    bound = params.decode_only_prefill_queued_max_tokens
    # ``decode_only_max_uncached_tokens: -1`` is "always disaggregate": this rule too.
    if (bound <= 0 or params.decode_only_max_uncached_tokens < 0
            or prefill.queued_prefill_blocks <= 0):
        return None
    room, room_note = _room(decode, params)
    if not room:
        return None
    through_prefill = prefill.queued_prefill_blocks + prefill.work_blocks
    decode_work = (decode.new_blocks + (1.0 - decode.host_weight) * decode.host_blocks
                   + (1.0 - decode.disk_weight) * decode.disk_blocks)
    on_decode = decode.queued_prefill_blocks + decode_work
    if through_prefill <= on_decode or on_decode * block_size > bound:
        return None
    return (f"P's queue {prefill.queued_prefill_blocks:.1f} + {prefill.work_blocks:.1f} "
            f"blocks of compute for this turn = {through_prefill:.1f} > D's queue "
            f"{decode.queued_prefill_blocks:.1f} + {decode_work:.1f} = {on_decode:.1f} "
            f"(within {bound} tokens{f', {room_note}' if room_note else ''})")


def _room(decode: DecodeTerms, params: RoutingParams) -> tuple[bool, str]:
    """Whether D has room to serve a turn alone: its net KV usage
    (``net_kv_usage``) under ``decode_only_max_kv_usage`` and its requests under
    ``decode_only_max_active_requests``; and the figure for the reason, where one
    decided: what refused it, or the net usage where vLLM's own would have."""
    bound = params.decode_only_max_kv_usage
    if decode.net_kv_usage >= bound:
        return False, f"{_kv_figure(decode)} >= {bound}"
    if decode.active_requests >= params.decode_only_max_active_requests:
        return False, (f"{decode.active_requests} active requests >= "
                       f"{params.decode_only_max_active_requests}")
    return True, f"{_kv_figure(decode)} < {bound}" if decode.kv_usage >= bound else ""


def _disaggregated_why(inp: RouteInput, workers: Sequence[WorkerLoad],
                       params: RoutingParams, chosen: DecodeTerms,
                       prefill_chosen: PrefillTerms, uncached: int
                       ) -> tuple[str, RouteReason, int, str]:
    """(why, label, restore tokens, why a restore was not asked) of a P -> D route."""
    small = uncached <= params.decode_only_max_uncached_tokens
    # A small increment comes here only when D had no room (``_decode_alone``).
    why = ("increment too large" if not small
           else f"decode worker busy ({_room(chosen, params)[1]})")
    label = RouteReason.INCREMENT_TOO_LARGE if not small else RouteReason.DECODE_BUSY
    restore = _restore_for_pull(inp, chosen, prefill_chosen, params)
    not_asked = ""
    if restore:
        decode_worker = next(w for w in workers if w.url == chosen.url)
        if decode_worker.restores_expire:
            not_asked = ("; not asked: this D's session lease is shorter than the handle "
                         "expiry margin")
        elif not inp.restore_allowed:
            not_asked = "; not asked: no session or token ids"
    if not_asked:
        restore = 0
    elif restore:
        tiers = "host and disk tiers" if chosen.disk_blocks else "host tier"
        why += f"; D restores {restore} tokens from its {tiers} for P to pull"
        label = (RouteReason.DISK_TIER_PULL if chosen.disk_blocks
                 else RouteReason.HOST_TIER_PULL)
    return why, label, restore, not_asked


# The route reason of a decode-only turn by the slowest tier D restores from.
_RESTORE_REASON = {Tier.HOST: RouteReason.HOST_TIER, Tier.DISK: RouteReason.DISK_TIER}


def _restored_note(terms: DecodeTerms, verb: str) -> str:
    """Each tier D restores from, named with its blocks (``2 blocks restored from
    its host tier, 3 blocks restored from its disk tier``); empty when none."""
    return ", ".join(f"{_blocks(n)} {verb} its {tier.value} tier"
                     for tier, n in ((Tier.HOST, terms.host_blocks),
                                     (Tier.DISK, terms.disk_blocks)) if n)


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _restore_for_pull(inp: RouteInput, decode: DecodeTerms, prefill: PrefillTerms,
                      params: RoutingParams) -> int:
    """Prompt tokens D should restore from its host (and disk) tier for P to pull, or 0.

    Only where no handle already offers P the session's blocks on D (a handle's
    blocks are ``peer_pullable_blocks``) and D's reach (device and host) goes beyond
    P's own: P would pull that difference after D's restore, and
    :func:`vllm_sessionkv.wire.cost.decide_restore_for_pull` prices the restore and the
    pull against P recomputing it.  P's connector prices the pull again itself."""
    restored = decode.host_blocks + decode.disk_blocks
    if restored <= 0 or (decode.affinity and inp.peer_pullable_blocks > 0):
        return 0
    decode_reach = decode.device_blocks + restored
    prefill_reach = prefill.device_blocks + prefill.host_blocks + prefill.disk_blocks
    if decode_reach <= prefill_reach:
        return 0
    # With disk blocks in it the whole restore is priced over the (slower) disk link.
    restore_link = params.disk_link if decode.disk_blocks else params.host_link
    priced = decide_restore_for_pull(
        PullQuote(pull_tokens=(decode_reach - prefill_reach) * inp.block_size,
                  context_tokens=prefill_reach * inp.block_size,
                  kv_bytes_per_token=inp.kv_bytes_per_token, engine_load=0.0),
        params.recompute, restore_link, params.link)
    return decode_reach * inp.block_size if priced.pull else 0

