"""vllm-sessionkv: session-aware KV reuse across vLLM prefill and decode pools.

This package root imports nothing heavy: the proxy and the planner use the pure
modules (``hashing``, ``protocol``, ``cost``) without torch or vLLM installed.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
