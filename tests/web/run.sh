#!/usr/bin/env bash
# Runs the page's end-to-end test (page.test.mjs) against a live `stemq dev`: starts it
# in a temporary data dir on a free port, makes the test's songs (the demo song, a
# longer one, and a file that is not audio), runs the test in headless Chromium, and
# stops the stack. Needs node, /usr/bin/chromium and `npm ci` here
# (scripts/install-test-deps.sh does all three).
# STEMQ_BIN: the stemq binary (default target/debug/stemq).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${STEMQ_BIN:-$root/target/debug/stemq}"
data="$(mktemp -d)"
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
base="http://127.0.0.1:$port"
"$bin" --data-dir "$data" --log-format text dev --http "127.0.0.1:$port" --isolation none >"$data/dev.log" 2>&1 &
dev=$!
stop() {
  if kill -0 "$dev" 2>/dev/null; then kill -TERM "$dev"; wait "$dev" || true; fi
  rm -rf "$data"
}
trap stop EXIT
link=""
for _ in $(seq 1 600); do
  link="$(grep -o "http://[^ ]*#signin=[0-9a-f]*" "$data/dev.log" || true)"
  [[ -n "$link" ]] && break
  kill -0 "$dev" 2>/dev/null || { echo "stemq dev exited:"; cat "$data/dev.log"; exit 1; }
  sleep 0.1
done
[[ -n "$link" ]] || { echo "stemq dev printed no sign-in link:"; cat "$data/dev.log"; exit 1; }
"$bin" synth --seconds 8 -o "$data/song.wav" >/dev/null
"$bin" synth --seconds 90 -o "$data/long.wav" >/dev/null
head -c 20000 /dev/urandom >"$data/not-audio.wav"
status=0
node "$here/page.test.mjs" "$base" "$link" "$data" "$data/song.wav" "$data/long.wav" "$data/not-audio.wav" || status=$?
if [[ $status -ne 0 ]]; then echo "--- stemq dev log (tail)"; tail -n 40 "$data/dev.log"; fi
exit $status
