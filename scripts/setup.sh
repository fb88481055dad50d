#!/usr/bin/env bash
# Prepare this machine for roadlog: Debian packages, a Python 3.11 virtualenv
# at .venv with the locked dependencies, and roadlog installed in it (editable).
# Idempotent: a second run only checks. Needs root for apt on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup] %s\n' "$*" >&2; }

need_debs=()
command -v make >/dev/null 2>&1 || need_debs+=(make)
# The netns test tier: network namespaces on a bridge (iproute2), packet
# loss injected with nftables (this kernel has no netem).
command -v ip >/dev/null 2>&1 || need_debs+=(iproute2)
command -v nft >/dev/null 2>&1 || need_debs+=(nftables)
command -v python3.11 >/dev/null 2>&1 || need_debs+=(python3.11)
# Spark (pyspark from pip) runs on a JVM: Java 17 when there is none.
command -v java >/dev/null 2>&1 || need_debs+=(openjdk-17-jre-headless)
# The HTML heat map is checked in headless Chromium (the test tier).
command -v chromium >/dev/null 2>&1 || need_debs+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need_debs+=(chromium-driver)
PY=$(command -v python3.11 || echo /usr/bin/python3.11)
if [ -x "$PY" ] && ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  need_debs+=(python3.11-venv)
fi
if [ "${#need_debs[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing Debian packages: ${need_debs[*]} (run as root to install them)"; exit 1
  fi
  log "installing Debian packages: ${need_debs[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_debs[@]}" >/dev/null
  PY=$(command -v python3.11)
fi

stamp=.venv/.locked
if [ ! -x .venv/bin/python ]; then
  log "creating virtualenv .venv with $PY"
  "$PY" -m venv .venv
fi
pip_quiet() {
  # pip's own chatter goes to a log that is shown only when pip fails.
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check "$@" > .venv/pip.log 2>&1; then
    cat .venv/pip.log >&2
    log "pip install $* failed"
    exit 1
  fi
}
if [ ! -f "$stamp" ] || [ requirements.lock -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log "installing locked dependencies (requirements.lock)"
  pip_quiet --require-hashes -r requirements.lock
  log "installing roadlog itself (editable)"
  pip_quiet --no-deps -e .
  touch "$stamp"
fi
newest_proto=$(ls -t proto/roadlog/v1/*.proto | head -n 1)
if [ ! -f roadlog/v1/client_pb2.py ] || [ "$newest_proto" -nt roadlog/v1/client_pb2.py ] \
   || [ "$stamp" -nt roadlog/v1/client_pb2.py ]; then
  PY=.venv/bin/python ./scripts/gen_proto.sh
fi
log "ready: $(.venv/bin/python --version)"
