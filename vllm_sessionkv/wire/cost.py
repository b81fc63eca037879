"""The runtime cost model: whether to move verified KV or recompute it, and what a
cached block is worth to the router.

Two callers share it, so that they cannot disagree:

* the connector's scheduler asks :func:`decide_pull` at every step whether to pull
  verified KV from a peer or recompute it, and :func:`decide_sync_load` whether a
  read may run inside the step that computes the request;
* the proxy's policy credits each engine's cache hits with
  :func:`overlap_credit_blocks`, pricing a peer's blocks with :func:`peer_credit_weight`.

The capacity planner's model (model shapes, hardware, links, workloads, pool sizes)
is ``capacity.py``; it derives this module's coefficients from hardware
(``capacity.recompute_model_from_hardware``).  Everything here is a pure function
over frozen msgspec structs: no clock, no I/O, no globals, and only msgspec is
imported, so the proxy can use it without torch or vLLM.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "DEFAULT_DISK_LINK",
    "DEFAULT_HOST_LINK",
    "DEFAULT_LINK",
    "DEFAULT_RECOMPUTE",
    "LinkModel",
    "OverlapWeights",
    "PullDecision",
    "PullQuote",
    "RecomputeModel",
    "attention_pairs",
    "calibrate_s_per_token",
    "decide_pull",
    "decide_restore_for_pull",
    "decide_sync_load",
    "overlap_credit_blocks",
    "peer_credit_weight",
    "recompute_time_s",
    "transfer_time_s",
]


def attention_pairs(new_tokens: int, context_tokens: int) -> float:
    """(new token, earlier token) pairs a causal prefill of ``new_tokens`` after
    ``context_tokens`` computes."""
    # Causal attention: new token i attends to the context and to the i tokens before it,
    # sum_{i<n} (c + i) = n*c + n(n-1)/2.
    n = max(0, new_tokens)
    return n * max(0, context_tokens) + n * (n - 1) / 2.0


def transfer_time_s(num_bytes: float, link_bytes_per_s: float, per_transfer_s: float = 0.0) -> float:
    """Time to move ``num_bytes``; nothing to move costs nothing, not even the fixed part."""
    if num_bytes <= 0:
        return 0.0
    if link_bytes_per_s <= 0:
        raise ValueError(f"link_bytes_per_s must be positive, got {link_bytes_per_s}")
    return per_transfer_s + num_bytes / link_bytes_per_s


# --------------------------------------------------------------------------- the connector


class RecomputeModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    s_per_token: float  # linear prefill cost per new token on an idle engine
    s_per_token_per_context_token: float  # attention: per new token per earlier token
    load_slowdown_per_unit: float  # recompute time multiplier grows by this per unit of load

    def __post_init__(self) -> None:
        for field in ("s_per_token", "s_per_token_per_context_token", "load_slowdown_per_unit"):
            if getattr(self, field) < 0:
                raise ValueError(f"RecomputeModel.{field} must be >= 0")


class LinkModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    bytes_per_s: float
    per_transfer_s: float  # fixed cost of one pull (post, notification, handshake amortised)

    def __post_init__(self) -> None:
        if self.bytes_per_s <= 0:
            raise ValueError("LinkModel.bytes_per_s must be positive")
        if self.per_transfer_s < 0:
            raise ValueError("LinkModel.per_transfer_s must be >= 0")


# Defaults sized for the tiny CPU model on the project's CI machine; the connector's
# config and the router's pricing both start from these.
DEFAULT_RECOMPUTE = RecomputeModel(s_per_token=2.0e-5, s_per_token_per_context_token=2.0e-8,
                                   load_slowdown_per_unit=0.25)
DEFAULT_LINK = LinkModel(bytes_per_s=1.0e9, per_transfer_s=2.0e-3)
# Host DRAM <-> engine KV copies (the host tier): a memcpy on CPU, a PCIe copy on GPU.
DEFAULT_HOST_LINK = LinkModel(bytes_per_s=5.0e9, per_transfer_s=1.0e-4)
# Disk-tier file -> host slot -> KV copies (the connector's ``disk_read_*`` prior): a
# local NVMe's buffered reads, and a file open per block.
DEFAULT_DISK_LINK = LinkModel(bytes_per_s=1.0e9, per_transfer_s=5.0e-4)


def recompute_time_s(
    tokens: int, context_tokens: int, model: RecomputeModel, engine_load: float
) -> float:
    """Time to compute ``tokens`` new tokens that start at offset ``context_tokens``.

    ``(tokens * s_per_token + s_per_token_per_context_token * sum_{i<tokens}(context + i))
    * (1 + load_slowdown_per_unit * engine_load)``.  Load stretches recompute because the
    recomputed tokens share the step with everyone else's; a pull runs beside the step.
    """
    if tokens <= 0:
        return 0.0
    if engine_load < 0:
        raise ValueError(f"engine_load must be >= 0, got {engine_load}")
    idle_s = tokens * model.s_per_token + model.s_per_token_per_context_token * attention_pairs(
        tokens, context_tokens
    )
    return idle_s * (1.0 + model.load_slowdown_per_unit * engine_load)


def calibrate_s_per_token(estimate: float, tokens: int, pairs: float, step_s: float,
                          s_per_token_per_context_token: float, alpha: float,
                          min_tokens: int) -> float:
    """The recompute price ``s_per_token`` refined by one engine step's timing.

    A step that computed ``tokens`` new tokens over ``pairs`` attention pairs
    (:func:`attention_pairs`, summed over its requests) in ``step_s`` is one sample:
    ``(step_s - s_per_token_per_context_token * pairs) / tokens``, folded into
    ``estimate`` with weight ``alpha``.  Steps of fewer than ``min_tokens`` tokens
    (decode steps) measure the step's fixed cost, not prefill, and leave the estimate
    as it was.  The fixed cost of the steps that count stays in the sample: it prices
    recompute a little high, which a recompute does cost the step.
    """
    if tokens < max(1, min_tokens) or step_s <= 0:
        return estimate
    sample = max(0.0, step_s - s_per_token_per_context_token * max(0.0, pairs)) / tokens
    return (1.0 - alpha) * estimate + alpha * sample


class PullQuote(msgspec.Struct, frozen=True):
    """The inputs for one request's pull-or-recompute decision."""

    pull_tokens: int  # verified tokens a peer (or host tier) could supply beyond the local hit
    context_tokens: int  # tokens before them already in local KV
    kv_bytes_per_token: float
    engine_load: float  # >= 0; e.g. running+waiting normalised by max_num_seqs
    queued_bytes: float = 0.0  # already waiting on the same link ahead of this pull


