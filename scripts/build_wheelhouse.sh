#!/usr/bin/env bash
# Build the wheelhouse that Ansible copies to every host (hosts need no
# internet): roadlog's own wheel plus a wheel of every locked runtime
# dependency (requirements-host.lock). Output: build/wheelhouse/ with
# requirements.txt (what the hosts install, pinned), roadlog-*.whl, SHA256SUMS
# and wheelhouse.tar (all of them in one file: what Ansible copies).
#
# Reproducible: wheels built from sdists are cached by pip, and roadlog's
# wheel is built with SOURCE_DATE_EPOCH from the last commit, so an
# unchanged tree gives byte-identical files and a second `site.yml` run
# copies nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '[wheelhouse] %s\n' "$*" >&2; }
PY=${PY:-.venv/bin/python}
OUT=${OUT:-build/wheelhouse}
mkdir -p "$OUT"

stamp="$OUT/.deps-built"
if [ ! -f "$stamp" ] || [ requirements-host.lock -nt "$stamp" ]; then
  log "wheels of the locked runtime dependencies (first build of pyspark takes a minute)"
  "$PY" -m pip wheel -q --disable-pip-version-check --require-hashes \
    -r requirements-host.lock -w "$OUT" > build/wheelhouse.log 2>&1 || { cat build/wheelhouse.log >&2; exit 1; }
  touch "$stamp"
fi
# What hosts install: the lock's pins without hashes (pip checks the files
# it finds in the wheelhouse against these versions, --no-index).
grep -E '^[A-Za-z0-9_.-]+==' requirements-host.lock | sed 's/ *\\$//' > "$OUT/requirements.txt.new"
if ! cmp -s "$OUT/requirements.txt.new" "$OUT/requirements.txt"; then
  mv "$OUT/requirements.txt.new" "$OUT/requirements.txt"
else
  rm "$OUT/requirements.txt.new"
fi

log "roadlog's own wheel"
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 315532800)}
tmp=$(mktemp -d)
# The commit the hosts' processes tell as their release (roadlog/release.py):
# in the wheel only, never left in the tree (a stale one would be believed).
commit=$(git rev-parse HEAD 2>/dev/null || true)
trap 'rm -rf "$tmp" roadlog/COMMIT' EXIT
if [ -n "$commit" ]; then echo "$commit" > roadlog/COMMIT; fi
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation . -w "$tmp" > build/wheelhouse.log 2>&1 || { cat build/wheelhouse.log >&2; exit 1; }
new=$(ls "$tmp"/roadlog-*.whl)
# The wheel's name carries no build number; its content decides whether
# hosts reinstall. Replace it only when the files inside differ, the commit
# file (and the RECORD that lists its hash) aside: a commit that changed
# nothing of the package keeps the wheel, which names the earlier commit
# of identical code, and the hosts copy nothing.
old="$OUT/$(basename "$new")"
if [ -f "$old" ] && "$PY" - "$old" "$new" <<'PYEOF'
import sys, zipfile
a, b = (zipfile.ZipFile(p) for p in sys.argv[1:3])
def files(z):
    return sorted((i.filename, i.CRC) for i in z.infolist()
                  if i.filename != "roadlog/COMMIT" and not i.filename.endswith(".dist-info/RECORD"))
same = files(a) == files(b)
sys.exit(0 if same else 1)
PYEOF
then
  log "unchanged: $(basename "$new")"
else
  mv "$new" "$OUT/"
  log "built: $(basename "$new")"
fi
# What the hosts compare before copying 0.5 GB again (site.yml copies the
# wheels only when this list differs, then checks them with sha256sum -c).
(cd "$OUT" && sha256sum requirements.txt ./*.whl > SHA256SUMS.new)
if ! cmp -s "$OUT/SHA256SUMS.new" "$OUT/SHA256SUMS"; then
  mv "$OUT/SHA256SUMS.new" "$OUT/SHA256SUMS"
else
  rm "$OUT/SHA256SUMS.new"
fi
# One archive of it all for the hosts: Ansible's copy of a directory pays a
# module round trip per file (46 files: about two minutes for three hosts),
# one file costs one transfer. Reproducible (sorted, fixed times and
# owners), rebuilt only when the list of checksums changed.
if [ ! -f "$OUT/wheelhouse.tar" ] || ! cmp -s "$OUT/SHA256SUMS" "$OUT/.tar-sums"; then
  (cd "$OUT" && tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
    -cf wheelhouse.tar.new SHA256SUMS requirements.txt ./*.whl)
  mv "$OUT/wheelhouse.tar.new" "$OUT/wheelhouse.tar"
  cp "$OUT/SHA256SUMS" "$OUT/.tar-sums"
  log "archived: wheelhouse.tar"
fi
du -sh "$OUT" | awk '{print "[wheelhouse] " $2 ": " $1}' >&2
