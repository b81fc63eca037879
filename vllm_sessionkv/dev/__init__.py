"""Development tools, not part of the connector: the local launcher (``launch``), the
tiny random model generator (``tiny_model``), the real model's builder
(``real_model``: SmolLM2-135M-Instruct from its PyPI wheel), the chat workload of the tests and
benchmarks (``workload``), and vLLM's stock NixlConnector for control experiments
(``stock_nixl``).  Nothing in the connector or the proxy imports them.
"""
