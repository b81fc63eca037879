"""Our copies of vLLM's KV-event structs decode what vLLM 0.32 itself encodes."""

from __future__ import annotations

import msgspec
import pytest

from sessionkv_proxy import events as ours

kv_events = pytest.importorskip("vllm.distributed.kv_events")
kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")

# The publisher thread encodes batches with a plain msgspec msgpack Encoder.
_vllm_encoder = msgspec.msgpack.Encoder()


def _full_stored():
    return kv_events.BlockStored(
        block_hashes=[2**64 - 1, 12345], parent_block_hash=777,
        token_ids=list(range(32)), block_size=16, lora_id=3, medium="GPU",
        lora_name="adapter", extra_keys=[("adapter", "salt-1"), None], group_idx=1,
        kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
        locality="LOCAL", ownership="session-offload", session_id="s1")


def test_field_names_and_defaults_match_vllm():
    for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"):
        theirs = {f.name: f.default for f in msgspec.structs.fields(getattr(kv_events, name))}
        mine = {f.name: f.default for f in msgspec.structs.fields(getattr(ours, name))}
        assert mine == theirs, name
    assert (ours.MEDIUM_GPU, ours.MEDIUM_CPU, ours.MEDIUM_STORAGE) == \
        (kv_events.MEDIUM_GPU, kv_events.MEDIUM_CPU, kv_events.MEDIUM_STORAGE)


def test_decodes_vllm_encoded_batch():
    batch = kv_events.KVEventBatch(ts=1700000000.5, events=[
        _full_stored(),
        # Minimal event: defaults omitted on the wire; bytes hashes
        # (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
        kv_events.BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=None,
                              token_ids=[5] * 16, block_size=16, lora_id=None,
                              medium=None, lora_name=None),
        kv_events.BlockRemoved(block_hashes=[12345, b"\x02" * 8], medium="CPU"),
        kv_events.AllBlocksCleared(),
    ], data_parallel_rank=2)
    decoded = ours.decode_batch(_vllm_encoder.encode(batch))

    assert decoded.ts == 1700000000.5 and decoded.data_parallel_rank == 2
    stored, minimal, removed, cleared = decoded.events
    assert isinstance(stored, ours.BlockStored)
    assert msgspec.structs.asdict(stored) == msgspec.structs.asdict(_full_stored())
    assert minimal.block_hashes == [b"\x01" * 32] and minimal.group_idx is None
    assert minimal.parent_block_hash is None and minimal.medium is None
    assert isinstance(removed, ours.BlockRemoved)
    assert removed.block_hashes == [12345, b"\x02" * 8] and removed.medium == "CPU"
    assert isinstance(cleared, ours.AllBlocksCleared)


def test_batch_without_dp_rank_decodes():
    payload = _vllm_encoder.encode(kv_events.KVEventBatch(ts=1.0, events=[]))
    assert ours.decode_batch(payload) == ours.KVEventBatch(ts=1.0, events=[])


def test_unknown_fields_are_accepted():
    stored = msgspec.to_builtins(_full_stored())
    stored["field_from_the_future"] = {"x": 1}
    payload = msgspec.msgpack.encode([2.0, [stored, {"type": "AllBlocksCleared", "y": 2}], 0,
                                      "trailing element"])
    decoded = ours.decode_batch(payload)
    assert decoded.events[0].session_id == "s1"
    assert isinstance(decoded.events[1], ours.AllBlocksCleared)


def test_unknown_event_type_fails_strict_and_costs_one_event_lenient():
    good = msgspec.to_builtins(kv_events.BlockRemoved(block_hashes=[1], medium="GPU"))
    payload = msgspec.msgpack.encode([3.0, [{"type": "BlockPinned", "block_hashes": [1]}, good], 0])
    with pytest.raises(ours.EventDecodeError):
        ours.decode_batch(payload)
    batch, undecodable = ours.decode_batch_lenient(payload)
    assert undecodable == 1
    assert batch.events == [ours.BlockRemoved(block_hashes=[1], medium="GPU")]


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1})])
def test_garbage_is_an_event_decode_error(payload):
    with pytest.raises(ours.EventDecodeError):
        ours.decode_batch(payload)
    with pytest.raises(ours.EventDecodeError):
        ours.decode_batch_lenient(payload)


@pytest.mark.parametrize("lora_name,tagged,salt", [
    (None, (("cache_salt", "s1"),), "s1"),
    ("lora-a", (("lora", "lora-a", "/p"), ("cache_salt", "s1")), "s1"),
    ("lora-a", (("lora", "lora-a", "/p"),), None),
    (None, (("mm", "img-1", 3), ("cache_salt", "s2"), ("prompt_embeds", b"\x00" * 32)), "s2"),
    (None, None, None),
])
def test_cache_salt_from_vllm_extra_keys(lora_name, tagged, salt):
    # vLLM turns its tagged per-block extra keys into untagged event keys.
    extra_keys = kv_cache_utils.to_event_extra_keys([tagged, None])
    wire = _vllm_encoder.encode(kv_events.KVEventBatch(ts=0.0, events=[kv_events.BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
        lora_id=None, medium="GPU", lora_name=lora_name, extra_keys=extra_keys)]))
    assert ours.cache_salt_of(ours.decode_batch(wire).events[0]) == salt
