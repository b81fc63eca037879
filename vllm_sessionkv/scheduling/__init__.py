"""The scheduler half's components, one idea a module, each driven by the hooks in
``vllm_sessionkv/scheduler.py`` (the dispatcher) and tested on plain data
(``tests/unit/test_scheduling_*.py``).

* ``request_state``: one object per request, holding its session payload (decoded once)
  and everything decided for it; replaces per-request dicts.
* ``pricing``: the engine's live load and link speed, and every pull, restore and
  synchronous-read price (one ``PullQuote`` construction).
* ``remote_plan``: what remote KV a request may attach (verification, expiry, the
  guard) and whether pulling it beats recomputing it.
* ``accounting``: where each prompt token came from (``TokenAccounting``).
"""
