"""Typed connector configuration, read from ``kv_connector_extra_config``.

Our keys live under ``kv_connector_extra_config["sessionkv"]``; the stock NIXL keys
(``backends``, ``kv_lease_duration``, ...) stay where vLLM reads them.  Unknown keys
are an error at start-up, naming the key, so a typo never silently falls back to a
default.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Any

import msgspec

from vllm_sessionkv.retention import Retention, RetentionParams
from vllm_sessionkv.wire import side_auth
from vllm_sessionkv.wire.cost import (
    DEFAULT_DISK_LINK,
    DEFAULT_HOST_LINK,
    DEFAULT_LINK,
    DEFAULT_RECOMPUTE,
)
from vllm_sessionkv.wire.protocol import HANDLE_EXPIRY_MARGIN_S
from vllm_sessionkv.wire.redis_keys import DEFAULT_NAMESPACE, check_redis_settings

__all__ = ["ConfigError", "CostConfig", "SessionKVConfig", "parse_config"]

EXTRA_CONFIG_KEY = "sessionkv"


class ConfigError(ValueError):
    """A bad ``kv_connector_extra_config.sessionkv`` value; the message names the key."""


def _check_not_negative(struct: msgspec.Struct, prefix: str = "") -> None:
    """Durations (``*_s``), rates and sizes below zero mean nothing: name the first."""
    for name in struct.__struct_fields__:
        value = getattr(struct, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{prefix}{name} must be >= 0, got {value}")


class CostConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Parameters of the pull-versus-recompute decision (see ``cost.decide_pull``).

    Defaults are sized for the tiny CPU model on this project's CI machine; operators
    set them from ``sessionkv-plan`` or from measured prefill throughput.  The
    recompute price per token and the link's bandwidth calibrate themselves from the
    engine's own step timings and NIXL's telemetry; a value set here for
    ``recompute_s_per_token`` pins it.
    """

    # Prefill cost of one new token on an idle engine, excluding attention.  Unset:
    # calibrated from the engine's prefill steps, starting from
    # ``recompute_prior_s_per_token``; set: pinned to this value.
    recompute_s_per_token: float | None = None
    # Where the calibration starts, until the engine has timed a prefill step.
    recompute_prior_s_per_token: float = DEFAULT_RECOMPUTE.s_per_token
    # Weight of each timed prefill step in the calibrated recompute price.
    recompute_ewma_alpha: float = 0.3
    # Only steps computing at least this many tokens calibrate it (smaller steps are
    # decode steps, which time the step's fixed cost rather than prefill).
    recompute_min_sample_tokens: int = 64
    # Attention cost: per new token, per token of context before it.
    recompute_s_per_token_per_context_token: float = \
        DEFAULT_RECOMPUTE.s_per_token_per_context_token
    # Each unit of engine load (requests in the last step) slows recompute by this.
    load_slowdown_per_unit: float = DEFAULT_RECOMPUTE.load_slowdown_per_unit
    # Link prior until NIXL telemetry has measured it.
    link_bytes_per_s: float = DEFAULT_LINK.bytes_per_s
    # Fixed cost of one pull: posting, notification, UCX wire-up amortised.
    per_transfer_s: float = DEFAULT_LINK.per_transfer_s
    # Weight of each step's running-request count in the engine-load estimate.
    load_ewma_alpha: float = 0.3
    # Weight of each new NIXL measurement in the bandwidth estimate.
    bandwidth_ewma_alpha: float = 0.2
    # Only transfers at least this large update the bandwidth estimate.
    bandwidth_min_sample_bytes: int = 256 * 1024
    # Never pull fewer tokens than this, whatever the model says.
    min_pull_tokens: int = 1
    # A pull from a peer this engine has read from before runs inside the step that
    # computes the request when its priced read time, alone and times the engine's
    # load, is at most this (``cost.decide_sync_load``): the request skips the step
    # an asynchronous read costs it, the others in the step wait for the read.
    # 0 = always asynchronous (vLLM's way).
    sync_load_max_stall_s: float = 0.005

    def __post_init__(self):
        _check_not_negative(self, "cost.")
        for name in ("recompute_ewma_alpha", "load_ewma_alpha", "bandwidth_ewma_alpha"):
            if not 0 < getattr(self, name) <= 1.0:
                raise ValueError(f"cost.{name} must be within (0, 1], got "
                                 f"{getattr(self, name)}")
        if not 0 <= self.sync_load_max_stall_s <= 1.0:
            raise ValueError("cost.sync_load_max_stall_s must be within [0, 1], got "
                             f"{self.sync_load_max_stall_s}")


class SessionKVConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Session pulls (D->P) on; requires the same on both pools.
    session_pulls: bool = True
    # How long D keeps a finished session turn's blocks for the next turn.  The lease
    # restarts at every turn, so an active conversation keeps its KV and an abandoned
    # one frees it after this long.
    session_lease_s: float = 120.0
    # A session's older hold, superseded by a newer turn, is released after this long
    # (not at once: a pull of it may still be in flight).
    superseded_hold_grace_s: float = 10.0
    # A handle this close to its expiry is not pulled from (vLLM's worker declines
    # reads within 5 s of D's deadline); protocol.handle_expired is the rule.  The
    # router's routing.params.handle_expiry_margin_s must be at least this.
    expiry_margin_s: float = HANDLE_EXPIRY_MARGIN_S
    # Refuse handles whose hash algorithm or block size differ from ours (fail safe).
    require_hash_meta_match: bool = True
    # The pull guard (guard.py): every read of a peer's held blocks is claimed before
    # and confirmed after, so blocks the holder let go are never attached.  Both pools
    # must run it: a guarded reader refuses a D handle without a hold token, and a
    # holder without it cannot defer its frees.  Off only for tests' negative control.
    pull_guard: bool = True
    # A claim stands this long at most (a reader that died must not pin blocks for
    # ever); a read confirmed later is refused and recomputed.  It must exceed the
    # reader's longest engine step, since the reader confirms at the end of a step.
    pull_claim_ttl_s: float = 60.0
    # A reader gives up on an unanswered claim or confirm after this long, and
    # recomputes.
    pull_guard_timeout_s: float = 5.0
    # The content digest (kv_digest.py), with the pull guard only: a holder digests
    # each hold's blocks as it begins, a reader digests what its read wrote and
    # compares before the blocks count as computed; a mismatch fails the read (vLLM
    # recomputes).  Off on either side: reads go unchecked.  Needs one KV cache group.
    kv_digest: bool = True
    # Start under a vLLM release the connector was not tested with (_vllm/version.py,
    # VLLM_VERSIONS_TESTED); by default the engine refuses to start.
    allow_untested_vllm: bool = False
    # NIXL's UCX progress thread.  Its poll delay is hard-coded to zero, so it spins
    # (about a core per engine); vLLM drives progress every engine step anyway.
    # None = off on the CPU platform.
    nixl_progress_thread: bool | None = None
    # UCX peer-failure handling for NIXL's endpoints: "peer" (NIXL's default) or
    # "none".  "peer" rules out shared-memory transports, so engines on one host
    # connect over TCP, whose set-up needs the remote engine's progress.  None =
    # "none" on the CPU platform (engines share a host), NIXL's default elsewhere.
    nixl_ucx_error_handling: str | None = None
    # How long an engine's processes spin on vLLM's internal message queues after a
    # message before sleeping until the next one (vLLM: 1 s), while the engine has no
    # model to run (it only holds blocks, waits for KV, or has stopped).  None = 2 ms
    # on the CPU platform, where spinning engines take the cores other engines
    # compute on; vLLM's own on other platforms.
    engine_busy_poll_s: float | None = None
    # While the engine has a model to run, spin as vLLM does whatever the cap above:
    # a busy engine then steps at the plain engine's rate.  False applies the cap on
    # every step too (slower decoding; only for comparison).
    engine_spin_while_busy: bool = True
    # An engine with nothing to compute still steps while finished requests hold
    # blocks for a peer's read (P until D reads, D for a session's lease).  Such an
    # engine waits for a new request up to this long before each step (a request
    # ends the wait at once).  None = 20 ms on the CPU platform, 0 (vLLM's
    # back-to-back steps) elsewhere.
    holding_step_interval_s: float | None = None
    # A step that runs no model (every request is waiting for its KV) waits up to
    # this long for the reads it has in flight before it reports, so a read that
    # lands within the wait is seen by this step and the request runs in the next.
    # Without it the engine steps empty (1 ms apart, each a round trip through the
    # engine core and its worker) until one step sees the read.  A step with a model
    # to run never waits.  0 = vLLM's loop.
    idle_step_recv_wait_s: float = 0.005
    # A synchronous pull (see cost.sync_load_max_stall_s) that has not landed after
    # this long is given up: vLLM recomputes the request's blocks.
    sync_load_timeout_s: float = 1.0
    # A synchronous read's blocks stay out of vLLM's prefix cache until the read is
    # seen good (vLLM hashes them at allocation, before the read; a failed one would
    # stay findable: _vllm/prefix_cache.py).  Off only for tests' negative control.
    sync_read_quarantine: bool = True
    # Early decode: a ZMQ PULL port on which this engine, as D, takes P's parameters
    # for requests the proxy sent it while P was still prefilling (early_decode.py).
    # 0 = off.  Give the proxy the same endpoint: --decode url=...,early=tcp://HOST:PORT.
    early_decode_port: int = 0
    # The address it binds: "*" (every address of the host) or one IP address, which
    # the proxy's early=tcp://HOST:PORT must then name.
    early_decode_bind_host: str = "*"
    # The shared secret that authenticates the side ports' messages (side_auth.py):
    # as D, the early-decode inbox takes only P's parameters with a valid HMAC and the
    # handle channel signs its handles; as P, pushes to D are signed.  The proxy sets
    # the same.  None: SESSIONKV_SIDE_PORT_SECRET from the environment, else off.
    side_port_secret: str | None = None
    # A held request whose parameters never come computes its prompt itself after
    # this long (the proxy died, or the message was lost).
    early_decode_timeout_s: float = 60.0
    # First-token handoff (first_token.py): as P, export the token P sampled; as D,
    # continue from it when the request allows, instead of recomputing the last
    # prompt token to sample it again (one engine step less per request).
    first_token_handoff: bool = True
    # The handle channel (handle_channel.py): a ZMQ PUB port on which this engine, as
    # D, sends each session handle at the end of a turn, for proxies without Redis
    # (streamed answers carry no handle in vLLM 0.32).  0 = off.  Give the proxy the
    # same endpoint: --decode url=...,handles=tcp://HOST:PORT.
    handle_channel_port: int = 0
    # The address it binds: "*" (every address of the host) or one IP address.
    handle_channel_bind_host: str = "*"
    # Publish each session handle to Redis too (streaming clients need it or the
    # handle channel; every proxy replica reads it there): redis://HOST:PORT/DB
    # for one Redis, redis+cluster://HOST:PORT (any node) for a Redis Cluster.  The
    # namespace must be the proxy's index.redis_namespace (the keys' hash tag,
    # redis_keys.py).
    redis_url: str | None = None
    redis_namespace: str = DEFAULT_NAMESPACE
    # HTTP URL of this engine, published in handles so a router can find it: the URL
    # the router has for this engine (its --prefill/--decode url), an address the
    # router's host can reach.
    advertise_url: str | None = None
    # Session holds pin at most this share of the engine's KV blocks; beyond it the
    # oldest end early (holds.py, ``kv_pressure``).  Their KV stays reachable on the
    # host tier when there is one (written through at the end of each turn).
    session_hold_max_kv_fraction: float = 0.5
    # How D sets each hold's lease and which holds end first under the cap above
    # (retention.py, docs/retention.md): "value" (lease from the client's
    # X-Session-Hold-S or the session's observed inter-turn gaps, else
    # session_lease_s; the least valuable end first, demoted to the host tier first)
    # or "age" (every lease session_lease_s, the oldest end first: the rule before).
    retention: Retention = RetentionParams.mode
    # Bounds of a lease from a hint or from gaps (a hint is clamped into them); the
    # minimum is session_lease_s where that is shorter.
    retention_min_lease_s: float = RetentionParams.min_lease_s
    retention_max_lease_s: float = RetentionParams.max_lease_s
    # A lease from gaps covers this quantile of the session's gaps, times the margin.
    retention_gap_quantile: float = RetentionParams.gap_quantile
    retention_gap_margin: float = RetentionParams.gap_margin
    # Gaps a session needs before they set its lease (until then session_lease_s).
    retention_min_gaps: int = RetentionParams.min_gaps
    # Gaps kept per session, and sessions whose gaps are kept (least recent dropped).
    retention_gap_history: int = 8
    retention_max_sessions: int = 10000
    # Once holds pin more than half their cap, leases not from a hint are cut by up
    # to this share (all of it at a full cap), never below the minimum lease.
    retention_pressure_lease_cut: float = RetentionParams.pressure_lease_cut
    # Withdraw a session's handle where the proxies find it (Redis, the handle
    # channel) when a hold ends before its lease, and carry this process's start-up
    # epoch in every handle, so no proxy replica attaches a dead hold or a restarted
    # engine's handle.  False only for a negative control.
    withdraw_handles: bool = True
    # Host-DRAM tier for idle session KV: bytes of DRAM per engine (0 = off).
    host_tier_bytes: int = 0
    host_tier_policy: str = "lru"
    # Host<->KV-cache copy speed prior, for pricing a restore against recompute.
    host_copy_bytes_per_s: float = DEFAULT_HOST_LINK.bytes_per_s
    host_copy_per_transfer_s: float = DEFAULT_HOST_LINK.per_transfer_s
    # Disk tier beneath the host tier (disk_tier.py, docs/tiers.md): the host tier's
    # evictions are spilled to files in this directory (absolute, one per engine),
    # up to disk_tier_bytes (0 = off), and read back, checked, when a request needs
    # them.  Needs the host tier.
    disk_tier_dir: str | None = None
    disk_tier_bytes: int = 0
    # Disk -> host -> KV-cache read speed prior, for pricing a disk restore against
    # recompute.
    disk_read_bytes_per_s: float = DEFAULT_DISK_LINK.bytes_per_s
    disk_read_per_transfer_s: float = DEFAULT_DISK_LINK.per_transfer_s
    cost: CostConfig = CostConfig()

    def __post_init__(self):
        _check_not_negative(self)
        check_redis_settings(self.redis_url, self.redis_namespace)
        if not 0.0 < self.session_hold_max_kv_fraction <= 1.0:
            raise ValueError("session_hold_max_kv_fraction must be in (0, 1]")
        if self.host_tier_bytes < 0:
            raise ValueError("host_tier_bytes must be >= 0")
        if self.nixl_ucx_error_handling not in (None, "peer", "none"):
            raise ValueError("nixl_ucx_error_handling must be 'peer' or 'none', got "
                             f"{self.nixl_ucx_error_handling!r}")
        if self.engine_busy_poll_s is not None and self.engine_busy_poll_s < 0:
            raise ValueError(f"engine_busy_poll_s must be >= 0, got {self.engine_busy_poll_s}")
        if self.holding_step_interval_s is not None and not \
                0 <= self.holding_step_interval_s <= 1.0:
            raise ValueError("holding_step_interval_s must be within [0, 1], got "
                             f"{self.holding_step_interval_s}")
        if not 0 <= self.idle_step_recv_wait_s <= 1.0:
            raise ValueError("idle_step_recv_wait_s must be within [0, 1], got "
                             f"{self.idle_step_recv_wait_s}")
        if not 0 < self.sync_load_timeout_s <= 60.0:
            raise ValueError("sync_load_timeout_s must be within (0, 60], got "
                             f"{self.sync_load_timeout_s}")
        if not 0 <= self.early_decode_port < 65536:
            raise ValueError(f"early_decode_port must be within [0, 65535], got "
                             f"{self.early_decode_port}")
        if not 0 <= self.handle_channel_port < 65536:
            raise ValueError(f"handle_channel_port must be within [0, 65535], got "
                             f"{self.handle_channel_port}")
        if self.handle_channel_port and \
                self.handle_channel_port == self.early_decode_port:
            raise ValueError("handle_channel_port and early_decode_port must differ, both "
                             f"are {self.handle_channel_port}")
        for key in ("early_decode_bind_host", "handle_channel_bind_host"):
            host = getattr(self, key)
            if host != "*":
                try:
                    ipaddress.ip_address(host)
                except ValueError:
                    raise ValueError(f"{key} must be '*' or an IP address, got "
                                     f"{host!r}") from None
        side_auth.check_secret(self.side_port_secret, "side_port_secret")
        if self.advertise_url is not None:
            url = urllib.parse.urlsplit(self.advertise_url)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError("advertise_url must be an http(s)://HOST:PORT URL, got "
                                 f"{self.advertise_url!r}")
        if self.early_decode_timeout_s <= 0:
            raise ValueError("early_decode_timeout_s must be > 0, got "
                             f"{self.early_decode_timeout_s}")
        if not 0 < self.pull_claim_ttl_s <= 3600:
            raise ValueError("pull_claim_ttl_s must be within (0, 3600], got "
                             f"{self.pull_claim_ttl_s}")
        if not 0 < self.pull_guard_timeout_s <= 60:
            raise ValueError("pull_guard_timeout_s must be within (0, 60], got "
                             f"{self.pull_guard_timeout_s}")
        if not 0 < self.retention_min_lease_s <= self.retention_max_lease_s <= 86400:
            raise ValueError("retention_min_lease_s and retention_max_lease_s must satisfy "
                             "0 < min <= max <= 86400, got "
                             f"{self.retention_min_lease_s} and {self.retention_max_lease_s}")
        if self.retention is Retention.VALUE and \
                self.retention_min_lease_s <= self.expiry_margin_s:
            raise ValueError(f"retention_min_lease_s ({self.retention_min_lease_s}) must "
                             f"exceed expiry_margin_s ({self.expiry_margin_s}): a shorter "
                             "lease's handle is never used")
        if not 0 < self.retention_gap_quantile <= 1.0:
            raise ValueError("retention_gap_quantile must be within (0, 1], got "
                             f"{self.retention_gap_quantile}")
        if not 1 <= self.retention_min_gaps <= self.retention_gap_history <= 1024:
            raise ValueError("retention_min_gaps and retention_gap_history must satisfy "
                             "1 <= min_gaps <= gap_history <= 1024, got "
                             f"{self.retention_min_gaps} and {self.retention_gap_history}")
        if not 1 <= self.retention_max_sessions <= 10_000_000:
            raise ValueError("retention_max_sessions must be within [1, 10000000], got "
                             f"{self.retention_max_sessions}")
        if not 0 <= self.retention_pressure_lease_cut <= 1.0:
            raise ValueError("retention_pressure_lease_cut must be within [0, 1], got "
                             f"{self.retention_pressure_lease_cut}")
        if self.host_tier_policy != "lru":
            raise ValueError(f"host_tier_policy must be 'lru', got {self.host_tier_policy!r}")
        if self.disk_tier_bytes:
            if not self.host_tier_bytes:
                raise ValueError("disk_tier_bytes needs the host tier (host_tier_bytes > 0): "
                                 "blocks reach the disk tier as host-tier evictions")
            if not self.disk_tier_dir or not self.disk_tier_dir.startswith("/"):
                raise ValueError("disk_tier_dir must be an absolute path when "
                                 f"disk_tier_bytes is set, got {self.disk_tier_dir!r}")
        if self.disk_read_bytes_per_s <= 0:
            raise ValueError("disk_read_bytes_per_s must be > 0")

    def retention_params(self) -> RetentionParams:
        """The retention rule's parameters (retention.py)."""
        return RetentionParams(
            mode=self.retention, default_lease_s=self.session_lease_s,
            min_lease_s=self.retention_min_lease_s,
            max_lease_s=self.retention_max_lease_s,
            gap_quantile=self.retention_gap_quantile,
            gap_margin=self.retention_gap_margin, min_gaps=self.retention_min_gaps,
            pressure_lease_cut=self.retention_pressure_lease_cut)

    def kv_digest_active(self, kv_cache_groups: int) -> bool:
        """Whether this engine digests holds and reads (kv_digest.py)."""
        return self.kv_digest and self.pull_guard and kv_cache_groups == 1

    def nixl_agent_options(self, cpu_platform: bool) -> tuple[bool, str | None]:
        """(progress thread on, UCX error-handling mode) for this platform."""
        progress_thread = (not cpu_platform if self.nixl_progress_thread is None
                           else self.nixl_progress_thread)
        error_handling = self.nixl_ucx_error_handling
        if error_handling is None and cpu_platform:
            error_handling = "none"
        return progress_thread, error_handling

    def busy_poll_cap_s(self, cpu_platform: bool) -> float | None:
        """The spin cap for this platform, or None to leave vLLM's."""
        if self.engine_busy_poll_s is None:
            return 0.002 if cpu_platform else None
        return self.engine_busy_poll_s

    def holding_step_interval(self, cpu_platform: bool) -> float:
        """Seconds a holding engine waits for input per step (0 = vLLM's loop)."""
        if self.holding_step_interval_s is None:
            return 0.02 if cpu_platform else 0.0
        return self.holding_step_interval_s


def parse_config(extra_config: dict[str, Any] | None) -> SessionKVConfig:
    """Validate ``kv_connector_extra_config["sessionkv"]``; raise ConfigError on bad input."""
    extra_config = extra_config or {}
    misplaced = sorted(set(extra_config) & set(SessionKVConfig.__struct_fields__))
    if misplaced:
        raise ConfigError(
            f"kv_connector_extra_config.{misplaced[0]} is a sessionkv key: put it under "
            f"kv_connector_extra_config.{EXTRA_CONFIG_KEY}.{misplaced[0]} (vLLM's NIXL "
            "connector ignores it there)")
    raw = extra_config.get(EXTRA_CONFIG_KEY, {})
    if isinstance(raw, dict) and raw.get("side_port_secret") is None \
            and side_auth.secret_from_env():
        raw = {**raw, "side_port_secret": side_auth.secret_from_env()}
    try:
        return msgspec.convert(raw, SessionKVConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(
            f"invalid kv_connector_extra_config.{EXTRA_CONFIG_KEY}: {exc}") from None
