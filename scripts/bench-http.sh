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
[[ -n "$rate" ]] || command -v wrk >/dev/null || { echo "wrk is needed: apt-get install -y wrk" >&2; exit 1; }
source scripts/lib/dev-stack.sh
dev_stack 18181
# An operator key whose limits never bind: this measures the ingress, not the limits.
export STEMQ_API_KEY="$(dev_key http --rate 0 --max-in-flight 0)"
if [[ -n "$rate" ]]; then
  "$bin" bench http --api "http://$http" --rate "$rate" --seconds "$secs" --connections 32 \
    --store-base "$STEMQ_STORE_BASE" --owner local
else
  wrk -t2 -c32 -d"${secs}s" --latency -s scripts/wrk-submit.lua "http://$http/v1/separations"
fi
curl -fs -H "Authorization: Bearer $STEMQ_API_KEY" "http://$http/metrics" | grep -E '^stemq_submits_total' || true
