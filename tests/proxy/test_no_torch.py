"""The proxy runs without torch and without vLLM: importing any of its modules, and
every module of ``vllm_sessionkv/wire/`` (the connector's torch-free part, shared with
the proxy), loads neither (checked in a fresh interpreter, where nothing else has
imported them); and the proxy loads nothing of ``vllm_sessionkv`` outside ``wire/``."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import sessionkv_proxy
for module in pkgutil.walk_packages(sessionkv_proxy.__path__, "sessionkv_proxy."):
    importlib.import_module(module.name)
import sessionkv_proxy.__main__
ours = sorted(name for name in sys.modules if name.startswith("vllm_sessionkv"))
import vllm_sessionkv.wire
for module in pkgutil.walk_packages(vllm_sessionkv.wire.__path__, "vllm_sessionkv.wire."):
    importlib.import_module(module.name)
heavy = sorted(name for name in sys.modules
               if name.split(".")[0] in ("torch", "vllm", "transformers"))
print(len([m for m in sys.modules if m.startswith("sessionkv_proxy.")]))
print(len([m for m in sys.modules if m.startswith("vllm_sessionkv.wire.")]))
print(",".join(heavy))
print(",".join(ours))
"""


def test_importing_the_proxy_loads_neither_torch_nor_vllm():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    count, wire_count, heavy, ours = done.stdout.split("\n")[:4]
    assert int(count) >= 15   # every module was imported
    assert int(wire_count) >= 5
    assert heavy == "", f"the proxy or wire/ imported {heavy}"
    outside = [name for name in ours.split(",")
               if name not in ("vllm_sessionkv", "vllm_sessionkv.wire")
               and not name.startswith("vllm_sessionkv.wire.")]
    assert ours and not outside, f"the proxy imported {outside} (only wire/ is shared)"