class PullDecision(msgspec.Struct, frozen=True):
    pull: bool
    pull_s: float
    recompute_s: float
    reason: str


def decide_pull(
    quote: PullQuote, recompute: RecomputeModel, link: LinkModel, min_pull_tokens: int = 1
) -> PullDecision:
    """Pull iff it is at least ``min_pull_tokens`` tokens and strictly faster than recompute.

    Ties recompute: a pull can fail or expire, a recompute cannot.
    """
    if quote.pull_tokens <= 0:
        return PullDecision(False, 0.0, 0.0, "nothing to pull")
    pull_bytes = quote.pull_tokens * quote.kv_bytes_per_token
    pull_s = transfer_time_s(pull_bytes + quote.queued_bytes, link.bytes_per_s, link.per_transfer_s)
    return _transfer_or_recompute(quote, pull_s, recompute, min_pull_tokens, "pull faster")


def _transfer_or_recompute(quote: PullQuote, transfer_s: float, recompute: RecomputeModel,
                           min_pull_tokens: int, faster: str) -> PullDecision:
    """Transfer iff at least ``min_pull_tokens`` and strictly faster than recomputing
    ``quote.pull_tokens``; ties recompute."""
    recompute_s = recompute_time_s(
        quote.pull_tokens, quote.context_tokens, recompute, quote.engine_load
    )
    if quote.pull_tokens < min_pull_tokens:
        return PullDecision(False, transfer_s, recompute_s, "below min_pull_tokens")
    if transfer_s < recompute_s:
        return PullDecision(True, transfer_s, recompute_s, faster)
    return PullDecision(False, transfer_s, recompute_s, "recompute faster")


