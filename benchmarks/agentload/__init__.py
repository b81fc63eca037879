"""The agent benchmark (``benchmarks/agent_workload.py``), in parts: ``workload`` (the
token-id sessions, the Mooncake replay and the reuse ceiling; pure), ``chat`` (sessions
as chat messages in text, re-tokenization; pure), ``client`` (runs sessions against an
arm), ``measure`` (a run's figures, the probes), ``report`` (markdown and plots)."""
