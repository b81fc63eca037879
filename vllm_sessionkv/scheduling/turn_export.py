"""End of turn: what a finished request leaves in ``kv_transfer_params["sessionkv"]``
for the next reader of its KV.

* **P** exports its hash chain, so that D verifies what it pulls from P as P verifies
  what it pulls from D, and the token it sampled, for D to continue from; it pushes
  them to D itself when the request was sent there early (``early_decode``).
* **D**, for a session turn, holds the blocks under the retention rule's lease
  (``session_holds``), copies them to host DRAM (``host_restore``), and exports and
  publishes the handle, with the token the pull guard checks (``guard_ledger``).
* **D**, for a turn without a session (or with no blocks to hold), exports its
  accounting alone, and its blocks are freed at once.

The chain is the contract every reader checks (verification, the proxy's routing),
so one place builds it, from plain values: the dispatcher reads vLLM's request into
a ``FinishedTurn`` and hands in, as callables, what sets and undoes NIXL's held sends
(``_vllm/nixl_state.py``).  Each export returns the parameters to answer with; what
NIXL returned is left as it was."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from vllm_sessionkv.retention import HoldFacts
from vllm_sessionkv.scheduling.counters import StatsSink
from vllm_sessionkv.scheduling.early_decode import EarlyDecode
from vllm_sessionkv.scheduling.first_token import FirstTokenHandoff
from vllm_sessionkv.scheduling.guard_ledger import GuardLedger
from vllm_sessionkv.scheduling.host_restore import HostRestore
from vllm_sessionkv.scheduling.session_holds import SessionHolds
from vllm_sessionkv.wire.hashing import encode_chain, full_blocks
from vllm_sessionkv.wire.protocol import (
    SESSIONKV_PARAMS_KEY,
    SessionPayload,
    TokenAccounting,
    encode_payload,
)

__all__ = ["ChainIdentity", "FinishedTurn", "TurnExport", "accounting_only",
           "chain_fields", "held_blocks"]

logger = logging.getLogger("vllm.sessionkv.scheduler")

# NIXL's own expiry of a held send comes this long after our lease ends: we release
# the hold ourselves at the lease's end (quietly; NIXL would count and log an expiry
# as a failed hand-off), so NIXL's timer fires only if our release never reached the
# worker.
_NIXL_EXPIRY_BACKSTOP_S = 5.0


@dataclasses.dataclass(frozen=True)
class ChainIdentity:
    """What a reader checks besides the hashes: how this engine hashed its blocks and
    what its KV stands for (the same for every request)."""

    block_size: int
    hash_algo: str
    hash_tokens: int    # tokens per block hash
    model_id: str


@dataclasses.dataclass(frozen=True)
class FinishedTurn:
    """One finished request as its export reads it (vLLM's ``Request``, read by the
    dispatcher, and what the scheduler half decided for it)."""

    request_id: str
    session_id: str | None
    payload: SessionPayload              # what the request arrived with
    accounting: TokenAccounting | None
    block_hashes: Sequence[Any]
    all_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    tenant: str | None                   # the cache salt
    # Keys beyond its tokens in its block hashes (LoRA, multimodal inputs, prompt
    # embeddings): a partial block's KV then depends on more than its tokens.
    has_extra_keys: bool
    hold_hint_s: float | None


def held_blocks(out: dict[str, Any]) -> list[int]:
    """The blocks a handle names (first KV cache group): what a reader reads."""
    groups = out.get("remote_block_ids") or ()
    return list(groups[0]) if groups else []


def chain_fields(turn: FinishedTurn, num_tokens: int, engine: ChainIdentity
                 ) -> dict[str, Any]:
    """Hash chain + partial-block tokens of the first ``num_tokens`` tokens, as
    ``SessionPayload`` fields."""
    n_full = full_blocks(num_tokens, engine.hash_tokens)
    hashes = list(turn.block_hashes[:n_full])
    # A hash may not exist yet for a unit whose tokens all arrived this step.
    n_full = len(hashes)
    # The partial unit's KV depends on keys beyond its tokens when the request has
    # any: claim full units only.
    tail = [] if turn.has_extra_keys else list(
        turn.all_token_ids[n_full * engine.hash_tokens:num_tokens])
    return {"hash_chain": encode_chain(hashes), "tail_token_ids": tail,
            "block_size": engine.block_size, "hash_algo": engine.hash_algo,
            "hash_tokens": engine.hash_tokens, "model_id": engine.model_id,
            "tenant": turn.tenant, "num_tokens": n_full * engine.hash_tokens + len(tail)}


def accounting_only(acct: TokenAccounting | None) -> dict[str, Any] | None:
    """The parameters of a turn on D that leaves nothing held: its accounting, if any."""
    return {SESSIONKV_PARAMS_KEY: encode_payload(SessionPayload(accounting=acct))} \
        if acct else None


class TurnExport:
    def __init__(self, engine: ChainIdentity, holds: SessionHolds, guard: GuardLedger,
                 first_token: FirstTokenHandoff, early: EarlyDecode,
                 host: HostRestore | None, *, kv_bytes_per_token: float,
                 superseded_hold_grace_s: float, engine_url: str | None,
                 engine_epoch: int, set_send_deadline: Callable[[str, float], Any],
                 cancel_send: Callable[[str], None],
                 deadline_unix_s: Callable[[float], float]) -> None:
        self.engine = engine
        self._holds = holds
        self._guard = guard
        self._first_token = first_token
        self._early = early
        self._host = host
        self._kv_bytes_per_token = kv_bytes_per_token
        self._grace_s = superseded_hold_grace_s
        self._engine_url = engine_url
        self._epoch = engine_epoch
        # NIXL's held sends, through the dispatcher: a send's timer (request id,
        # seconds from now), a send undone, a perf_counter deadline in unix seconds.
        self._set_send_deadline = set_send_deadline
        self._cancel_send = cancel_send
        self._deadline_unix_s = deadline_unix_s

    def finished(self, turn: FinishedTurn, on_decode: bool, delay_free: bool,
                 block_ids: Sequence[Sequence[int]], out: dict[str, Any], now_s: float,
                 stats: StatsSink) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's answer for a finished request NIXL exports parameters for (``out``):
        whether its blocks stay allocated, and the parameters.  ``on_decode``: this
        engine decoded it (D, or a turn served on D alone), not prefilled it for D."""
        if not on_decode:
            return delay_free, self.prefill(turn, delay_free, out, stats)
        if not turn.session_id or not delay_free:
            # Nothing will come back for these blocks by handle; free them now
            # (prefix caching still keeps them findable until evicted).
            if delay_free:
                self._cancel_send(turn.request_id)
            return False, accounting_only(turn.accounting)
        return delay_free, self.hold(turn, block_ids, out, now_s, stats)

    def prefill(self, turn: FinishedTurn, delay_free: bool, out: dict[str, Any],
                stats: StatsSink) -> dict[str, Any]:
        """P's end of turn: export the chain so D verifies what it pulls from us too,
        and the token we sampled, for D to continue from; push it all to D when the
        request was sent there early."""
        exported = {**out, SESSIONKV_PARAMS_KEY: encode_payload(SessionPayload(
            **chain_fields(turn, out.get("remote_num_tokens") or 0, self.engine),
            session_id=turn.session_id or None, accounting=turn.accounting,
            first_token_id=self._first_token.exported(turn.output_token_ids,
                                                       turn.payload.first_token),
            hold_token=(self._guard.hold_token(turn.request_id, held_blocks(out))
                        if delay_free else 0)))}
        self._early.push(turn.payload, exported, stats)
        return exported

    def hold(self, turn: FinishedTurn, block_ids: Sequence[Sequence[int]],
             out: dict[str, Any], now_s: float, stats: StatsSink) -> dict[str, Any]:
        """D's end of a session turn (``turn.session_id`` set): hold its blocks for
        the next turn's pull under the retention rule's lease, offload them to host
        DRAM, export and publish the handle."""
        session_id = turn.session_id
        lease, history = self._holds.lease(session_id, turn.hold_hint_s)
        lease_s = lease.lease_s
        self._set_send_deadline(turn.request_id, lease_s + _NIXL_EXPIRY_BACKSTOP_S)
        num_tokens = out["remote_num_tokens"]
        demote = None
        if self._host is not None:
            hashes, ids = list(turn.block_hashes), list(block_ids[0])
            self._host.offload(hashes, ids, num_tokens)
            # Should the hold end unread, its KV goes to host first (retention "value").
            demote = functools.partial(self._host.offload, hashes, ids, num_tokens)
        facts = HoldFacts(request_id=turn.request_id, started_s=now_s, lease=lease,
                          history=history, held_tokens=num_tokens,
                          held_bytes=int(num_tokens * self._kv_bytes_per_token))
        deadline = self._holds.hold(session_id, turn.request_id, now_s, lease_s,
                                    self._grace_s, len(block_ids[0]) if block_ids else 0,
                                    facts=facts, demote=demote,
                                    block_ids=[b for group in block_ids for b in group])
        logger.debug("sessionkv hold request_id=%s session_id=%s lease_s=%.1f source=%s "
                     "gaps=%d hint_s=%s", turn.request_id, session_id, lease_s,
                     lease.source.value, len(history.gaps_s), turn.hold_hint_s)
        exported = {**out, "remote_blocks_expiry_time": deadline,
                    SESSIONKV_PARAMS_KEY: encode_payload(SessionPayload(
                        **chain_fields(turn, num_tokens, self.engine),
                        session_id=session_id, accounting=turn.accounting,
                        expires_at_unix_s=self._deadline_unix_s(deadline),
                        engine_url=self._engine_url, engine_epoch=self._epoch,
                        hold_token=self._guard.hold_token(turn.request_id,
                                                          held_blocks(out))))}
        self._holds.publish(session_id, exported, lease_s, stats, turn.request_id)
        return exported
