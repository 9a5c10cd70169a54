#!/usr/bin/env bash
# Messages through nats-server per job, with a fleet: the pipeline benchmark (its own
# worker, projector and submit loop) against a nats-server of ours with monitoring,
# while EXTRA worker processes (fake engine, `dsp`, stems on tmpfs) share its pool.
# Prints jobs/s and the server's in/out messages per job (from /varz).
#
#   STEMQ_BIN=target/release/stemq scripts/bench-fleet-messages.sh [EXTRA_WORKERS] [JOBS]
#
# Needs nats-server on PATH (scripts/install-nats.sh) and curl. Used in
# docs/benchmarks.md ("Messages through nats-server per job").
set -euo pipefail
extra=${1:-3}
jobs=${2:-10000}
bin=${STEMQ_BIN:-target/release/stemq}
port=${NATS_PORT:-4333}
http=${NATS_HTTP_PORT:-8322}
# The nats-server that scripts/install-nats.sh puts in the project's venv, if none is on PATH.
command -v nats-server >/dev/null || export PATH="$PWD/.stemq/venv/bin:$PATH"
command -v nats-server >/dev/null || { echo "nats-server not found (scripts/install-nats.sh)" >&2; exit 1; }
dir=$(mktemp -d)
shm=$(mktemp -d -p /dev/shm 2>/dev/null || mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir" "$shm"
}
trap cleanup EXIT

mkdir -p "$dir/ns"
nats-server -js -a 127.0.0.1 -p "$port" -m "$http" -sd "$dir/ns" >"$dir/nats.log" 2>&1 &
pids+=($!)
url=nats://127.0.0.1:$port
for _ in $(seq 50); do curl -sf "localhost:$http/healthz" >/dev/null && break; sleep 0.1; done
RUST_LOG=warn "$bin" --nats-url "$url" --data-dir "$dir/apply" nats apply >/dev/null
for i in $(seq "$extra"); do
  RUST_LOG=warn "$bin" --nats-url "$url" --data-dir "$dir/w$i" worker --store "file://$shm/w$i" \
    --engine fake --fake-models dsp --concurrency 16 --name "fleet-$i" >"$dir/w$i.log" 2>&1 &
  pids+=($!)
done
sleep 3
varz() { curl -s "localhost:$http/varz" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["in_msgs"], d["out_msgs"])'; }
read -r in0 out0 < <(varz)
out=$(RUST_LOG=warn "$bin" --nats-url "$url" --data-dir "$dir/bench" bench pipeline --jobs "$jobs" --workers 64 2>&1)
read -r in1 out1 < <(varz)
echo "$out" | grep -E 'end to end|per job|stages|answered|until'
python3 -c "print(f'  messages/job    in {($in1-$in0)/$jobs:.2f}, out {($out1-$out0)/$jobs:.2f} ($extra extra worker processes)')"
