#!/usr/bin/env bash
# Run a command as on a fresh Debian machine, without changing this one: with a PATH that
# lacks npm, node, redis-server, redis-cli, ip, ss and helm, and a python3 without
# ensurepip (as Debian's before python3-venv).  apt-get is a stand-in that logs each
# package asked for and then exposes this machine's installed copy on that PATH (or, for
# python3-venv, gives python3 its ensurepip back); it installs nothing.  Used for
# docs/testing.md's fresh-machine timings:
#   bash ci/simulate_fresh_machine.sh bash ci/demo.sh
# REAL_PYTHON (default: the python3 first on PATH) is the interpreter behind python3.
#
#   bash ci/simulate_fresh_machine.sh [--public-index] [--fresh-home] COMMAND...
# --public-index: pip as on a machine that reaches only the public indexes: pip's
#   configuration files and PIP_* variables (this machine's local wheel folders and
#   indexes) hidden, and an empty pip cache.  PyTorch's CPU index is install.sh's
#   default, or SESSIONKV_TORCH_INDEX_URL (where that index cannot be reached, a
#   stand-in: python ci/wheel_index.py TORCH_WHEEL).
# --fresh-home: HOME an empty folder (no model cache, no vLLM compile cache).
set -euo pipefail
public_index=0 fresh_home=0
while [ $# -gt 0 ]; do
  case $1 in
    --public-index) public_index=1; shift ;;
    --fresh-home) fresh_home=1; shift ;;
    *) break ;;
  esac
done
REAL_PYTHON=${REAL_PYTHON:-$(command -v python3)}
REAL_PYTHON=$(readlink -f "$("$REAL_PYTHON" -c 'import sys; print(sys.executable)')")
FAKE=$(mktemp -d)
trap 'rm -rf "$FAKE"' EXIT
mkdir "$FAKE/bin"
hidden=" apt-get apt npm npx node nodejs redis-server redis-cli ip ss helm "
for dir in /usr/local/sbin /usr/local/bin /usr/sbin /usr/bin /sbin /bin; do
  [ -d "$dir" ] || continue
  for path in "$dir"/*; do
    name=${path##*/}
    case "$hidden" in *" $name "*) continue ;; esac
    case $name in python*|pip*) continue ;; esac
    [ -e "$FAKE/bin/$name" ] || { [ -x "$path" ] && [ -f "$path" ] && ln -s "$path" "$FAKE/bin/$name"; } || true
  done
done
expose() { local c; for c in "$@"; do ln -sf "$(command -v "$c")" "$FAKE/bin/$c"; done; }
cat >"$FAKE/bin/apt-get" <<APT
#!/usr/bin/env bash
echo "simulate_fresh_machine: apt-get \$*" >&2
[ "\$1" = install ] || exit 0
for pkg in "\$@"; do
  case \$pkg in
    redis-server) ln -sf $(command -v redis-server) $(command -v redis-cli) "$FAKE/bin/" ;;
    npm) ln -sf $(command -v npm 2>/dev/null || echo /nonexistent) $(command -v node 2>/dev/null || echo /nonexistent) "$FAKE/bin/" ;;
    iproute2) ln -sf $(command -v ip) $(command -v ss) "$FAKE/bin/" ;;
    python3-venv) touch "$FAKE/ensurepip" ;;
  esac
done
APT
cat >"$FAKE/bin/python3" <<PY
#!/usr/bin/env bash
# Debian's python3 before python3-venv: no ensurepip, so no venv.
if [ ! -e "$FAKE/ensurepip" ]; then
  case "\$*" in *ensurepip*|"-m venv"*) echo "python3: ensurepip is not available (simulated)" >&2; exit 1 ;; esac
fi
exec "$REAL_PYTHON" "\$@"
PY
chmod +x "$FAKE/bin/apt-get" "$FAKE/bin/python3"
unset VIRTUAL_ENV PYTHONPATH
if [ $public_index = 1 ]; then
  for var in $(compgen -e | grep '^PIP_' || true); do unset "$var"; done
  mkdir "$FAKE/pip-cache"
  export PIP_CONFIG_FILE=/dev/null PIP_CACHE_DIR="$FAKE/pip-cache"
  torch_index=${SESSIONKV_TORCH_INDEX_URL:-the PyTorch CPU index}
  echo "simulate_fresh_machine: pip sees PyPI and $torch_index only" >&2
fi
if [ $fresh_home = 1 ]; then
  mkdir "$FAKE/home"
  export HOME="$FAKE/home"
  echo "simulate_fresh_machine: HOME=$HOME (empty)" >&2
fi
PATH="$FAKE/bin" "$@"
