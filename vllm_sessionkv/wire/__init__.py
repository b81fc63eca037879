"""What the connector and the proxy share, and the only part of this package the
proxy imports: torch-free, vLLM-free (standard library, msgspec, pyzmq).

* ``protocol``: the wire types under ``kv_transfer_params["sessionkv"]`` and D's handles.
* ``hashing``: engine hash chains and router keys.
* ``cost``: the pull-or-recompute price (connector) and the cached-block credit (router).
* ``redis_keys``: every Redis key name and the Redis URL.
* ``early_decode``: the sender of P's parameters to D's early-decode inbox.

``tests/proxy/test_no_torch.py`` imports the proxy and this folder in a fresh
interpreter and checks that neither loads torch or vLLM, and that the proxy loads
nothing else of ``vllm_sessionkv``.
"""
