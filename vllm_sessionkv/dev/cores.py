"""Pure: which CPU cores each engine's model thread computes on (CPU platform only).

vLLM's own binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) reserves cores for the engine's
other processes and binds the OpenMP threads to the rest of the machine, engine by
engine: with the launcher's one reserved CPU on a 2-core machine, every engine's model
thread lands on core 0, and two busy engines then compute on one core while the
other core has only their front ends.  The launcher instead gives each engine a core
of its own (``plan_cores``), as the benchmarks' ``--cores auto`` does:

* engines in start order (prefill..., decode..., the co-located one) take the cores
  the launcher may run on, one each, in order;
* with more engines than cores, they go round robin: engine i on core i mod N, so
  the engines sharing a core are spread evenly, and each shared core holds engines
  of different roles; an idle engine costs its neighbours little (ours sleep between
  steps; a plain vLLM engine spins for 1 s after its last step, and an engine computing
  on its core meanwhile ran up to 8x slower: docs/benchmarks/engine_overhead_live.md),
  two busy ones on one core each run at about half speed;
* on GPU hosts (``gpus``) and for vLLM's stock NixlConnector nothing is bound (vLLM's
  own binding): stock NIXL's worker moves the model thread onto the last core of
  each NUMA node whatever it was given (``_vllm.keep_thread_affinity`` says why ours
  does not).

The other threads of an engine (its API server, engine core, ZMQ and NIXL threads)
are not bound: they run on whichever core is free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CORE_MODES", "CorePlan", "plan_cores"]

# "auto": one core per engine, round robin past the core count; "vllm": vLLM's own
# binding; or a comma-separated list of VLLM_CPU_OMP_THREADS_BIND values, one per
# engine in start order ("0,1,0", "0-1,2-3").
CORE_MODES = ("auto", "vllm")


@dataclass(frozen=True)
class CorePlan:
    """Per engine name, its ``VLLM_CPU_OMP_THREADS_BIND`` (None: vLLM's binding), and
    the rule that chose them, in one line for the launcher's start-up log."""

    binds: dict[str, str | None]
    rule: str

    def env(self, engine: str) -> dict[str, str]:
        bind = self.binds.get(engine)
        return {} if bind is None else {"VLLM_CPU_OMP_THREADS_BIND": bind}


def plan_cores(engines: Sequence[str], cores: Sequence[int], mode: str = "auto",
               gpus: bool = False, stock_nixl: bool = False) -> CorePlan:
    """The cores of ``engines`` (names in start order) on a machine whose launcher may
    run on ``cores``.  ``mode``: ``CORE_MODES`` or an explicit list (one value per
    engine); a bad one raises ValueError naming it."""
    names = list(engines)
    if mode not in CORE_MODES:
        binds = [b.strip() for b in mode.split(",")]
        if len(binds) != len(names) or not all(binds):
            raise ValueError(f"cores: {len(names)} engines ({', '.join(names)}) need "
                             f"{len(names)} comma-separated core lists, got {mode!r}")
        return CorePlan(dict(zip(names, binds)),
                        "cores: as given (" + _listing(names, binds) + ")")
    if mode == "vllm" or gpus or stock_nixl or not cores:
        why = ("asked for" if mode == "vllm" else "GPU host" if gpus
               else "stock NixlConnector re-pins the model thread" if stock_nixl
               else "no cores known")
        return CorePlan(dict.fromkeys(names),
                        f"cores: vLLM's own binding for every engine ({why})")
    ordered = sorted(cores)
    binds = [str(ordered[i % len(ordered)]) for i in range(len(names))]
    if len(names) <= len(ordered):
        rule = (f"cores: one core per engine ({len(names)} engines, {len(ordered)} "
                f"cores): " + _listing(names, binds))
    else:
        rule = (f"cores: {len(names)} engines on {len(ordered)} cores, round robin in "
                f"start order (engine i on core i mod {len(ordered)}; engines sharing "
                f"a core slow each other only while both compute): "
                + _listing(names, binds))
    return CorePlan(dict(zip(names, binds)), rule)


def _listing(names: list[str], binds: list[str]) -> str:
    return ", ".join(f"{n}->{b}" for n, b in zip(names, binds))
