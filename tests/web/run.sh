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
source "$root/tests/dev-stack.sh"
"$bin" synth --seconds 8 -o "$data/song.wav" >/dev/null
"$bin" synth --seconds 90 -o "$data/long.wav" >/dev/null
head -c 20000 /dev/urandom >"$data/not-audio.wav"
status=0
node "$here/page.test.mjs" "$base" "$link" "$data" "$data/song.wav" "$data/long.wav" "$data/not-audio.wav" || status=$?
if [[ $status -ne 0 ]]; then echo "--- stemq dev log (tail)"; tail -n 40 "$data/dev.log"; fi
exit $status
