#!/usr/bin/env bash
# Vendor Leaflet into queue_server/static/vendor/leaflet from the npm registry
# (npm's configured one): the dashboard loads nothing from elsewhere at run
# time. Run by hand to upgrade; the files and VENDORED.json (versions and
# SHA-256 sums, checked by tests/unit/queue_server/test_dashboard.py) are committed.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-1.9.4}
dest=queue_server/static/vendor/leaflet
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm install --no-audit --no-fund --no-save "leaflet@$version" >/dev/null)
src=$tmp/node_modules/leaflet
rm -rf "$dest"
mkdir -p "$dest/images"
cp "$src/dist/leaflet.js" "$src/dist/leaflet.css" "$src/LICENSE" "$dest/"
cp "$src"/dist/images/*.png "$dest/images/"
python3 - "$dest" "$version" <<'PY'
import hashlib, json, sys
from pathlib import Path
dest, version = Path(sys.argv[1]), sys.argv[2]
files = sorted(p for p in dest.rglob("*") if p.is_file() and p.name != "VENDORED.json")
doc = {
    "package": "leaflet",
    "version": version,
    "how": "scripts/vendor_leaflet.sh " + version,
    "sha256": {str(p.relative_to(dest)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
}
(dest / "VENDORED.json").write_text(json.dumps(doc, indent=2) + "\n")
PY
echo "vendored leaflet $version into $dest"
