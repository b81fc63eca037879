"""The engine command line the launcher builds (no engine started)."""

from __future__ import annotations

from vllm_sessionkv.dev.launch import EngineSpec, engine_command


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_cpu_engine_gets_a_fractional_kv_cache_and_a_loadable_compile_cache(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # would override the flag in vLLM
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    argv, env = engine_command(EngineSpec(role="decode", model="m", port=1,
                                          kv_cache_space_gb=0.25))
    assert _flag(argv, "--kv-cache-memory-bytes") == str(2**28)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_USE_AOT_COMPILE"] == "0"


def test_operator_compile_setting_is_kept(monkeypatch):
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    _, env = engine_command(EngineSpec(role="prefill", model="m", port=1))
    assert env["VLLM_USE_AOT_COMPILE"] == "1"


def test_gpu_engine_keeps_vllms_kv_cache_sizing(monkeypatch):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    argv, env = engine_command(EngineSpec(role="decode", model="m", port=1, gpus="0"))
    assert _flag(argv, "--kv-cache-memory-bytes") is None
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in env
