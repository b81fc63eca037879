"""The agent-workload benchmark (``benchmarks/agent_workload.py``), in parts.

* ``workload``: the coding-agent generator, the multi_turn / Mooncake replays, how a
  step's prompt is built from earlier outputs, and the reuse ceiling (pure).
* ``client``: the streaming client that runs sessions against one arm.
* ``arms``: the engines and routers of each arm.
* ``report``: the table, the markdown report and the plots.
"""