def decide_sync_load(read_s: float, engine_load: float, max_stall_s: float) -> bool:
    """Read a pull inside the step that computes the request, or in steps of its own.

    An asynchronous read costs the request a step: the step that posts the read runs
    without it, and only a later step, after the read is seen done, computes it.  A
    synchronous read saves that step, but the forward waits for it, so everyone else
    in the step waits ``read_s`` too.  Read synchronously iff the read is short
    (``read_s <= max_stall_s``) and so is the stall summed over the others
    (``read_s * engine_load <= max_stall_s``).  ``max_stall_s == 0`` turns it off.
    """
    if max_stall_s <= 0 or read_s < 0 or engine_load < 0:
        return False
    return read_s <= max_stall_s and read_s * engine_load <= max_stall_s


# --------------------------------------------------------------------------- the router


class OverlapWeights(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Credit per cached block, by tier, in blocks of prefill saved (Dynamo's convention)."""

    device: float = 1.0
    host: float = 0.75  # Dynamo's --router-host-cache-hit-weight default
    peer: float = 0.5  # used when the caller does not price the peer with peer_credit_weight
    disk: float = 0.5  # used while the disk read cannot be priced (KV size unknown)

    def __post_init__(self) -> None:
        for name in ("device", "host", "peer", "disk"):
            if getattr(self, name) < 0:
                raise ValueError(f"OverlapWeights.{name} must be >= 0")


def peer_credit_weight(
    peer_tokens: int,
    context_tokens: int,
    kv_bytes_per_token: float,
    recompute: RecomputeModel,
    link: LinkModel,
    engine_load: float = 0.0,
) -> float:
    """Share of the recompute time a transfer saves, in [0, 1]: ``1 - transfer_s /
    recompute_s``.  With a peer's link it prices a peer pull; with the host link
    (``DEFAULT_HOST_LINK``, the connector's ``host_copy_*``) a host-tier restore, which
    replaces Dynamo's fixed 0.75 host weight."""
    recompute_s = recompute_time_s(peer_tokens, context_tokens, recompute, engine_load)
    if recompute_s <= 0:
        return 0.0
    pull_s = transfer_time_s(peer_tokens * kv_bytes_per_token, link.bytes_per_s, link.per_transfer_s)
    return max(0.0, 1.0 - pull_s / recompute_s)


def decide_restore_for_pull(
    quote: PullQuote, recompute: RecomputeModel, host_link: LinkModel, link: LinkModel,
    min_pull_tokens: int = 1,
) -> PullDecision:
    """Should D restore ``quote.pull_tokens`` from its host tier so that P pulls them?

    The alternative to P recomputing them: D copies them host -> device, then P reads
    them over the link, one after the other.  Priced with the same models as a pull
    (:func:`decide_pull`); ties recompute, as there.
    """
    if quote.pull_tokens <= 0:
        return PullDecision(False, 0.0, 0.0, "nothing to restore")
    num_bytes = quote.pull_tokens * quote.kv_bytes_per_token
    relay_s = (transfer_time_s(num_bytes, host_link.bytes_per_s, host_link.per_transfer_s)
               + transfer_time_s(num_bytes + quote.queued_bytes, link.bytes_per_s,
                                 link.per_transfer_s))
    return _transfer_or_recompute(quote, relay_s, recompute, min_pull_tokens,
                                  "restore and pull faster")


def overlap_credit_blocks(
    device_blocks: int,
    host_blocks: int,
    peer_blocks: int,
    weights: OverlapWeights = OverlapWeights(),
    peer_weight: float | None = None,
    host_weight: float | None = None,
    disk_blocks: int = 0,
    disk_weight: float | None = None,
) -> float:
    """Blocks of prefill a candidate engine is credited with.

    Tiers are disjoint increments of one prefix: ``host_blocks`` extend the device hit,
    ``disk_blocks`` extend both, ``peer_blocks`` extend all three.  ``peer_weight``,
    ``host_weight`` and ``disk_weight`` (each from :func:`peer_credit_weight`, over
    the peer's, the host's and the disk's link) override ``weights.peer``,
    ``weights.host`` and ``weights.disk`` when the router can price the transfer.
    """
    peer = weights.peer if peer_weight is None else peer_weight
    host = weights.host if host_weight is None else host_weight
    disk = weights.disk if disk_weight is None else disk_weight
    return (
        weights.device * max(0, device_blocks)
        + host * max(0, host_blocks)
        + disk * max(0, disk_blocks)
        + peer * max(0, peer_blocks)
    )
