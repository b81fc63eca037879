#!/usr/bin/env bash
# Install, start a local 1P+1D cluster (tiny generated model, CPU), run a 6-turn agent
# session through the proxy (token ids; the last turn strips the previous output),
# print where each turn's prompt KV came from, and stop.
# DEMO_PROXY_PORT (8000) and DEMO_BASE_PORT (8100, engines count up from it) move its ports.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh --demo
. "${SESSIONKV_VENV:-.venv}/bin/activate"
PROXY_PORT=${DEMO_PROXY_PORT:-8000}
LOG=$(mktemp -d)/cluster.out
python examples/local_cluster.py --prefill 1 --decode 1 --redis --proxy-port "$PROXY_PORT" \
  --base-port "${DEMO_BASE_PORT:-8100}" \
  --decode-only-max-uncached-tokens 64 >"$LOG" 2>&1 &
CLUSTER=$!
trap 'kill -TERM $CLUSTER 2>/dev/null; wait $CLUSTER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  grep -q '^READY' "$LOG" && break
  kill -0 $CLUSTER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 1
done
grep '^READY' "$LOG"
python examples/demo_chat.py --proxy "http://127.0.0.1:$PROXY_PORT" --turns 6 "$@"
