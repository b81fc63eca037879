"""What the benchmarks share, as one package: ``stats`` (the one percentile),
``client`` (the one SSE parser, prompt bodies, a closed loop), ``report`` (the commit
and command a report states) and ``aiperf`` (the load generator of load-only
scenarios).  The scripts in benchmarks/ import it as a top-level package: run as
``python benchmarks/x.py``, benchmarks/ is first on the path; pytest adds it
(``pythonpath`` in pyproject.toml)."""
