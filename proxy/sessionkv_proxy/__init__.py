"""sessionkv_proxy: the KV-aware router in front of vLLM prefill and decode pools.

This package imports no torch and no vLLM; from ``vllm_sessionkv`` it may use only the
torch-free folder ``vllm_sessionkv/wire/`` (checked by ``tests/proxy/test_no_torch.py``).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
