"""``sessionkv-plan``: the CLI as a user runs it, and the worked examples in docs/planner.md."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from vllm_sessionkv.planner import plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "model_configs"
DOC = ROOT / "docs" / "planner.md"

# A numeric key names its unit: bytes, seconds, tokens, FLOPs, a ratio, or the thing counted.
UNIT_KEY = re.compile(
    r"(^|_)(bytes|s|ms|tokens|flops|gpus|ratio|pct|params|layers|heads|elements|sessions|"
    r"replicas|steps|copies)(_per_(s|token|gpu|replica|session|step))*$"
)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "vllm_sessionkv.planner.plan", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )


def numeric_keys(node, path=""):
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield f"{path}.{key}", key
            elif value is None:
                yield f"{path}.{key}", key  # a number that could not be computed
            else:
                yield from numeric_keys(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from numeric_keys(item, f"{path}[{i}]")


@pytest.mark.parametrize("model", ["llama-3.1-70b", "llama-3.1-8b", "mixtral-8x7b", "deepseek-v3"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "nvfp4"])
def test_json_keys_end_with_units(model, kv_dtype):
    out = run_cli("--config", str(CONFIGS / f"{model}.json"), "--kv-dtype", kv_dtype, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    keys = list(numeric_keys(data))
    assert len(keys) > 50
    bad = [path for path, key in keys if not UNIT_KEY.search(key)]
    assert not bad


def test_unit_check_can_fail():
    assert not UNIT_KEY.search("layers_total") and not UNIT_KEY.search("cost")
    assert [k for _, k in numeric_keys({"a": {"cost": 1}, "b": [{"n_bytes": 2}]})] == ["cost", "n_bytes"]


def test_json_reproduces_reference_figures():
    out = run_cli("--config", str(CONFIGS / "llama-3.1-70b.json"), "--params-b", "70", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["kv"]["kv_bytes_per_token"] == 327_680
    assert data["kv"]["prompt_kv_bytes"] == pytest.approx(2.68e9, rel=0.02)
    assert data["prefill"]["linear_ms"] == pytest.approx(717, rel=0.02)
    g400 = next(h for h in data["handoff"] if h["link"] == "400g")
    assert g400["line_rate_ms"] == pytest.approx(53.7, rel=0.02)
    assert g400["share_of_linear_prefill_line_rate_pct"] == pytest.approx(7.5, rel=0.02)
    shares = {r["share_of_linear_prefill_pct"] for r in data["handoff_400g_by_prompt_length"]}
    assert max(shares) == pytest.approx(min(shares))


def test_table_output():
    out = run_cli("--config", str(CONFIGS / "llama-3.1-8b.json"))
    assert out.returncode == 0, out.stderr
    assert "131,072 B (128.0 KiB)" in out.stdout
    for section in ("== KV cache (bf16)", "== Handoff", "== Prefill per session", "== Host DRAM",
                    "== Pools", "D by KV residency"):
        assert section in out.stdout


def test_weights_that_do_not_fit_warn_and_null_the_pools():
    out = run_cli("--config", str(CONFIGS / "deepseek-v3.json"), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert any("--gpus-per-replica" in w for w in data["warnings"])
    assert all(p["replicas"] is None for p in data["pools"]["decode_by_residency"])


@pytest.mark.parametrize(
    ("drop", "source"),
    [("num_hidden_layers", "llama-3.1-70b"), ("num_experts_per_tok", "mixtral-8x7b"),
     ("kv_lora_rank", None)],
)
def test_bad_config_exits_2_naming_the_key(tmp_path, drop, source):
    if source is None:  # MLA detected from kv_lora_rank: drop a key only MLA needs instead
        cfg = json.loads((CONFIGS / "deepseek-v3.json").read_text())
        drop = "v_head_dim"
    else:
        cfg = json.loads((CONFIGS / f"{source}.json").read_text())
    cfg.pop(drop)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = run_cli("--config", str(path), "--json")
    assert out.returncode == 2
    assert repr(drop) in out.stderr
    assert out.stdout == ""


def test_unreadable_config_and_bad_flags_exit_2(tmp_path):
    assert plan.main(["--config", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "list.json").write_text("[1, 2]")
    assert plan.main(["--config", str(tmp_path / "list.json")]) == 2
    cfg = str(CONFIGS / "llama-3.1-8b.json")
    assert plan.main(["--config", cfg, "--mfu", "1.5"]) == 2
    assert plan.main(["--config", cfg, "--steps", "0"]) == 2
    with pytest.raises(SystemExit) as info:
        plan.main(["--config", cfg, "--kv-dtype", "int4"])
    assert info.value.code == 2


def _doc_examples():
    """Each ```console block in docs/planner.md: '$ sessionkv-plan ARGS' then its output."""
    text = DOC.read_text()
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        first, _, output = block.partition("\n")
        assert first.startswith("$ sessionkv-plan "), first
        yield shlex.split(first[len("$ sessionkv-plan "):]), output


def test_docs_examples_are_real_output():
    examples = list(_doc_examples())
    assert len(examples) >= 3
    for args, expected in examples:
        out = run_cli(*args)
        assert out.returncode == 0, out.stderr
        assert out.stdout == expected, " ".join(args)
