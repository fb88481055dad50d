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
# (the lab hosts and the Ansible roles use Debian's OpenJDK 17 at its usual path)
[ -d /usr/lib/jvm/java-17-openjdk-amd64 ] || need_debs+=(openjdk-17-jre-headless)
# The HTML heat map is checked in headless Chromium (the test tier).
command -v chromium >/dev/null 2>&1 || need_debs+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need_debs+=(chromium-driver)
# The lab tier: systemd hosts (systemd-nspawn) over an overlay of this
# machine's root reached by SSH, so the packages the hosts need are
# installed here (their services are not started here, see below).
command -v systemd-nspawn >/dev/null 2>&1 || need_debs+=(systemd-container)
[ -x /usr/sbin/sshd ] || need_debs+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need_debs+=(openssh-client)
[ -x /usr/sbin/cron ] || need_debs+=(cron)
command -v sudo >/dev/null 2>&1 || need_debs+=(sudo)
command -v flock >/dev/null 2>&1 || need_debs+=(util-linux)
# Monitoring: promtool checks and tests the alert rules (a unit test); the
# lab's monitoring host runs this Prometheus (roles/roadlog_monitoring).
command -v promtool >/dev/null 2>&1 || need_debs+=(prometheus)
PY=$(command -v python3.11 || echo /usr/bin/python3.11)
if [ -x "$PY" ] && ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  need_debs+=(python3.11-venv)
fi
if [ "${#need_debs[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing Debian packages: ${need_debs[*]} (run as root to install them)"; exit 1
  fi
  log "installing Debian packages: ${need_debs[*]}"
  # Installed for the lab hosts, not to run here: no service starts now.
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    own_policy=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_debs[@]}" >/dev/null
  if [ "$own_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
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
