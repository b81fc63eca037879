"""What the connector's scheduler and worker halves tell each other for one step.

vLLM moves connector metadata once per step, from ``build_connector_meta`` (engine
core) to ``start_load_kv`` (each worker).  NIXL's own metadata object carries its
reads and sends; ours rides on it as one typed value, attached and read only through
``_vllm.nixl_state.attach_step_instructions`` / ``step_instructions``.  Pure: standard
library and msgspec only.
"""

from __future__ import annotations

import enum

import msgspec

__all__ = ["HostCopy", "HostCopyKind", "StepInstructions", "WorkerReport"]


class HostCopyKind(enum.Enum):
    STORE = "store"   # device blocks -> host-tier slots
    LOAD = "load"     # host-tier slots -> device blocks
    SPILL = "spill"   # host-tier slots -> disk-tier files (disk_tier.py)
    PROMOTE = "promote"   # disk-tier files -> host-tier slots, each file checked
    DROP = "drop"     # delete disk-tier files


class HostCopy(msgspec.Struct, frozen=True, kw_only=True):
    """One host-tier copy, run by the worker in the order the scheduler planned them
    (a restore may read a slot a store in the same step wrote)."""

    kind: HostCopyKind
    # STORE: device block ids, then host slots; LOAD: host slots, then device block ids.
    # SPILL: host slots in src; PROMOTE: host slots in dst; DROP: neither.
    src: list[int] = msgspec.field(default_factory=list)
    dst: list[int] = msgspec.field(default_factory=list)
    # SPILL, PROMOTE, DROP: the block hashes naming the files, paired with the slots.
    block_hashes: list[bytes] = msgspec.field(default_factory=list)


class StepInstructions(msgspec.Struct, kw_only=True):
    """The scheduler's instructions to the worker for one step, beside NIXL's."""

    host_copies: list[HostCopy] = msgspec.field(default_factory=list)
    # Requests whose session hold ends this step (lease, superseded, reset).
    release_holds: set[str] = msgspec.field(default_factory=set)
    # Requests whose read runs inside this step, before the forward that uses it.
    sync_loads: set[str] = msgspec.field(default_factory=set)
    # No request is scheduled: the worker may wait for reads in flight.
    idle_step: bool = False
    # Reads to claim before posting and confirm before reporting them received
    # (guard.py): request id -> the holder's hold token.
    read_guards: dict[str, int] = msgspec.field(default_factory=dict)
    # Sends whose free the scheduler deferred while a reader's claim stood: report
    # them sent again (once), so vLLM frees them now.
    report_sent: set[str] = msgspec.field(default_factory=set)
    # Holds that began (request id -> the blocks its handle names), for the worker
    # to digest (kv_digest.py); with the pull guard on only.
    holds_started: dict[str, list[int]] = msgspec.field(default_factory=dict)


class WorkerReport(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's report to the scheduler for one step, beside NIXL's results
    (vLLM's worker metadata: each worker's, merged, reaches the scheduler with that
    step's output, however many steps are in flight)."""

    # Synchronous reads this step ran, succeeded or not (a failed one is also
    # reported as invalid blocks in the same output).
    sync_loads_done: frozenset[str] = frozenset()
    # Digests of the holds this step began (kv_digest.py): request id -> worker
    # ("tp0", ...) -> block id -> digest.
    held_digests: dict[str, dict[str, dict[int, int]]] = msgspec.field(default_factory=dict)
    # Disk-tier reads (PROMOTE) this step ran, and those refused (missing, corrupt,
    # another layout): a block is in its host slot only if no worker refused it.
    disk_promoted: frozenset[bytes] = frozenset()
    disk_refused: frozenset[bytes] = frozenset()

    def merge(self, other: "WorkerReport") -> "WorkerReport":
        digests = {r: dict(ranks) for r, ranks in self.held_digests.items()}
        for request_id, ranks in other.held_digests.items():
            digests.setdefault(request_id, {}).update(ranks)
        return WorkerReport(sync_loads_done=self.sync_loads_done | other.sync_loads_done,
                            held_digests=digests,
                            disk_promoted=self.disk_promoted | other.disk_promoted,
                            disk_refused=self.disk_refused | other.disk_refused)

    def is_empty(self) -> bool:
        return not (self.sync_loads_done or self.held_digests or self.disk_promoted
                    or self.disk_refused)
