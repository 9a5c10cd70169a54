#!/usr/bin/env bash
# The main job, end to end, on local defaults: no cloud account, no GPU, no downloads.
# Installs nats-server (into ./.stemq/venv), builds stemq, starts `stemq dev`, synthesises a
# 20-second song, separates it into stems through the whole pipeline (upload → queue →
# worker with the built-in dsp engine → object store → status view), writes the stems
# to ./stems/, and ends with the URL of the page (GET /): in a terminal the stack stays
# up for it, signed in by a one-time link, until Ctrl-C; otherwise it stops cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-nats.sh >/dev/null
export PATH="$PWD/.stemq/venv/bin:$PATH"
echo "== building stemq (release)"
cargo build --release --locked -p stemq
bin="$PWD/target/release/stemq"
data="${STEMQ_DATA_DIR:-$PWD/.stemq/demo}"
out="${1:-$PWD/stems}"
http="${STEMQ_HTTP_ADDR:-127.0.0.1:8080}"
mkdir -p "$data"
rm -f "$data/nats.url"

echo "== starting stemq dev (HTTP $http, data in $data; log: $data/dev.log)"
"$bin" dev --data-dir "$data" --http "$http" --log-format text >"$data/dev.log" 2>&1 &
dev=$!
stop() {
  if kill -0 "$dev" 2>/dev/null; then
    kill -TERM "$dev"
    wait "$dev" || true
  fi
}
trap stop EXIT
for _ in $(seq 1 300); do
  [[ -s "$data/nats.url" ]] && break
  kill -0 "$dev" 2>/dev/null || { echo "stemq dev exited:"; cat "$data/dev.log"; exit 1; }
  sleep 0.1
done
export NATS_URL="$(cat "$data/nats.url")"
export STEMQ_DATA_DIR="$data"

echo "== synthesising a 20 s song"
"$bin" synth --seconds 20 -o "$data/demo-song.wav"

echo "== separating (model dsp) through the HTTP API, with the admin key stemq dev wrote to $data/admin.key"
"$bin" submit "$data/demo-song.wav" --model dsp --wait -o "$out" --api "http://$http"

link="$(grep -o "http://[^ ]*#signin=[0-9a-f]*" "$data/dev.log" | tail -n 1 || true)"
if [[ -t 0 && -t 1 && -z "${STEMQ_DEMO_EXIT:-}" ]]; then
  echo
  echo "Stems of the demo song are in $out:"
  ls -l "$out"
  echo
  echo "The page (drop a song, watch it move, listen to the stems; signs this browser in once):"
  echo "  $link"
  echo "Ctrl-C stops stemq dev."
  wait "$dev" || true
  exit 0
fi
echo "== stopping stemq dev"
stop
trap - EXIT
echo
echo "Stems of the demo song are in $out:"
ls -l "$out"
echo
echo "The page: run the demo in a terminal (it then stays up), or \`target/release/stemq dev\`, and open"
echo "  http://$http/   (stemq dev prints a link that signs you in)"
