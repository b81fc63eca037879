"""Scheduler half of the connector: vLLM 0.32's NIXL pull scheduler with our hooks.

Each hook dispatches to the components in ``scheduling/`` (one idea a module, each
tested on plain data); this class holds them, asks vLLM through ``_vllm/``, and keeps
each request's state in one ``RequestState`` (its payload decoded once):

* **Verification and pricing** (``get_num_new_matched_tokens`` /
  ``update_state_after_alloc``): remote blocks, in either direction, attach only as far
  as their hashes match this prompt's (``remote_plan``); ``remote_block_ids`` are cut
  to that prefix so vLLM's end-aligned block pairing lands on the right blocks; a
  D->P pull happens only if cheaper than recomputing (``pricing``), synchronously
  when short (``sync_reads``), its blocks out of the prefix cache until the read is
  seen good (``sync_read_quarantine``); a plain request may restore from host DRAM
  instead (``host_restore``).
* **End of turn** (``request_finished``, ``turn_export``): the turn's hash chain is
  exported in ``kv_transfer_params["sessionkv"]``; on D a session's blocks stay held
  under our lease (``session_holds``), the handle published out of band with a token
  the pull guard checks (``guard_ledger``); requests without a session free at once.
* **Admission on D** (``admission``): holds end for a request vLLM finds no blocks for.
* **First-token handoff** (``first_token``) and **early decode** (``early_decode``).
* **Accounting** (``accounting``): where each prompt token came from.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from vllm_sessionkv._vllm import (
    arrivals,
    engine_state,
    nixl_state,
    pacing,
    prefix_cache,
    side_channel,
    version,
)
from vllm_sessionkv._vllm import first_token as vllm_first_token
from vllm_sessionkv.config import SessionKVConfig
from vllm_sessionkv.disk_tier import DiskTierIndex
from vllm_sessionkv.early_decode import EarlyDecodeInbox
from vllm_sessionkv.handle_channel import HandleChannel
from vllm_sessionkv.host_tier import HostTierManager
from vllm_sessionkv.metadata import StepInstructions
from vllm_sessionkv.publisher import HandlePublisher
from vllm_sessionkv.scheduling import remote_plan
from vllm_sessionkv.scheduling.accounting import (
    account_decision,
    accounting,
    record_accounting,
)
from vllm_sessionkv.scheduling.admission import Admission
from vllm_sessionkv.scheduling.early_decode import EarlyDecode
from vllm_sessionkv.scheduling.first_token import FirstTokenHandoff
from vllm_sessionkv.scheduling.guard_ledger import GuardLedger
from vllm_sessionkv.scheduling.host_restore import HostRestore
from vllm_sessionkv.scheduling.pricing import Pricing
from vllm_sessionkv.scheduling.remote_plan import D_TO_P, P_TO_D, RemotePlan
from vllm_sessionkv.scheduling.request_state import RequestState, RequestStates
from vllm_sessionkv.scheduling.session_holds import SessionHolds
from vllm_sessionkv.scheduling.sync_read_quarantine import SyncReadQuarantine
from vllm_sessionkv.scheduling.sync_reads import SyncReads
from vllm_sessionkv.scheduling.turn_export import ChainIdentity, FinishedTurn, TurnExport
from vllm_sessionkv.stats import SessionKVStats
from vllm_sessionkv.verification import LocalPrompt, Verdict
from vllm_sessionkv.wire.cost import LinkModel
from vllm_sessionkv.wire.protocol import SessionPayload

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["SessionKVScheduler"]

logger = logging.getLogger("vllm.sessionkv.scheduler")

# An engine whose only requests wait for P's parameters steps this often (it waits
# on the early-decode socket in between): held requests time out by steps.
_HELD_STEP_INTERVAL_S = 0.02


class SessionKVScheduler(nixl_state.NixlPullConnectorScheduler):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config, config: SessionKVConfig):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.config = config
        nixl_state.disable_stock_recompute_threshold(self)
        self.hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
        # Tokens per Request.block_hashes entry (the connector refuses engines where
        # it differs from the block size; verification still counts in it).
        self.hash_tokens = engine_state.kv_hash_tokens(kv_cache_config, self.block_size)
        self.model_id = engine_state.model_identity(vllm_config)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.stats = SessionKVStats()
        self._requests = RequestStates()
        self.pricing = Pricing(
            config.cost, engine_state.kv_bytes_per_token(kv_cache_config, self.block_size),
            host_link=LinkModel(bytes_per_s=config.host_copy_bytes_per_s,
                                per_transfer_s=config.host_copy_per_transfer_s))
        # The gauges start at the prices in force (prior or pinned).
        self.stats.record("recompute_s_per_token", self.pricing.recompute_model.s_per_token)
        self.stats.record("link_bytes_per_s", self.pricing.link_bytes_per_s)
        num_blocks = engine_state.kv_num_blocks(kv_cache_config)
        self._holds = SessionHolds(
            int(config.session_hold_max_kv_fraction * num_blocks) if num_blocks else 1 << 62,
            config.session_hold_max_kv_fraction,
            HandlePublisher(config.redis_url, config.redis_namespace),
            # And on a ZMQ channel, for proxies without Redis (handle_channel.py).
            HandleChannel.from_config(config, vllm_config.parallel_config.data_parallel_size),
            withdraw=config.withdraw_handles, retention=config.retention_params(),
            recompute=lambda: self.pricing.recompute_model,
            gap_history=config.retention_gap_history,
            max_sessions=config.retention_max_sessions)
        self._admission = Admission(self._holds, self.block_size)
        # This process's start (unix ns), in every handle: a proxy that has seen a
        # later start of this engine's URL drops older handles (session_holds.py).
        self._epoch = time.time_ns() if config.withdraw_handles else 0
        self._holds.announce(config.advertise_url or "", self._epoch)
        self._guard = GuardLedger(
            engine_id, config.pull_guard, config.pull_claim_ttl_s,
            digests=config.kv_digest_active(len(kv_cache_config.kv_cache_groups)))
        self._side_channel_failure = lambda: None
        if self._guard.enabled:
            self._side_channel_failure = side_channel.serve_guard_on_side_channel(
                self, lambda raw: self._guard.answer(raw, time.perf_counter()))
        self.host: HostRestore | None = None
        if config.host_tier_bytes:
            block_bytes = engine_state.kv_bytes_per_block(kv_cache_config)
            disk = None
            if config.disk_tier_bytes:
                disk = DiskTierIndex(config.disk_tier_dir, config.disk_tier_bytes,
                                     block_bytes,
                                     ranks=vllm_config.parallel_config.world_size)
            self.host = HostRestore(
                HostTierManager(config.host_tier_bytes, block_bytes, config.host_tier_policy),
                self.block_size, disk,
                LinkModel(bytes_per_s=config.disk_read_bytes_per_s,
                          per_transfer_s=config.disk_read_per_transfer_s))
        self._sync_reads = SyncReads(config.cost.sync_load_max_stall_s > 0 and
                                     len(kv_cache_config.kv_cache_groups) == 1)
        self._quarantine: SyncReadQuarantine[Request] = SyncReadQuarantine(
            config.sync_read_quarantine)
        self._first_token = FirstTokenHandoff(
            config.first_token_handoff,
            vllm_first_token.first_token_unsupported(vllm_config)
            if config.first_token_handoff else None)
        self._early = EarlyDecode(self._early_decode_inbox(vllm_config, config),
                                  config.side_port_secret)
        if self._early.inbox is not None:
            # A turn sent early marks its session's hold awaited when it arrives.
            arrivals.on_request_added(self._request_arrived)
        self._export = TurnExport(
            ChainIdentity(self.block_size, self.hash_algo, self.hash_tokens, self.model_id),
            self._holds, self._guard, self._first_token, self._early, self.host,
            kv_bytes_per_token=self.pricing.kv_bytes_per_token,
            superseded_hold_grace_s=config.superseded_hold_grace_s,
            engine_url=config.advertise_url or None, engine_epoch=self._epoch,
            set_send_deadline=functools.partial(nixl_state.set_pending_send_deadline, self),
            cancel_send=functools.partial(nixl_state.cancel_pending_send, self),
            deadline_unix_s=nixl_state.pending_send_deadline_unix_s)
        # vLLM's KV cache manager, bound after construction (``bind_kv_cache_manager``).
        self._kv_cache_manager = None
        # This runs in the engine-core process, whose loop the pacing changes.
        # A hold just begun is digested in the worker's next step, and a reader's
        # confirm waits for that digest: such a step is not put off.
        pacing.pace_holding_steps(config.holding_step_interval(version.is_cpu_platform()),
                                  self._guard.has_holds_started)

    @staticmethod
    def _early_decode_inbox(vllm_config, config: SessionKVConfig) -> EarlyDecodeInbox | None:
        """As D: requests sent while P prefills wait here for P's parameters."""
        if not config.early_decode_port:
            return None
        if vllm_config.parallel_config.data_parallel_size > 1:
            # The proxy cannot tell which rank's scheduler holds its request.
            raise ValueError("sessionkv early_decode_port does not support "
                             "data_parallel_size > 1")
        inbox = EarlyDecodeInbox(
            f"tcp://{config.early_decode_bind_host}:{config.early_decode_port}",
            config.early_decode_timeout_s, secret=config.side_port_secret)
        logger.info("sessionkv early decode: taking P's parameters on %s", inbox.endpoint)
        pacing.wait_for_prefill_params(lambda: inbox.waiting, inbox.wait,
                                       max_wait_s=_HELD_STEP_INTERVAL_S)
        return inbox

    def _request_arrived(self, request: Request) -> None:
        """vLLM queued a request (``_vllm/arrivals.py``).  A turn sent early, while P
        prefills, means P is about to pull its session's hold: the hold ends last
        under pressure from now, not from when the scheduler first asks about the
        request, which on a full D can be long after P's claim."""
        state = self._requests.of(request.request_id, request.kv_transfer_params)
        if not state.payload.early_decode_id:
            return
        session_id = self._session_of(request, state)
        if session_id:
            self._holds.turn_waiting(session_id, request.request_id)

    @staticmethod
    def _session_of(request: Request, state: RequestState) -> str | None:
        """The request's session: vLLM's own field, else our payload's."""
        return engine_state.request_session_id(request) or state.payload.session_id

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def set_xfer_handshake_metadata(self, metadata) -> None:
        super().set_xfer_handshake_metadata(metadata)
        failure = self._side_channel_failure()
        if failure is not None:
            # Without its side channel no peer can handshake with or claim from this
            # engine: stop it now, saying why, rather than serve without it.
            raise RuntimeError(f"sessionkv: the NIXL side channel could not listen on "
                               f"{self.side_channel_host}:{self.side_channel_port}: "
                               f"{failure}")

    # ------------------------------------------------------------------ planning
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
        self._sync_reads.choose(plan, remote_plan.names_remote_blocks(params),
                                request.num_tokens, self.pricing)
        state.plan = plan
        logger.info(
            "sessionkv plan request_id=%s session_id=%s direction=%s decision=%s "
            "verify=%s verified_tokens=%d refused_tokens=%d local_hit_tokens=%d "
            "load_tokens=%d read=%s first_token=%s prompt_tokens=%d pull_s=%.6f "
            "recompute_s=%.6f load=%.2f link_bytes_per_s=%.3g recompute_s_per_token=%.3g",
            request.request_id, engine_state.request_session_id(request), plan.direction,
            decision, verdict.reason, verdict.verified_tokens, verdict.refused_tokens,
            num_computed_tokens, plan.load_tokens, "sync" if plan.sync else "async",
            first_token, request.num_prompt_tokens, pull_s, recompute_s,
            self.pricing.engine_load, self.pricing.link_bytes_per_s,
            self.pricing.recompute_model.s_per_token)
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
                            max_loadable_tokens=max_loadable, hash_tokens=self.hash_tokens,
                            model_id=self.model_id,
                            tail_verifiable=not engine_state.request_has_extra_keys(request))
        return remote_plan.judge(params, read.payload, claim, refusal, way, local,
                                 request.num_prompt_tokens, time.time(),
                                 self.config.expiry_margin_s, self.config.pull_guard)

    def _continue_from_first_token(self, request: Request, params: dict[str, Any],
                                   verdict: Verdict, state: RequestState) -> bool:
        """Continue from the token P sampled, if P sent one and the request allows;
        then every verified prompt token is loaded and D's first step starts at the
        token after P's."""
        token_id = state.payload.first_token_id
        if token_id is None:
            return False
        view = (None if self._first_token.unsupported
                else vllm_first_token.first_token_request(request, self.max_model_len))
        if not self._first_token.continues(
                request.request_id, view, token_id, verdict.verified_tokens,
                str(params.get("remote_request_id") or ""), self.stats):
            return False
        vllm_first_token.continue_from_token(request, token_id)
        state.first_token_id = token_id
        return True

    # ------------------------------------------------------- scheduler hooks
    def _is_direct_session_turn(self, params: dict[str, Any],
                                payload: SessionPayload) -> bool:
        return (not params.get("do_remote_decode") and not params.get("do_remote_prefill")
                and bool(payload.session_id)
                and self.is_bidirectional_kv_xfer_enabled)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        matched = self._matched_tokens(request, num_computed_tokens)
        if matched[0] is not None:   # vLLM allocates next, if it has the blocks
            self._admission.asked(request.request_id,
                                  request.num_tokens - num_computed_tokens)
        return matched

    def _matched_tokens(self, request: Request, num_computed_tokens: int):
        self.pricing.note_live(request.request_id)
        state = self._requests.of(request.request_id, request.kv_transfer_params)
        if state.payload.early_decode_id:
            # Sent while P prefilled: wait for P's parameters (or their absence).
            params = self._early.params_when_ready(request.request_id, state.payload,
                                                   self.stats)
            if self._early.waiting(params):
                # Its session's hold was marked awaited when it arrived
                # (``_request_arrived``).
                return None, False   # vLLM asks again at the next step; no blocks held
            self._holds.turn_done_waiting(request.request_id)
            request.kv_transfer_params = params
            state = self._requests.of(request.request_id, params)
        self._early.connect(state.payload)
        session_id = self._session_of(request, state)
        if session_id:
            self._holds.turn_arrived(session_id, time.perf_counter())
        params = request.kv_transfer_params
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
            if host_tokens is None:
                return None, False   # reading from the disk tier; asked again next step
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
                             state: RequestState) -> int | None:
        """Tokens to restore from the host tier, if that beats recomputing them: only
        for requests that bring no remote KV (plain requests and turns served on D
        directly); side-effect free except for remembering the decision and planning
        a disk-tier read into host slots (None: wait for it)."""
        state.host_plan = None
        params = request.kv_transfer_params or {}
        if self.host is None or params.get("do_remote_prefill") or \
                params.get("do_remote_decode"):
            return 0
        tokens, state.host_plan = self.host.decide(
            request.block_hashes, request.num_prompt_tokens, num_computed_tokens,
            self.pricing, request.request_id, engine_state.request_session_id(request))
        return tokens

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        self._admission.allocated(request.request_id)
        state = self._requests.of(request.request_id, request.kv_transfer_params)
        host_plan, state.host_plan = state.host_plan, None
        if host_plan is not None and num_external_tokens > 0 and self.host is not None:
            state.host_restored_tokens = self.host.restore(
                request.block_hashes, host_plan, blocks.get_block_ids()[0])
        plan = state.plan
        params = request.kv_transfer_params
        if plan is not None and params and not nixl_state.remote_blocks_processed(params):
            self._load_remote(request, blocks, num_external_tokens, plan, state)
            return
        if params and self._is_direct_session_turn(params, state.payload):
            # Served on D without P: D still holds the turn for the next P pull, and
            # the worker only honours a hold for requests it saw in a batch.
            nixl_state.mark_in_batch(self, request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _load_remote(self, request: Request, blocks, num_external_tokens: int,
                     plan: RemotePlan, state: RequestState) -> None:
        params = request.kv_transfer_params
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
            self._guard.read_next_step(request.request_id, state.payload.hold_token)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if plan.sync and num_external_tokens:
            self._queue_sync_read(request, plan, blocks)

    def _queue_sync_read(self, request: Request, plan: RemotePlan, blocks) -> None:
        if not nixl_state.has_queued_read(self, request.request_id):
            # SyncReads.choose checks the handle stock code needs to queue the read.
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
        # vLLM hashed these blocks at allocation: no other request may find them
        # until the read is seen good.
        hidden = self._quarantine.queued(request.request_id, request,
                                         blocks.get_block_ids()[0], hit_blocks)
        prefix_cache.hide(self._kv_cache_manager, request.request_id, hidden, hit_blocks)
        # The read is done within the step: nothing left to keep alive on the peer.
        nixl_state.stop_heartbeat(self, request.request_id)
        self._sync_reads.queued(request.request_id)

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
        now = time.perf_counter()
        self._admission.make_room(
            running, lambda: engine_state.kv_free_blocks(self._kv_cache_manager), now)
        # Releases first: a hold that ends unread is demoted to host by a copy in
        # the same step's host copies, which the worker runs before its releases.
        release_holds = self._holds.take_releases(now, self._guard)
        instructions = StepInstructions(
            host_copies=self.host.take_ops() if self.host is not None else [],
            release_holds=release_holds,
            sync_loads=self._sync_reads.take_next(),
            # The worker may wait for its reads only when it has no model to run.
            idle_step=running == 0,
            read_guards=self._guard.take_reads(),
            holds_started=self._guard.take_holds_started(),
            report_sent=self._guard.take_sent(now))
        nixl_state.attach_step_instructions(meta, instructions)
        # Timed for the recompute price unless the step also waits on reads or copies.
        self.pricing.step_built(now, engine_state.scheduled_work(scheduler_output),
                                timed=not (instructions.sync_loads or instructions.host_copies))
        # This process and the worker spin on their queues only when it has a model
        # to run (the worker learns it from ``idle_step``).
        pacing.set_engine_busy(running > 0)
        return meta

    def update_connector_output(self, connector_output) -> None:
        sending = getattr(connector_output, "finished_sending", None)
        # Sends a reader's claim stands on are not freed yet (guard.py); the worker
        # reports them again once the claim ends.
        free_now = self._guard.gate(sending or (), time.perf_counter())
        if free_now is not None:
            connector_output.finished_sending = free_now
        report = nixl_state.worker_report(connector_output)
        self._guard.digested(report.held_digests)
        if self.host is not None and (report.disk_promoted or report.disk_refused):
            self.host.disk_reported(report.disk_promoted, report.disk_refused)
        if self.pricing.step_finished(time.perf_counter()):
            self.stats.record("recompute_s_per_token", self.pricing.recompute_model.s_per_token)
        stats = getattr(connector_output, "kv_connector_stats", None)
        data = getattr(stats, "data", None) or {}
        link_before = self.pricing.link_bytes_per_s
        self.pricing.observe_transfers(data.get("bytes_transferred", ()),
                                       data.get("transfer_duration", ()))
        if self.pricing.link_bytes_per_s != link_before:
            self.stats.record("link_bytes_per_s", self.pricing.link_bytes_per_s)
        failed = getattr(connector_output, "failed_recving", None) or set()
        received = getattr(connector_output, "finished_recving", None) or set()
        plans = dict(self._requests.planned())
        self._sync_reads.finished_step(received, failed, plans, time.perf_counter())
        invalid = getattr(connector_output, "invalid_block_ids", None)
        failed_sync = SyncReads.failed_by_blocks(plans, invalid) if invalid else []
        for req_id in failed_sync:
            self._pull_failed(req_id, plans[req_id])
        for proven in self._quarantine.settle(report.sync_loads_done, set(failed_sync)):
            prefix_cache.restore(self._kv_cache_manager, proven)
        self._holds.released(getattr(connector_output, "finished_sending", None) or (),
                             self.stats)
        for req_id in failed:
            self._pull_failed(req_id, plans.get(req_id))
        super().update_connector_output(connector_output)

    def _pull_failed(self, req_id: str, plan: RemotePlan | None) -> None:
        self.stats.record("pull_failed")
        if plan is not None:
            plan.failed = True
            self._sync_reads.cool(plan.remote_engine_id)
        logger.warning("sessionkv pull failed request_id=%s read=%s; recomputing", req_id,
                       "sync" if plan is not None and plan.sync else "async")

    # ------------------------------------------------------------------ end of turn
    def request_finished(self, request: Request, block_ids):
        self.pricing.finished(request.request_id)
        if self._quarantine.finished(request.request_id,
                                     engine_state.request_finished_with_output(request)):
            prefix_cache.restore(self._kv_cache_manager, request)
        params = request.kv_transfer_params
        state = self._requests.of(request.request_id, params)
        self._requests.pop(request.request_id)
        if state.first_token_id is not None:
            vllm_first_token.forget_first_token(request.request_id)
        self._early.forget(state.payload)   # aborted while waiting for P
        self._holds.turn_done_waiting(request.request_id)
        acct = None
        if state.plan is not None or state.local_hit_tokens is not None:
            acct = accounting(request.num_prompt_tokens, state.plan,
                              state.local_hit_tokens or 0, state.host_restored_tokens,
                              self.pricing.kv_bytes_per_token, time.perf_counter())
            record_accounting(self.stats, acct)
        is_d_node = bool(params) and not params.get("do_remote_decode")
        delay_free, out = super().request_finished(request, block_ids)
        if out is None:
            return delay_free, out
        # What the export reads of the request (vLLM's, and what we decided for it).
        turn = FinishedTurn(
            request_id=request.request_id, session_id=self._session_of(request, state),
            payload=state.payload, accounting=acct, block_hashes=request.block_hashes,
            all_token_ids=request.all_token_ids, output_token_ids=request.output_token_ids,
            tenant=engine_state.request_cache_salt(request),
            has_extra_keys=engine_state.request_has_extra_keys(request),
            hold_hint_s=state.hold_hint_s)
        return self._export.finished(turn, is_d_node, delay_free, block_ids, out,
                                     time.perf_counter(), self.stats)

    # ------------------------------------------------------------------ engine-wide
    def reset_cache(self) -> bool:
        """Drop every session hold (vLLM calls this for ``reset_prefix_cache`` with
        ``reset_external``), and empty the host tier.

        vLLM resets its block pool *before* it asks the connector, and our holds pin
        blocks until the worker has released them in the next step: the call that
        drops the holds still reports failure; one after that step succeeds."""
        dropped = self._holds.end_all()
        host_blocks = self.host.discard_all(self.stats) if self.host is not None else 0
        if dropped or host_blocks:
            logger.info("sessionkv reset: releasing %d session hold(s), dropped %d host-tier "
                        "block(s)", dropped, host_blocks)
        return True

    def take_stats(self) -> SessionKVStats | None:
        if self.host is not None:
            self.host.record_stats(self.stats)
        self._holds.record_stats(self.stats)
        self._holds.record_hold_blocks(
            self.stats, time.perf_counter(),
            lambda ids: engine_state.kv_block_ref_counts(self._kv_cache_manager, ids))
        self._guard.record_totals(self.stats)
        if self.stats.is_empty():
            return None
        return self.stats.clone_and_reset()

    def shutdown(self):
        self._holds.close()
        self._early.close()
        super().shutdown()
