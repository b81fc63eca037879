"""The fairness rules, checked by the script rather than left to the reader (pure).

Every engine's resolved configuration is read from the engine itself
(``GET /server_info?config_format=json``, served with ``VLLM_SERVER_DEV_MODE=1``) and
flattened to dotted keys.  Each key whose values differ between engines is one of:

* ``knob``: what the arms are meant to differ in: the chunked-prefill budget
  (``max_num_batched_tokens`` and the sizes vLLM derives from it) and the KV
  connector (P/D engines have one, co-located ones none);
* ``instance``: what differs between any two servers of one deployment: ports,
  addresses, ids, compile timings, each engine's CPU cores;
* ``forbidden``: everything else (model, dtype, max_model_len, block size, KV blocks,
  prefix caching, seed, vLLM and torch versions, ...).  The run refuses to start
  while any remains, unless the operator names the key with ``--allow-diff``; then
  the report lists it as allowed.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

# Keys the arms exist to vary.  vLLM derives the encoder budget, the compile ranges
# and a fusion bound from max_num_batched_tokens.
KNOB_PATTERNS = (
    r"^scheduler_config\.max_num_batched_tokens$",
    r"^scheduler_config\.(max_num_encoder_input_tokens|encoder_cache_size)$",
    r"^compilation_config\.compile_ranges_endpoints$",
    r"^compilation_config\.pass_config\.rope_kvcache_fusion_max_token_num$",
    r"^kv_transfer_config(\.|$)",
)
# Keys that differ between two servers of one deployment (case-insensitive: the
# environment's names are upper case).
INSTANCE_PATTERNS = (
    r"(^|\.)instance_id$",
    r"(^|[._])(\w+_)?port(_list)?$",
    r"endpoint$",
    r"(_host|_ip|_addr)$",
    r"^compilation_config\.(compilation_time|encoder_compilation_time|traced_files|"
    r"local_cache_dir|cache_dir)$",
    r"^env\.VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME$",
    r"^env\.VLLM_CPU_OMP_THREADS_BIND$",   # each server's own cores, reported apart
)
# Of the host's system_env, what decides speed and results.
SYSTEM_KEYS = ("torch_version", "vllm_version", "cuda_runtime_version",
               "nvidia_driver_version", "nvidia_gpu_models")


class FairnessError(RuntimeError):
    """A fairness rule does not hold; the message names what differs."""


@dataclass(frozen=True)
class ConfigDiff:
    key: str
    kind: str                     # knob | instance | forbidden | allowed
    values: dict[str, object]     # engine label -> value


def flatten(server_info: dict) -> dict[str, object]:
    """``/server_info?config_format=json`` -> ``{dotted key: value}``: the vLLM
    config, ``env.VLLM_*`` and ``system.<SYSTEM_KEYS>``."""
    out: dict[str, object] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    walk("", server_info.get("vllm_config") or {})
    for k, v in (server_info.get("vllm_env") or {}).items():
        out[f"env.{k}"] = v
    system = server_info.get("system_env") or {}
    for k in SYSTEM_KEYS:
        out[f"system.{k}"] = system.get(k)
    return out


def classify(key: str) -> str:
    if any(re.search(p, key) for p in KNOB_PATTERNS):
        return "knob"
    if any(re.search(p, key, re.IGNORECASE) for p in INSTANCE_PATTERNS):
        return "instance"
    return "forbidden"


def config_diffs(configs: dict[str, dict[str, object]],
                 allow: tuple[str, ...] = ()) -> list[ConfigDiff]:
    """Every key whose value is not the same on all engines (a key missing on one
    counts as ``None``), sorted by key; ``allow``: forbidden keys the operator
    accepts."""
    keys = sorted({k for c in configs.values() for k in c})
    out = []
    for key in keys:
        values = {label: c.get(key) for label, c in configs.items()}
        if len({repr(v) for v in values.values()}) == 1:
            continue
        kind = classify(key)
        if kind == "forbidden" and key in allow:
            kind = "allowed"
        out.append(ConfigDiff(key, kind, values))
    return out


def check_configs(configs: dict[str, dict[str, object]], allow: tuple[str, ...] = ()
                  ) -> list[ConfigDiff]:
    """The diffs, or :class:`FairnessError` naming each forbidden key and its values."""
    diffs = config_diffs(configs, allow)
    bad = [d for d in diffs if d.kind == "forbidden"]
    if bad:
        lines = [f"  {d.key}: " + ", ".join(f"{label}={v!r}" for label, v in d.values.items())
                 for d in bad]
        raise FairnessError("engine configs differ in keys the arms must share "
                            "(--allow-diff KEY accepts one):\n" + "\n".join(lines))
    return diffs


def check_server_counts(counts: dict[str, int]) -> None:
    """Every arm runs on the same number of servers."""
    if len(set(counts.values())) > 1:
        raise FairnessError("arms run on different numbers of servers: "
                            + ", ".join(f"{arm}={n}" for arm, n in counts.items()))


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_same_arrivals(digests: dict[str, str]) -> None:
    """Every arm replayed the same arrival file."""
    if len(set(digests.values())) > 1:
        raise FairnessError("arms replayed different arrival files: "
                            + ", ".join(f"{arm}={d[:12]}" for arm, d in digests.items()))
