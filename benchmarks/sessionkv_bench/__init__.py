"""What the benchmarks share, as one package; scenarios are scripts on top of it.

- ``stats``: the one percentile (nearest rank).
- ``client``: the one SSE parser, the accounting header, token-id prompt bodies.
- ``aiperf``: the load generator of load-only scenarios (its own venv, its export read
  into our figures).
- ``arms``: one interface to every arm: ``start_cluster(name, arms, opts, ports,
  log_dir) -> Running`` (routers by arm key, engines, pids), ``reset``, ``warm_up``,
  ``Running.stop``; co-located, toy, vllm-router, stock NIXL and ours.
- ``runner``: repository paths, ``log``, ``PortPool``, ``interleaved`` rounds.
- ``metrics``: Prometheus reads around a run.
- ``report``: ``meta`` (date, commit, machine, command), ``head``, ``table``,
  ``write`` (JSON, markdown, figures; no local paths).

A scenario: parse its arguments, ``report.meta``, start each cluster of its arms,
measure every arm with ``runner.interleaved`` (resetting between arms), stop, then
``report.write`` under docs/benchmarks/ (``chat_goodput.py`` is the example).  The
scripts in benchmarks/ import this as a top-level package: run as ``python
benchmarks/x.py``, benchmarks/ is first on the path; pytest adds it (``pythonpath`` in
pyproject.toml)."""
