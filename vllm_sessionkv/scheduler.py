"""Scheduler half of the connector: verify remote KV, price it, export session handles.

Three additions to vLLM 0.32's NIXL pull scheduler:

* **End of turn on D** (``request_finished``): a session's blocks stay held under
  our lease (not stock's fixed 480 s), and the turn's block-hash chain is exported
  in ``kv_transfer_params["sessionkv"]`` and published out of band.  Requests
  without a session free their blocks at once.
* **Verification** (``get_num_new_matched_tokens`` / ``update_state_after_alloc``):
  remote blocks, in either direction, are attached only as far as their hashes match
  this prompt's; ``remote_block_ids`` are cut to that prefix so vLLM's end-aligned
  block pairing lands on the right blocks.
* **Pull or recompute** for D->P pulls, by the cost model in ``cost.decide_pull``
  with the live link bandwidth and engine load.
* **Synchronous reads**: a short pull from a peer already read from runs inside the
  step that computes the request (``cost.decide_sync_load``), which saves the request
  the step an asynchronous read spends waiting.
* **First-token handoff** (``first_token.py``): P exports the token it sampled; D,
  having verified P's KV for the whole prompt, continues from it instead of
  recomputing the last prompt token to sample it again.
* **Ending holds** (``holds.py``): a hold whose lease (or superseded grace) ends, and
  every hold on a reset (``reset_cache``, vLLM's ``reset_external``), is released by
  us through the worker, counted by reason; NIXL's expiry is only a backstop.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_sessionkv._vllm import engine_state, nixl_state, pacing, side_channel, version
from vllm_sessionkv._vllm import first_token as vllm_first_token
from vllm_sessionkv.config import SessionKVConfig
from vllm_sessionkv.wire.cost import LinkModel
from vllm_sessionkv.early_decode import EarlyDecodeInbox, Outcome
from vllm_sessionkv.wire.early_decode import EarlyDecodeSender
from vllm_sessionkv.first_token import handoff_refusal
from vllm_sessionkv.guard import SendLedger, decode_call, encode_answer, new_hold_token
from vllm_sessionkv.handle_channel import HandleChannel
from vllm_sessionkv.wire.hashing import encode_chain, full_blocks
from vllm_sessionkv.holds import HoldTable
from vllm_sessionkv.host_tier import HostTierManager
from vllm_sessionkv.metadata import HostCopy, HostCopyKind, StepInstructions
from vllm_sessionkv.wire.protocol import (
    EARLY_DECODE_PUSHED_KEY,
    SESSIONKV_PARAMS_KEY,
    SessionPayload,
    encode_payload,
)
from vllm_sessionkv.publisher import HandlePublisher
from vllm_sessionkv.scheduling import remote_plan
from vllm_sessionkv.scheduling.accounting import (
    account_decision,
    accounting,
    record_accounting,
)
from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.scheduling.remote_plan import D_TO_P, P_TO_D, RemotePlan
from vllm_sessionkv.scheduling.request_state import RequestState, RequestStates
from vllm_sessionkv.stats import SessionKVStats
from vllm_sessionkv.verification import LocalPrompt, Verdict

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["SessionKVScheduler"]

logger = logging.getLogger("vllm.sessionkv.scheduler")

# An engine whose only requests wait for P's parameters steps this often (it waits
# on the early-decode socket in between): held requests time out by steps.
_HELD_STEP_INTERVAL_S = 0.02

# P requests whose token a D request continued from, remembered so that a second D
# request on the same handle (``n`` > 1) samples its own.
_USED_FIRST_TOKENS_KEPT = 4096

# NIXL's own expiry of a held send comes this long after our lease ends: we release
# the hold ourselves at the lease's end (quietly; NIXL would count and log an expiry
# as a failed hand-off), so NIXL's timer fires only if our release never reached the
# worker.
_NIXL_EXPIRY_BACKSTOP_S = 5.0

class SessionKVScheduler(nixl_state.NixlPullConnectorScheduler):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config, config: SessionKVConfig):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.config = config
        nixl_state.disable_stock_recompute_threshold(self)
        self.hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
        self.pricing = Pricing(
            config.cost, engine_state.kv_bytes_per_token(kv_cache_config, self.block_size),
            host_link=LinkModel(bytes_per_s=config.host_copy_bytes_per_s,
                                per_transfer_s=config.host_copy_per_transfer_s))
        self.stats = SessionKVStats()
        self._requests = RequestStates()
        # Session holds (D): which request's blocks each session keeps, until when.
        self._holds = HoldTable()
        self._holds_to_release: set[str] = set()   # for the next step's metadata
        num_blocks = engine_state.kv_num_blocks(kv_cache_config)
        self._max_held_blocks = (int(config.session_hold_max_kv_fraction * num_blocks)
                                 if num_blocks else 1 << 62)
        self._session_holds_reported = 0   # sessionkv_session_holds, sent on change
        self._publisher = HandlePublisher(config.redis_url, config.redis_namespace)
        # And on a ZMQ channel, for proxies without Redis (handle_channel.py).
        self._handle_channel = HandleChannel.from_config(
            config, vllm_config.parallel_config.data_parallel_size)
        # The pull guard (guard.py), as holder: every finished request whose blocks
        # wait for a peer's read, with the readers' claims, answered on NIXL's side
        # channel; as reader: the hold tokens of this step's reads, for the worker.
        self._ledger: SendLedger | None = None
        self._guard_counted = (0, 0, 0)
        self._side_channel_failure = lambda: None
        if config.pull_guard:
            self._ledger = SendLedger(engine_id, config.pull_claim_ttl_s)
            self._side_channel_failure = side_channel.serve_guard_on_side_channel(
                self, self._answer_guard)
        self._read_guards_next: dict[str, int] = {}
        # Host-DRAM tier: this side decides and tracks; the worker copies.
        self.host: HostTierManager | None = None
        if config.host_tier_bytes:
            self.host = HostTierManager(config.host_tier_bytes,
                                        engine_state.kv_bytes_per_block(kv_cache_config),
                                        config.host_tier_policy)
        # Ordered copy operations for the worker's next step, and slots pinned by
        # loads, released two metadata builds later (the worker may run a step behind).
        self._host_ops: list[HostCopy] = []
        self._host_pins: list[list[list[int]]] = [[], []]
        self._host_counted = (0, 0, 0)
        # As P: pushes our parameters straight to the D holding the request.
        self._early_sender: EarlyDecodeSender | None = None
        # Synchronous reads: peers we have read from (no handshake left to wait for),
        # the reads queued for the next step's metadata and those in that step.
        # vLLM can map a failed synchronous read back to its blocks only with one KV
        # cache group.
        self._sync_reads_possible = (config.cost.sync_load_max_stall_s > 0 and
                                     len(kv_cache_config.kv_cache_groups) == 1)
        self._warm_engines: set[str] = set()
        self._sync_reads_next: set[str] = set()
        self._sync_reads_in_step: set[str] = set()
        # First-token handoff, as D: the P requests whose token was used
        # (insertion-ordered, bounded).
        self.max_model_len = vllm_config.model_config.max_model_len
        self._first_token_unsupported = (
            vllm_first_token.first_token_unsupported(vllm_config) if config.first_token_handoff
            else "turned off (first_token_handoff)")
        if config.first_token_handoff and self._first_token_unsupported:
            logger.info("sessionkv first-token handoff off on this engine: %s",
                        self._first_token_unsupported)
        self._used_first_tokens: dict[str, None] = {}
        # As D: requests sent while P prefills wait here for P's parameters.
        self.early_decode: EarlyDecodeInbox | None = None
        if config.early_decode_port:
            if vllm_config.parallel_config.data_parallel_size > 1:
                # The proxy cannot tell which rank's scheduler holds its request.
                raise ValueError("sessionkv early_decode_port does not support "
                                 "data_parallel_size > 1")
            self.early_decode = EarlyDecodeInbox(
                f"tcp://{config.early_decode_bind_host}:{config.early_decode_port}",
                config.early_decode_timeout_s)
            logger.info("sessionkv early decode: taking P's parameters on %s",
                        self.early_decode.endpoint)
            inbox = self.early_decode
            pacing.wait_for_prefill_params(lambda: inbox.waiting, inbox.wait,
                                          max_wait_s=_HELD_STEP_INTERVAL_S)
        # This runs in the engine-core process, whose loop the pacing changes.
        pacing.pace_holding_steps(config.holding_step_interval(version.is_cpu_platform()))

    def set_xfer_handshake_metadata(self, metadata) -> None:
        super().set_xfer_handshake_metadata(metadata)
        failure = self._side_channel_failure()
        if failure is not None:
            # Without its side channel no peer can handshake with or claim from this
            # engine: stop it now, saying why, rather than serve without it.
            raise RuntimeError(f"sessionkv: the NIXL side channel could not listen on "
                               f"{self.side_channel_host}:{self.side_channel_port}: "
                               f"{failure}")

    def _answer_guard(self, raw: bytes) -> bytes | None:
        """The side channel's answer to a guard call (None: not one; NIXL's own)."""
        call = decode_call(raw)
        if call is None:
            return None
        answer = self._ledger.answer(call, time.perf_counter())
        if not answer.ok:
            logger.info("sessionkv guard %s refused request_id=%s reader=%s reason=%s",
                        call.op.value, call.request_id, call.reader, answer.reason)
        return encode_answer(answer)

    # ------------------------------------------------------------------ inputs
    def _plan(self, request: Request, num_computed_tokens: int,
              state: RequestState) -> RemotePlan | None:
        params = request.kv_transfer_params
        way = remote_plan.direction(params)
        if way is None or nixl_state.remote_blocks_processed(params):
            return None
        cached = state.plan
        if cached is not None and cached.local_hit_tokens == num_computed_tokens:
            return cached
        # Asked again with a different local hit (the request waited while other
        # requests filled the prefix cache): plan afresh, or the load would start
        # past the verified prefix.
        verdict = self._verdict(request, params, way, state)
        # Decided once per request (the token becomes its first output); a re-plan
        # for a new local hit keeps the decision, since the verdict does not change.
        first_token = (cached.first_token if cached is not None
                       else way == P_TO_D and self._continue_from_first_token(
                           request, params, verdict, state))
        decision, load_tokens, pull_s, recompute_s = remote_plan.decide_load(
            verdict, way, num_computed_tokens, self.pricing)
        plan = RemotePlan(direction=way, verdict=verdict,
                          local_hit_tokens=num_computed_tokens, load_tokens=load_tokens,
                          decision=decision, pull_s=pull_s, recompute_s=recompute_s,
                          engine_load=self.pricing.engine_load, first_token=first_token,
                          remote_engine_id=str(params.get("remote_engine_id") or ""))
        self._choose_sync_read(request, plan)
        state.plan = plan
        logger.info(
            "sessionkv plan request_id=%s session_id=%s direction=%s decision=%s "
            "verify=%s verified_tokens=%d refused_tokens=%d local_hit_tokens=%d "
            "load_tokens=%d read=%s first_token=%s prompt_tokens=%d pull_s=%.6f "
            "recompute_s=%.6f load=%.2f link_bytes_per_s=%.3g",
            request.request_id, engine_state.request_session_id(request), plan.direction,
            decision, verdict.reason, verdict.verified_tokens, verdict.refused_tokens,
            num_computed_tokens, plan.load_tokens, "sync" if plan.sync else "async",
            first_token, request.num_prompt_tokens, pull_s, recompute_s,
            self.pricing.engine_load, self.pricing.link_bytes_per_s)
        return plan

    def _verdict(self, request: Request, params: dict[str, Any], way: str,
                 state: RequestState) -> Verdict:
        prompt = request.prompt_token_ids or []
        max_loadable = (nixl_state.remote_prefill_token_count(self, len(prompt))
                        if way == P_TO_D else request.num_prompt_tokens)
        read = state.read
        claim, refusal = remote_plan.remote_claim(params, read.payload, read.refusal,
                                                  read.error)
        local = LocalPrompt(prompt_token_ids=prompt, block_hashes=request.block_hashes,
                            block_size=self.block_size, hash_algo=self.hash_algo,
                            tenant=engine_state.request_cache_salt(request),
                            max_loadable_tokens=max_loadable)
        return remote_plan.judge(params, read.payload, claim, refusal, way, local,
                                 request.num_prompt_tokens, time.time(),
                                 self.config.expiry_margin_s, self.config.pull_guard)

    def _continue_from_first_token(self, request: Request, params: dict[str, Any],
                                   verdict: Verdict, state: RequestState) -> bool:
        """Continue from the token P sampled, if P sent one and the request allows
        (``first_token.handoff_refusal``); then every verified prompt token is
        loaded and D's first step starts at the token after P's."""
        token_id = state.payload.first_token_id
        if token_id is None:
            return False
        refusal = "engine_unsupported" if self._first_token_unsupported else None
        if refusal is None:
            view = vllm_first_token.first_token_request(request, self.max_model_len)
            refusal = ("engine_unsupported" if view is None
                       else handoff_refusal(view, token_id, verdict.verified_tokens))
        source = str(params.get("remote_request_id") or "")
        if refusal is None and source and source in self._used_first_tokens:
            refusal = "already_used"
        self.stats.record(f"first_token_{refusal or 'continued'}")
        if refusal is not None:
            logger.debug("sessionkv first token request_id=%s not used: %s",
                         request.request_id, refusal)
            return False
        if source:
            self._used_first_tokens[source] = None
            if len(self._used_first_tokens) > _USED_FIRST_TOKENS_KEPT:
                del self._used_first_tokens[next(iter(self._used_first_tokens))]
        vllm_first_token.continue_from_token(request, token_id)
        state.first_token_id = token_id
        return True

    def _choose_sync_read(self, request: Request, plan: RemotePlan) -> None:
        """Make the plan's read synchronous where ``cost.decide_sync_load`` says so.

        Only from a peer this engine has read from: a first read waits for a NIXL
        handshake, which no forward should wait for.  vLLM computes at least the last
        token itself (the last prompt token, or P's token after a handoff), so a
        synchronous read stops short of it."""
        if not (self._sync_reads_possible and plan.load_tokens > 0
                and plan.remote_engine_id in self._warm_engines
                and remote_plan.names_remote_blocks(request.kv_transfer_params or {})):
            # (Without a complete handle stock code queues no read, and a synchronous
            # load would run the forward on blocks nothing wrote.)
            return
        sync_tokens = min(plan.load_tokens,
                          request.num_tokens - 1 - plan.local_hit_tokens)
        if sync_tokens <= 0:
            return
        if self.pricing.sync_read(sync_tokens):
            plan.sync = True
            plan.load_tokens = sync_tokens

    # ------------------------------------------------------- scheduler hooks
    def _is_direct_session_turn(self, params: dict[str, Any],
                                payload: SessionPayload) -> bool:
        return (not params.get("do_remote_decode") and not params.get("do_remote_prefill")
                and bool(payload.session_id)
                and self.is_bidirectional_kv_xfer_enabled)

    def _early_decode_ready(self, request: Request, ours: SessionPayload) -> bool:
        """False while a D request sent before P finished still waits for P's
        parameters; once they are in (or will not come) the request carries exactly
        what it would have carried if sent after P, and goes on as such."""
        early_id = ours.early_decode_id
        if not early_id:
            return True
        if self.early_decode is None:
            outcome, p_params, waited_s = "refused", None, 0.0
            logger.warning("sessionkv early decode request_id=%s: this engine has no "
                           "early_decode_port; computing the prompt here",
                           request.request_id)
        else:
            result, p_params, waited_s = self.early_decode.poll(early_id)
            if result is Outcome.WAITING:
                return False
            outcome = result.value
        if p_params is not None:
            request.kv_transfer_params = p_params
        else:
            # D alone: what is left is a plain turn (a session's id stays, so D still
            # holds the turn for the next one).
            rest = msgspec.structs.replace(ours, early_decode_id=None)
            request.kv_transfer_params = ({SESSIONKV_PARAMS_KEY: encode_payload(rest)}
                                          if rest != SessionPayload() else None)
        self.stats.record(f"early_decode_{outcome}")
        self.stats.record("early_decode_wait_s", waited_s)
        log = logger.debug if outcome == "ready" else logger.warning
        log("sessionkv early decode request_id=%s outcome=%s waited_ms=%.1f",
            request.request_id, outcome, waited_s * 1e3)
        return True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        self.pricing.note_live(request.request_id)
        state = self._requests.of(request.request_id, request.kv_transfer_params)
        if not self._early_decode_ready(request, state.payload):
            return None, False   # vLLM asks again at the next step; no blocks held
        params = request.kv_transfer_params
        state = self._requests.of(request.request_id, params)   # P's, after early decode
        self._early_push_connect(state.payload)
        if nixl_state.remote_blocks_processed(params):
            # Asked again after a failed or declined load (vLLM resets the request to
            # recompute): stock code would claim the remote tokens once more and park
            # the request waiting for a read it never queues again.  Recompute.
            state.local_hit_tokens = num_computed_tokens
            return 0, False
        plan = self._plan(request, num_computed_tokens, state)
        if plan is None:
            state.local_hit_tokens = num_computed_tokens
            host_tokens = self._host_restore_tokens(request, num_computed_tokens, state)
            if host_tokens:
                return host_tokens, False  # a synchronous copy, done before the forward
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        if plan.direction == D_TO_P and not self.is_bidirectional_kv_xfer_enabled:
            # Stock would park the request waiting for a read it never starts (a hang).
            return 0, False
        if plan.load_tokens <= 0:
            return 0, False
        return plan.load_tokens, not plan.sync

    def _host_restore_tokens(self, request: Request, num_computed_tokens: int,
                             state: RequestState) -> int:
        """Tokens to restore from the host tier, if that beats recomputing them.

        Only for requests that bring no remote KV (plain requests and turns served on
        D directly); side-effect free except for remembering the decision."""
        state.host_plan = None
        params = request.kv_transfer_params or {}
        if self.host is None or params.get("do_remote_prefill") or \
                params.get("do_remote_decode"):
            return 0
        start_block = num_computed_tokens // self.block_size
        # vLLM computes at least the last prompt token itself.
        usable_blocks = (request.num_prompt_tokens - 1) // self.block_size - start_block
        hit_blocks = min(self.host.lookup(request.block_hashes, start_block), usable_blocks)
        if hit_blocks <= 0:
            return 0
        tokens = hit_blocks * self.block_size
        priced = self.pricing.decide(tokens, num_computed_tokens, self.pricing.host_link)
        logger.info(
            "sessionkv host request_id=%s session_id=%s decision=%s host_tokens=%d "
            "local_hit_tokens=%d restore_s=%.6f recompute_s=%.6f",
            request.request_id, engine_state.request_session_id(request),
            "restore" if priced.pull else "recompute", tokens, num_computed_tokens,
            priced.pull_s, priced.recompute_s)
        if not priced.pull:
            return 0
        state.host_plan = (start_block, hit_blocks)
        return tokens

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        state = self._requests.of(request.request_id, request.kv_transfer_params)
        host_plan, state.host_plan = state.host_plan, None
        if host_plan is not None and num_external_tokens > 0 and self.host is not None:
            start_block, num_blocks = host_plan
            slots = self.host.plan_load(request.block_hashes, start_block, num_blocks)
            dst = list(blocks.get_block_ids()[0][start_block:start_block + num_blocks])
            self._host_ops.append(HostCopy(kind=HostCopyKind.LOAD, src=list(slots), dst=dst))
            self._host_pins[-1].append(list(slots))
            state.host_restored_tokens = num_blocks * self.block_size
        plan = state.plan
        params = request.kv_transfer_params
        if plan is not None and params and not nixl_state.remote_blocks_processed(params):
            # Cut the remote list to the verified prefix *before* stock code queues the
            # read: vLLM pairs local and remote blocks from the end, so any unverified
            # remote tail would shift every pairing (vLLM issue #43094).
            verified_tokens = plan.verdict.verified_tokens
            keep_blocks = -(-verified_tokens // self.block_size)
            remote_ids = params.get("remote_block_ids") or ()
            params["remote_block_ids"] = type(remote_ids)(
                list(group)[:keep_blocks] for group in remote_ids)
            params["remote_num_tokens"] = verified_tokens
            if plan.verdict.reason == "expired_handle":
                # Nothing to read and no hold left to release: no notification either.
                params["remote_block_ids"] = None
            # With nothing to load, stock code sends D a notify-only read, which
            # releases D's hold on the blocks at once.
            account_decision(self.stats, plan)
            if num_external_tokens:
                plan.pull_started_s = time.perf_counter()
                self.stats.record("load_sync" if plan.sync else "load_async")
                token = state.payload.hold_token
                if token and self.config.pull_guard:
                    self._read_guards_next[request.request_id] = token
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            if plan.sync and num_external_tokens:
                self._queue_sync_read(request, plan, blocks)
            return
        if params and self._is_direct_session_turn(params, state.payload):
            # Served on D without P: D still holds the turn for the next P pull, and
            # the worker only honours a hold for requests it saw in a batch.
            nixl_state.mark_in_batch(self, request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _queue_sync_read(self, request: Request, plan: RemotePlan, blocks) -> None:
        if not nixl_state.has_queued_read(self, request.request_id):
            # _choose_sync_read checks the handle stock code needs to queue the read.
            raise RuntimeError(f"sessionkv: no read queued for the synchronous load of "
                               f"request {request.request_id}")
        # Destinations for every remote block left after the cut to the verified
        # prefix: vLLM pairs the lists from the end, so one block fewer here (the
        # load stops a token short, which can leave a block with only the last
        # prompt token) would shift every pairing.  The forward rewrites what the
        # read put past the loaded tokens.
        hit_blocks = plan.local_hit_tokens // self.block_size
        load_blocks = -(-plan.verdict.verified_tokens // self.block_size) - hit_blocks
        plan.sync_block_ids = frozenset(nixl_state.set_sync_recv_blocks(
            self, request.request_id, blocks.get_block_ids(), hit_blocks, load_blocks))
        # The read is done within the step: nothing left to keep alive on the peer.
        nixl_state.stop_heartbeat(self, request.request_id)
        self._sync_reads_next.add(request.request_id)

    def _take_host_ops(self) -> list[HostCopy]:
        ops, self._host_ops = self._host_ops, []
        if self.host is not None:
            for slots in self._host_pins.pop(0):
                self.host.release(slots)
            self._host_pins.append([])
        return ops

    def take_events(self) -> list:
        if self.host is None:
            return []
        return engine_state.host_tier_events(self.host.take_events())

    def build_connector_meta(self, scheduler_output):
        running = float(engine_state.scheduled_requests(scheduler_output))
        self.pricing.observe_step(running)
        vllm_first_token.show_first_tokens_to_worker(scheduler_output,
                                                     self._requests.first_tokens())
        meta = super().build_connector_meta(scheduler_output)
        instructions = StepInstructions(
            host_copies=self._take_host_ops(), release_holds=self._take_hold_releases(),
            sync_loads=self._sync_reads_next,
            # The worker may wait for its reads only when it has no model to run.
            idle_step=running == 0,
            read_guards=self._read_guards_next,
            report_sent=(self._ledger.take_releasable(time.perf_counter())
                         if self._ledger is not None else set()))
        self._read_guards_next = {}
        self._sync_reads_in_step |= self._sync_reads_next
        self._sync_reads_next = set()
        nixl_state.attach_step_instructions(meta, instructions)
        # This process and the worker spin on their queues only when it has a model
        # to run (the worker learns it from ``idle_step``).
        pacing.set_engine_busy(running > 0)
        return meta

    def update_connector_output(self, connector_output) -> None:
        sending = getattr(connector_output, "finished_sending", None)
        if sending and self._ledger is not None:
            # Sends a reader's claim stands on are not freed yet (guard.py); the
            # worker reports them again once the claim ends.
            free_now = self._ledger.gate(sending, time.perf_counter())
            if len(free_now) != len(sending):
                connector_output.finished_sending = free_now
        stats = getattr(connector_output, "kv_connector_stats", None)
        data = getattr(stats, "data", None) or {}
        self.pricing.observe_transfers(data.get("bytes_transferred", ()),
                                       data.get("transfer_duration", ()))
        failed = getattr(connector_output, "failed_recving", None) or set()
        # A synchronous read is done by the end of its step and never reported
        # received; a failed one comes back as invalid blocks (vLLM recomputes them).
        received = getattr(connector_output, "finished_recving", None) or set()
        for req_id in received | self._sync_reads_in_step:
            plan = self._plan_of(req_id)
            if plan is not None and plan.pull_started_s:
                plan.pull_ms = (time.perf_counter() - plan.pull_started_s) * 1e3
                if req_id in received and req_id not in failed and plan.remote_engine_id:
                    self._warm_engines.add(plan.remote_engine_id)
        self._sync_reads_in_step.clear()
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            for req_id, plan in self._requests.planned():
                if plan.sync and not plan.failed and not plan.sync_block_ids.isdisjoint(
                        invalid):
                    self._pull_failed(req_id, plan)
        for req_id in getattr(connector_output, "finished_sending", None) or ():
            reason = self._holds.released(req_id)
            if reason is not None:
                self._holds_to_release.discard(req_id)
                self.stats.record(f"session_holds_released_{reason}")
                logger.debug("sessionkv hold released request_id=%s reason=%s", req_id,
                             reason)
        for req_id in failed:
            self._pull_failed(req_id, self._plan_of(req_id))
        super().update_connector_output(connector_output)

    def _plan_of(self, request_id: str) -> RemotePlan | None:
        state = self._requests.get(request_id)
        return state.plan if state is not None else None

    def _pull_failed(self, req_id: str, plan: RemotePlan | None) -> None:
        self.stats.record("pull_failed")
        if plan is not None:
            plan.failed = True
            # Read asynchronously from it again until a read succeeds.
            self._warm_engines.discard(plan.remote_engine_id)
        logger.warning("sessionkv pull failed request_id=%s read=%s; recomputing", req_id,
                       "sync" if plan is not None and plan.sync else "async")

    def request_finished(self, request: Request, block_ids):
        self.pricing.finished(request.request_id)
        params = request.kv_transfer_params
        state = self._requests.of(request.request_id, params)
        self._requests.pop(request.request_id)
        if state.first_token_id is not None:
            vllm_first_token.forget_first_token(request.request_id)
        payload = state.payload
        if payload.early_decode_id and self.early_decode is not None:
            self.early_decode.forget(payload.early_decode_id)   # aborted while waiting for P
        acct = None
        if state.plan is not None or state.local_hit_tokens is not None:
            acct = accounting(request.num_prompt_tokens, state.plan,
                              state.local_hit_tokens or 0, state.host_restored_tokens,
                              self.pricing.kv_bytes_per_token)
            record_accounting(self.stats, acct)
        is_d_node = bool(params) and not params.get("do_remote_decode")
        delay_free, out = super().request_finished(request, block_ids)
        if out is None:
            return delay_free, out
        session_id = engine_state.request_session_id(request) or payload.session_id
        if is_d_node:
            if not session_id or not delay_free:
                # Nothing will come back for these blocks by handle; free them now
                # (prefix caching still keeps them findable until evicted).
                if delay_free:
                    nixl_state.cancel_pending_send(self, request.request_id)
                return False, ({SESSIONKV_PARAMS_KEY: encode_payload(
                    SessionPayload(accounting=acct))} if acct else None)
            lease_s = self.config.session_lease_s
            nixl_state.set_pending_send_deadline(self, request.request_id,
                                            lease_s + _NIXL_EXPIRY_BACKSTOP_S)
            now = time.perf_counter()
            deadline = now + lease_s
            self._holds.hold(session_id, request.request_id, until_s=deadline,
                             superseded_until_s=now + self.config.superseded_hold_grace_s,
                             num_blocks=len(block_ids[0]) if block_ids else 0)
            self._offload_to_host(request, block_ids, out["remote_num_tokens"])
            for req_id in self._holds.over_cap(self._max_held_blocks, keep=request.request_id):
                logger.info("sessionkv hold ends early request_id=%s reason=kv_pressure "
                            "(holds over %.0f%% of the KV blocks)", req_id,
                            self.config.session_hold_max_kv_fraction * 100)
                self._holds_to_release.add(req_id)
            out["remote_blocks_expiry_time"] = deadline
            out[SESSIONKV_PARAMS_KEY] = encode_payload(SessionPayload(
                **self._chain_export(request, out["remote_num_tokens"]),
                session_id=session_id, accounting=acct,
                expires_at_unix_s=nixl_state.pending_send_deadline_unix_s(deadline),
                engine_url=self.config.advertise_url or None,
                hold_token=self._guard_hold(request.request_id)))
            if self._publisher.publish(session_id, out, self.config.session_lease_s):
                self.stats.record("session_handles_published")
            if self._handle_channel is not None:
                self.stats.record("session_handles_sent" if self._handle_channel.publish(out)
                                  else "session_handles_publish_failed")
        else:
            # P end of turn: export the chain so D verifies what it pulls from us too,
            # and the token we sampled, for D to continue from.
            first_token_id = (request.output_token_ids[0]
                              if (self.config.first_token_handoff
                                  and request.output_token_ids and payload.first_token)
                              else None)
            out[SESSIONKV_PARAMS_KEY] = encode_payload(SessionPayload(
                **self._chain_export(request, out.get("remote_num_tokens") or 0),
                session_id=session_id or None, accounting=acct,
                first_token_id=first_token_id,
                hold_token=self._guard_hold(request.request_id) if delay_free else 0))
            self._push_to_early_decode(payload, out)
        return delay_free, out

    def _guard_hold(self, request_id: str) -> int:
        """A token for the blocks this finished request leaves held for a peer's
        read, registered with the guard's ledger (0 with the guard off)."""
        if self._ledger is None:
            return 0
        token = new_hold_token()
        self._ledger.add(request_id, token)
        return token

    def _early_push_target(self, payload: SessionPayload) -> tuple[str, str] | None:
        """(D's endpoint, id) a P request asks us to push our parameters to."""
        push = payload.early_decode_push
        if push is None:
            return None
        endpoint, early_id = push.endpoint, push.id
        if not (endpoint.startswith("tcp://") and early_id):
            return None
        if self._early_sender is None:
            self._early_sender = EarlyDecodeSender()
        return endpoint, early_id

    def _early_push_connect(self, payload: SessionPayload) -> None:
        # While P prefills, so the push at the end finds the connection up.
        target = self._early_push_target(payload)
        if target is not None:
            self._early_sender.connect(target[0])

    def _push_to_early_decode(self, payload: SessionPayload, out: dict[str, Any]) -> None:
        """Early decode: hand our parameters to the D holding the request now, not
        after they travel back through our API server and the proxy.  The proxy
        pushes them itself unless our answer says this push went out."""
        target = self._early_push_target(payload)
        if target is None:
            return
        endpoint, early_id = target
        if self._early_sender.send(endpoint, early_id, out):
            out[SESSIONKV_PARAMS_KEY][EARLY_DECODE_PUSHED_KEY] = True
            self.stats.record("early_decode_pushed_by_prefill")

    def _offload_to_host(self, request: Request, block_ids, num_tokens: int) -> None:
        """Copy a finished session turn's full blocks (prompt and generated) to host
        DRAM.  The blocks stay held on device until the copy has run: the hold's lease
        outlives the next step, when the worker executes it."""
        if self.host is None:
            return
        n_full = min(full_blocks(num_tokens, self.block_size), len(request.block_hashes))
        hashes = list(request.block_hashes[:n_full])
        position = {h: i for i, h in enumerate(hashes)}
        pairs = self.host.plan_store(hashes)
        if not pairs:
            return
        group = list(block_ids[0])
        src = [group[position[h]] for h, _ in pairs]
        self._host_ops.append(HostCopy(kind=HostCopyKind.STORE, src=src,
                                       dst=[slot for _, slot in pairs]))

    def _take_hold_releases(self) -> set[str]:
        """Holds the worker is to release in this step: those whose lease (or, once
        superseded, grace) ended, and those a reset dropped.

        A lease ends at the deadline published in the handle; P refuses a handle
        within ``expiry_margin_s`` of it and vLLM's reader declines a read within 5 s
        of it, so no pull of these blocks starts this late."""
        now = time.perf_counter()
        due = self._holds.due(now)
        for req_id, reason in due.items():
            logger.debug("sessionkv hold ends request_id=%s reason=%s", req_id, reason)
        self._holds_to_release.update(due)
        if self._ledger is None:
            releases, self._holds_to_release = self._holds_to_release, set()
            return releases
        # No new claims on them; a hold a reader's claim stands on ends after it.
        self._ledger.mark_ending(self._holds_to_release)
        releases = {r for r in self._holds_to_release if not self._ledger.claimed(r, now)}
        self._holds_to_release -= releases
        return releases

    def reset_cache(self) -> bool:
        """Drop every session hold (vLLM calls this for ``reset_prefix_cache`` with
        ``reset_external``), and empty the host tier.

        vLLM resets its block pool *before* it asks the connector, and our holds pin
        blocks until the worker has released them in the next step: the call that
        drops the holds still reports failure; one after that step succeeds."""
        dropped = self._holds.end_all("reset")
        self._holds_to_release.update(dropped)
        host_blocks = 0
        if self.host is not None:
            host_blocks = len(self.host.discard_all())
            self.stats.record("host_resident_bytes", self.host.resident_bytes)
        if dropped or host_blocks:
            logger.info("sessionkv reset: releasing %d session hold(s), dropped %d host-tier "
                        "block(s)", len(dropped), host_blocks)
        return True

    def _chain_export(self, request: Request, num_tokens: int) -> dict[str, Any]:
        """Hash chain + partial-block tokens of the first ``num_tokens`` tokens, as
        ``SessionPayload`` fields."""
        n_full = full_blocks(num_tokens, self.block_size)
        hashes = list(request.block_hashes[:n_full])
        # A hash may not exist yet for a block whose tokens all arrived this step.
        n_full = len(hashes)
        all_tokens = request.all_token_ids
        tail = list(all_tokens[n_full * self.block_size:num_tokens])
        return {"hash_chain": encode_chain(hashes), "tail_token_ids": tail,
                "block_size": self.block_size, "hash_algo": self.hash_algo,
                "tenant": engine_state.request_cache_salt(request), "num_tokens": num_tokens}

    def _record_growth(self, keys: tuple[str, ...], counted: tuple[int, ...],
                       before: tuple[int, ...]) -> tuple[int, ...]:
        """Record how far each running total grew since ``before``; returns ``counted``
        (the next call's ``before``)."""
        for key, now, then in zip(keys, counted, before):
            if now > then:
                self.stats.record(key, now - then)
        return counted

    def take_stats(self) -> SessionKVStats | None:
        if self.host is not None:
            counted = (self.host.stores_total_blocks, self.host.loads_total_blocks,
                       self.host.evictions_total_blocks)
            if counted != self._host_counted:
                self.stats.record("host_resident_bytes", self.host.resident_bytes)
            self._host_counted = self._record_growth(
                ("host_offloaded_blocks", "host_restored_blocks", "host_evicted_blocks"),
                counted, self._host_counted)
        if self._holds.sessions != self._session_holds_reported:
            self._session_holds_reported = self._holds.sessions
            self.stats.record("session_holds", self._session_holds_reported)
        if self._ledger is not None:
            self._guard_counted = self._record_growth(
                ("guard_claims_granted", "guard_claims_refused", "guard_frees_deferred"),
                (self._ledger.claims_granted, self._ledger.claims_refused,
                 self._ledger.frees_deferred), self._guard_counted)
        publish_failures = self._publisher.take_failures()
        if publish_failures:
            self.stats.record("session_handles_publish_failed", publish_failures)
        if self.stats.is_empty():
            return None
        return self.stats.clone_and_reset()

    def shutdown(self):
        self._publisher.close()
        if self._handle_channel is not None:
            self._handle_channel.close()
        if self.early_decode is not None:
            self.early_decode.close()
        if self._early_sender is not None:
            self._early_sender.close()
        super().shutdown()
