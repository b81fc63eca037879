"""The end-of-turn export as the scheduler drives it, on plain data: the chain a
finished turn exports, P's answer, D's held session turn and a turn D frees."""

from __future__ import annotations

import itertools

from vllm_sessionkv.publisher import HandlePublisher
from vllm_sessionkv.scheduling.early_decode import EarlyDecode
from vllm_sessionkv.scheduling.first_token import FirstTokenHandoff
from vllm_sessionkv.scheduling.guard_ledger import GuardLedger
from vllm_sessionkv.scheduling.session_holds import SessionHolds
from vllm_sessionkv.scheduling.turn_export import (
    ChainIdentity,
    FinishedTurn,
    TurnExport,
    chain_fields,
)
from vllm_sessionkv.wire.hashing import decode_chain
from vllm_sessionkv.wire.protocol import (
    SESSIONKV_PARAMS_KEY,
    SessionPayload,
    TokenAccounting,
    payload_from_params,
)

ENGINE = ChainIdentity(block_size=4, hash_algo="sha256", hash_tokens=4, model_id="m")
HASHES = [bytes([i]) * 8 for i in range(1, 4)]


class Stats:
    def record(self, key: str, value: int | float = 1) -> None:
        pass


def turn(session_id: str | None = "s", hashes=HASHES, extra_keys: bool = False,
         acct: TokenAccounting | None = None) -> FinishedTurn:
    return FinishedTurn(request_id="r", session_id=session_id, payload=SessionPayload(),
                        accounting=acct, block_hashes=hashes, all_token_ids=list(range(14)),
                        output_token_ids=[12, 13], tenant=None, has_extra_keys=extra_keys,
                        hold_hint_s=None)


def export(calls: list) -> TurnExport:
    tokens = itertools.count(7)
    return TurnExport(
        ENGINE, SessionHolds(100, 0.5, HandlePublisher(None)),
        GuardLedger("D", True, claim_ttl_s=5.0, new_token=lambda: next(tokens)),
        FirstTokenHandoff(True, None), EarlyDecode(None), None, kv_bytes_per_token=2.0,
        superseded_hold_grace_s=1.0, engine_url="http://d", engine_epoch=3,
        set_send_deadline=lambda rid, ttl_s: calls.append(("deadline", rid, ttl_s)),
        cancel_send=lambda rid: calls.append(("cancel", rid)),
        deadline_unix_s=lambda deadline: 1000.0 + deadline)


def test_the_chain_covers_full_blocks_with_hashes_and_the_tail_their_tokens():
    fields = chain_fields(turn(), 14, ENGINE)
    assert decode_chain(fields["hash_chain"]) == HASHES
    assert fields["tail_token_ids"] == [12, 13] and fields["num_tokens"] == 14
    # No hash yet for the third block: its tokens travel as the tail.
    fields = chain_fields(turn(hashes=HASHES[:2]), 12, ENGINE)
    assert fields["tail_token_ids"] == [8, 9, 10, 11] and fields["num_tokens"] == 12
    # Keys beyond the tokens (LoRA, multimodal): full blocks only.
    fields = chain_fields(turn(extra_keys=True), 14, ENGINE)
    assert fields["tail_token_ids"] == [] and fields["num_tokens"] == 12


def test_p_exports_its_chain_and_token_and_leaves_nixls_answer_as_it_was():
    calls: list = []
    out = {"remote_block_ids": ([5, 6, 7, 8],), "remote_num_tokens": 13}
    delay_free, params = export(calls).finished(turn(), False, True, ([5, 6, 7, 8],), out,
                                                0.0, Stats())
    payload = payload_from_params(params)
    assert delay_free and SESSIONKV_PARAMS_KEY not in out and calls == []
    assert payload.first_token_id == 12 and payload.hold_token == 7
    assert payload.num_tokens == 13 and payload.session_id == "s"


def test_d_holds_a_session_turn_and_frees_one_without_a_session():
    calls: list = []
    exporter, acct = export(calls), TokenAccounting(prompt_tokens=10)
    out = {"remote_block_ids": ([5, 6, 7, 8],), "remote_num_tokens": 13,
           "remote_blocks_expiry_time": None}
    delay_free, params = exporter.finished(turn(acct=acct), True, True, ([5, 6, 7, 8],),
                                           out, 50.0, Stats())
    payload = payload_from_params(params)
    assert delay_free and calls[0][:2] == ("deadline", "r")
    assert params["remote_blocks_expiry_time"] > 50.0 and out["remote_blocks_expiry_time"] is None
    assert payload.expires_at_unix_s == 1000.0 + params["remote_blocks_expiry_time"]
    assert payload.engine_url == "http://d" and payload.engine_epoch == 3
    assert payload.accounting == acct and payload.hold_token == 7
    delay_free, params = exporter.finished(turn(session_id=None, acct=acct), True, True,
                                           ([5, 6, 7, 8],), out, 60.0, Stats())
    assert not delay_free and calls[-1] == ("cancel", "r")
    assert payload_from_params(params) == SessionPayload(accounting=acct)
