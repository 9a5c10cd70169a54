#!/usr/bin/env bash
# The cost of per-key limits: `stemq bench http` (32 connections, distinct bodies, offered
# faster than the stack answers) against the ingress of one `stemq dev` stack (fake
# engine), one API key per limit shape, the shapes taken in turn ROUNDS times so they
# share the machine's state (even rounds take them in reverse, so the backlog the fake
# engine works through weighs on each shape alike). The anchor is the key without limits (what
# scripts/bench-http.sh uses). Each run prints the answers a second (202 and 429 alike),
# the 202s a second, the 429s (where a limit refused) and the service time's p99.
# Usage: scripts/bench-limits.sh [seconds per run] [rounds] [offered rate]
# STEMQ_BIN=path: measure that binary instead of building target/release/stemq.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-10}"
rounds="${2:-2}"
rate="${3:-20000}"
source scripts/lib/dev-stack.sh
dev_stack 18182
# name, then the key's limits (none given: `stemq keys create`'s defaults).
declare -A keys
keys[none]="$(dev_key none --rate 0 --max-in-flight 0)"
keys[defaults]="$(dev_key defaults)"
keys[bucket]="$(dev_key bucket --rate 100000 --burst 100000 --max-in-flight 0)"
keys[both]="$(dev_key both --rate 100000 --burst 100000 --max-in-flight 10000)"
echo "seconds per run: $secs; rounds: $rounds; offered: $rate/s; machine: $(nproc) cores"
printf '%-9s %-6s %12s %10s %8s %14s\n' limits round answers/s 202s/s 429s "service p99 ms"
for round in $(seq 1 "$rounds"); do
  order=(none defaults bucket both)
  (( round % 2 == 0 )) && order=(both bucket defaults none)
  for name in "${order[@]}"; do
    out="$(STEMQ_API_KEY="${keys[$name]}" "$bin" bench http --api "http://$http" --rate "$rate" \
      --seconds "$secs" --connections 32 --store-base "$STEMQ_STORE_BASE" --owner local --accept 202,429)"
    answered="$(awk '$1 == "answered" {print $2}' <<<"$out")"
    accepted="$(awk '$1 == "accepted" {print $3}' <<<"$out")"
    refused="$(grep -o "429: [0-9]*" <<<"$out" | awk "{print \$2}" || true)"
    p99="$(awk '$1 == "service" {print $8}' <<<"$out")"
    printf '%-9s %-6s %12s %10s %8s %14s\n' "$name" "$round" "$answered" "$accepted" "${refused:-0}" "$p99"
  done
done
