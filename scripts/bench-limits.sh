#!/usr/bin/env bash
# The cost of per-key limits: wrk (2 threads, 32 connections, distinct bodies) against the
# ingress of one `stemq dev` stack (fake engine), one API key per line, the lines taken in
# turn ROUNDS times so they share the machine's state. The anchor is the key without
# limits (what scripts/bench-http.sh uses). Each run prints requests/s and the answers
# that were not 2xx (429s, where a limit refused).
# Usage: scripts/bench-limits.sh [seconds per run] [rounds]   (needs wrk)
# STEMQ_BIN=path: measure that binary instead of building target/release/stemq.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-10}"
rounds="${2:-2}"
scripts/install-nats.sh >/dev/null
export PATH="$PWD/.stemq/venv/bin:$PATH"
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install -y wrk" >&2; exit 1; }
bin="${STEMQ_BIN:-}"
if [[ -z "$bin" ]]; then
  cargo build --release --locked -p stemq >/dev/null
  bin=target/release/stemq
fi
parent="${STEMQ_BENCH_DIR:-}"
if [[ -z "$parent" && -d /dev/shm && -w /dev/shm ]]; then parent=/dev/shm; fi
data="$(mktemp -d -p "${parent:-${TMPDIR:-/tmp}}")"
http=127.0.0.1:18182
RUST_LOG=warn "$bin" dev --engine fake --concurrency 8 --data-dir "$data" --http "$http" \
  --log-format json >"$data/dev.log" 2>&1 &
dev=$!
trap 'kill -TERM $dev 2>/dev/null; wait $dev 2>/dev/null; rm -rf "$data"' EXIT
for _ in $(seq 1 300); do
  curl -fs "http://$http/readyz" >/dev/null 2>&1 && break
  sleep 0.1
done
for _ in $(seq 1 300); do [[ -s "$data/nats.url" ]] && break; sleep 0.1; done
export STEMQ_STORE_BASE="file://$(cd "$data" && pwd)/store"
key() {
  NATS_URL="$(cat "$data/nats.url")" STEMQ_DATA_DIR="$data" "$bin" keys create --owner local --role operator \
    --name "bench-$1" "${@:2}" 2>/dev/null
}
# name, then the key's limits (none given: `stemq keys create`'s defaults).
declare -A keys
keys[none]="$(key none --rate 0 --max-in-flight 0)"
keys[defaults]="$(key defaults)"
keys[bucket]="$(key bucket --rate 100000 --burst 100000 --max-in-flight 0)"
keys[both]="$(key both --rate 100000 --burst 100000 --max-in-flight 10000)"
echo "seconds per run: $secs; rounds: $rounds; machine: $(nproc) cores"
printf '%-9s %-6s %12s %10s %12s\n' limits round requests/s p99 non-2xx
for round in $(seq 1 "$rounds"); do
  for name in none defaults bucket both; do
    out="$(STEMQ_API_KEY="${keys[$name]}" wrk -t2 -c32 -d"${secs}s" --latency -s scripts/wrk-submit.lua \
      "http://$http/v1/separations")"
    rps="$(awk '/^Requests\/sec/ {print $2}' <<<"$out")"
    p99="$(awk '$1 == "99%" {print $2}' <<<"$out")"
    non2xx="$(awk '/Non-2xx/ {print $NF}' <<<"$out")"
    printf '%-9s %-6s %12s %10s %12s\n' "$name" "$round" "$rps" "$p99" "${non2xx:-0}"
  done
done
