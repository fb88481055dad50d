#!/usr/bin/env bash
# The roadlog demo: a three-node cluster on 127.0.0.1, a city topic,
# simulated traffic with a jam around a hot spot, a leader killed and
# replaced while writes go on, a traffic heat map built by Spark from the
# replicated log (out/heatmap.png and out/heatmap.html show the jam), the
# streaming heat map's first trigger, and the dashboard's address (HTTPS,
# like every port of the cluster: its own CA in out/cluster/ca).
# Everything it starts is stopped at the end (--keep leaves the cluster up,
# to look at the dashboard).
set -euo pipefail
cd "$(dirname "$0")/.."
keep=0
[ "${1:-}" = "--keep" ] && keep=1
./scripts/setup.sh
R=.venv/bin/roadlog
DIR=out/cluster
step() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }

if [ -f "$DIR/cluster.json" ]; then "$R" cluster down --dir "$DIR" || true; fi
rm -rf "$DIR" out/streams/munich   # a stream's checkpoint belongs to the cluster it read
if [ "$keep" = 0 ]; then trap '"$R" cluster down --dir "$DIR" >/dev/null 2>&1 || true' EXIT; fi

step "starting 3 node daemons and a queue server on 127.0.0.1"
"$R" cluster up --nodes 3 --queue-servers 1 --dir "$DIR"
"$R" cluster status --cluster "$DIR"

step "creating the topic 'munich' for a box around the city"
"$R" topic create munich --bbox 11.45,48.08,11.70,48.20 --cluster "$DIR"

step "simulating 5 minutes of 300 vehicles, with a jam at Marienplatz"
"$R" simulate munich --vehicles 300 --duration 300 --hotspot 11.575,48.137 --cluster "$DIR"

step "killing the leader (SIGKILL) and writing on"
leader=$("$R" cluster status --cluster "$DIR" --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["leader"])')
"$R" cluster kill "$leader" --dir "$DIR"
"$R" simulate munich --vehicles 100 --duration 60 --seed 2 --cluster "$DIR"
"$R" cluster status --cluster "$DIR"
"$R" cluster start "$leader" --dir "$DIR"

step "what the topic holds, and a few pings read back"
"$R" topic describe munich --cluster "$DIR"
"$R" consume munich --partition 0 --limit 5 --format jsonl --cluster "$DIR"

step "building the traffic heat map of the last 15 minutes with Spark (local[2])"
"$R" heatmap build munich --since 15m --cluster "$DIR" --out out/heatmaps

step "reading it back (allowed: this client sent pings to Munich) as PNG and HTML"
"$R" heatmap get munich --png out/heatmap.png --html out/heatmap.html --geojson out/heatmap.geojson --cluster "$DIR"

step "the streaming heat map: one trigger (roadlog heatmap stream munich --every 60s runs on)"
"$R" heatmap stream munich --every 60s --window 15m --once --checkpoint out/streams/munich --cluster "$DIR"

step "done"
echo "Open out/heatmap.png or out/heatmap.html (works offline). Logs are in $DIR/logs." >&2
http=$("$R" cluster status --cluster "$DIR" --json | .venv/bin/python -c 'import json,sys; print(next(q["http"] for q in json.load(sys.stdin)["queue_servers"] if q["http"]))')
if [ "$keep" = 1 ]; then
  echo "The cluster keeps running: .venv/bin/roadlog cluster down --dir $DIR" >&2
  echo "Live: .venv/bin/roadlog heatmap stream munich --every 60s --cluster $DIR (and more traffic: .venv/bin/roadlog simulate munich --vehicles 300 --duration 600 --hotspot 11.575,48.137 --cluster $DIR)" >&2
else
  echo "The cluster stops now; run ./scripts/demo.sh --keep to look at the dashboard." >&2
fi
case "$http" in https://*)
  echo "(HTTPS with the cluster's own CA: import $DIR/ca/ca.crt into the browser, or accept its warning)" >&2 ;;
esac
# The page asks as the identity in its fragment (kept by the browser, never
# sent in a URL): the demo's, which sent the pings, so give-to-get lets it
# see Munich's heat map. Without a token the page registers one of its own,
# which sees the map only once it contributes.
echo "Dashboard (as the demo's identity, which sent the pings; the token is $DIR/admin.token):"
echo "$http/ui/?topic=munich#token=$(cat "$DIR/admin.token")"
exit 0
