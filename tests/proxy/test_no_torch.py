"""The proxy runs without torch and without vLLM: importing any of its modules loads
neither (checked in a fresh interpreter, where nothing else has imported them)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import sessionkv_proxy
for module in pkgutil.walk_packages(sessionkv_proxy.__path__, "sessionkv_proxy."):
    importlib.import_module(module.name)
import sessionkv_proxy.__main__
heavy = sorted(name for name in sys.modules
               if name.split(".")[0] in ("torch", "vllm", "transformers"))
print(len([m for m in sys.modules if m.startswith("sessionkv_proxy.")]))
print(",".join(heavy))
"""


def test_importing_the_proxy_loads_neither_torch_nor_vllm():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    count, heavy = done.stdout.split("\n")[:2]
    assert int(count) >= 15   # every module was imported
    assert heavy == "", f"the proxy imported {heavy}"
