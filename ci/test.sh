#!/usr/bin/env bash
# Install, then run the whole test suite: unit tests, the proxy and index suites
# (real Redis, real ZMQ), and end-to-end tests on real vLLM servers with NIXL.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
. .venv/bin/activate
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -ra -p no:cacheprovider "$@"
