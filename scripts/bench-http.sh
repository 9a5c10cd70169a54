#!/usr/bin/env bash
# HTTP submit benchmark: wrk (2 threads, 32 connections, distinct bodies) against the
# ingress of a `stemq dev` stack with the fake engine, everything on this machine.
# Usage: scripts/bench-http.sh [seconds] [rate]   (needs wrk: apt-get install wrk)
# With a rate, `stemq bench http` offers that many submits a second instead (open loop,
# 32 connections, latency from each request's due time), against the same stack.
# STEMQ_BIN=path: measure that binary instead of building target/release/stemq.
# STEMQ_WRK_PACE_MS=N: wrk's connections each wait N ms after an answer before the next
# request (wrk offers about 32 / (N ms + latency) a second: 7 gives about 3 600/s on the
# 2-core machine), so wrk measures the latency at a rate instead of at saturation.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-15}"
rate="${2:-}"
scripts/install-nats.sh >/dev/null
export PATH="$PWD/.stemq/venv/bin:$PATH"
[[ -n "$rate" ]] || command -v wrk >/dev/null || { echo "wrk is needed: apt-get install -y wrk" >&2; exit 1; }
bin="${STEMQ_BIN:-}"
if [[ -z "$bin" ]]; then
  cargo build --release --locked -p stemq >/dev/null
  bin=target/release/stemq
fi
# The stack's data (nats-server's store, the object store) on tmpfs where there is one
# (STEMQ_BENCH_DIR overrides): a deployment's store is S3 on other machines, and on a
# churned ext4 the worker's file creations cost more CPU than the ingress
# (docs/benchmarks.md, "Settings, each against its alternative").
parent="${STEMQ_BENCH_DIR:-}"
if [[ -z "$parent" && -d /dev/shm && -w /dev/shm ]]; then parent=/dev/shm; fi
data="$(mktemp -d -p "${parent:-${TMPDIR:-/tmp}}")"
echo "stack data in $data" >&2
http=127.0.0.1:18181
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
# An operator key whose limits never bind: this measures the ingress, not the limits.
# (as the operator `stemq dev` wrote credentials for in its data dir)
export STEMQ_API_KEY="$(NATS_URL="$(cat "$data/nats.url")" STEMQ_DATA_DIR="$data" "$bin" keys create --owner local \
  --role operator --rate 0 --max-in-flight 0 --name bench-http 2>/dev/null)"
if [[ -n "$rate" ]]; then
  "$bin" bench http --api "http://$http" --rate "$rate" --seconds "$secs" --connections 32 \
    --store-base "$STEMQ_STORE_BASE" --owner local
else
  wrk -t2 -c32 -d"${secs}s" --latency -s scripts/wrk-submit.lua "http://$http/v1/separations"
fi
curl -fs -H "Authorization: Bearer $STEMQ_API_KEY" "http://$http/metrics" | grep -E '^stemq_submits_total' || true
