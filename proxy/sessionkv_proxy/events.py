"""msgspec copies of vLLM 0.32's KV-event wire types, and their decoder.

Copied from ``vllm/distributed/kv_events.py`` (0.32.0) so the proxy needs no vLLM
install; ``tests/proxy/test_events.py`` decodes bytes made by vLLM's own encoder to
keep the copies honest.

Wire shape: a batch is a msgpack *array* ``[ts, events, data_parallel_rank]``; each
event is a msgpack *map* tagged by ``"type"``.  vLLM omits fields that hold their
default, so every field that has a default in vLLM has the same default here.
Unknown fields are ignored (msgspec's default) so a newer vLLM that adds fields still
decodes; trailing batch elements are ignored too.

Block hashes are ``int`` by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the
low 64 bits of the digest) and ``bytes`` otherwise; both are kept as they arrive.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventDecodeError",
    "ExternalBlockHash",
    "KVEvent",
    "KVEventBatch",
    "cache_salt_of",
    "decode_batch",
    "decode_batch_lenient",
]

# vLLM's ``medium`` values.  The primary KV pool reports "GPU" even on the CPU
# platform, so "GPU" means "device tier", not the hardware.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

ExternalBlockHash = int | bytes


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """Blocks entered an engine's prefix cache (one event per cached run of blocks)."""

    block_hashes: list[ExternalBlockHash]
    # Engine hash of the block before the first one here; None for block 0.
    parent_block_hash: ExternalBlockHash | None
    # All tokens of these blocks, concatenated (len == len(block_hashes) * block_size
    # for full-attention groups).
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated upstream, kept because vLLM always sends it
    medium: str | None
    lora_name: str | None
    # One untagged entry per block: LoRA name, (mm_id, offset) pairs, cache_salt,
    # prompt-embeds digest, in that order.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """Blocks left an engine's cache on one medium (eviction or rehash)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    """The engine's prefix cache was reset (device pool)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One publish: the events of one scheduler step."""

    ts: float  # publisher wall clock, unix seconds
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True):
    # Events left undecoded so one unknown event type costs that event, not the batch.
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class EventDecodeError(ValueError):
    """The payload is not a KV event batch this module understands."""


_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_raw_batch_decoder = msgspec.msgpack.Decoder(_RawBatch)
_event_decoder = msgspec.msgpack.Decoder(KVEvent)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one batch strictly: any bad event fails the whole batch."""
    try:
        return _batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventDecodeError(f"undecodable KV event batch: {exc}") from None


def decode_batch_lenient(payload: bytes) -> tuple[KVEventBatch, int]:
    """Decode a batch, skipping events that fail to decode.

    Returns the batch holding the good events and the number skipped.  Raises
    :class:`EventDecodeError` only when the envelope itself is bad.
    """
    try:
        raw = _raw_batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventDecodeError(f"undecodable KV event batch: {exc}") from None
    events: list[KVEvent] = []
    undecodable = 0
    for raw_event in raw.events:
        try:
            events.append(_event_decoder.decode(raw_event))
        except (msgspec.DecodeError, msgspec.ValidationError):
            undecodable += 1
    return KVEventBatch(ts=raw.ts, events=events,
                        data_parallel_rank=raw.data_parallel_rank), undecodable


def cache_salt_of(event: BlockStored) -> str | None:
    """The request's ``cache_salt``, read from the first block's extra keys.

    vLLM publishes extra keys untagged (``to_event_extra_keys``): for block 0 they are
    the LoRA name (when ``lora_name`` is set), ``(mm_id, offset)`` tuples, the salt
    string, then prompt-embeds digests (bytes).  So the salt is the first bare string
    after the LoRA name.  Only meaningful when ``parent_block_hash`` is None, i.e.
    the event starts at block 0.
    """
    if not event.extra_keys or event.extra_keys[0] is None:
        return None
    strings = [key for key in event.extra_keys[0] if isinstance(key, str)]
    if event.lora_name is not None and strings and strings[0] == event.lora_name:
        strings = strings[1:]
    return strings[0] if strings else None
