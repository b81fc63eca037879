"""The scheduler half's components, one idea a module, each driven by the hooks in
``vllm_sessionkv/scheduler.py`` (the dispatcher, the only one that talks to vLLM)
and tested on plain data (``tests/unit/test_scheduling_*.py``).

* ``request_state``: one object per request: its session payload, decoded once, and
  everything decided for it (replaces per-request dicts).
* ``remote_plan``: what remote KV a request may attach (verification, expiry, the
  guard) and whether to load it.
* ``pricing``: the live load and link speed; every pull, restore and
  synchronous-read price (one ``PullQuote`` construction).
* ``sync_reads``: which reads run inside the step that computes their request.
* ``sync_read_quarantine``: which of their blocks stay out of the prefix cache, and
  until when (the read seen good).
* ``host_restore``: restores from and offloads to the host-DRAM tier.
* ``session_holds``: holds on D (lease, supersession, the KV cap, reset) and the
  handle's publication.
* ``turn_export``: the end of a turn: P's chain and token for D; on D, a session
  turn held, offloaded, exported and published, any other freed at once.
* ``admission``: holds that end for a request D cannot admit for want of blocks.
* ``guard_ledger``: the pull guard, holder and reader side.
* ``first_token``: whether D continues from P's token.
* ``early_decode``: D waiting for P's parameters; P pushing them.
* ``accounting``: where each prompt token came from.
* ``counters``: what the components record into.
"""
