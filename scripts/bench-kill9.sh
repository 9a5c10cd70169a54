#!/usr/bin/env bash
# kill -9 under the pipeline benchmark's load: `stemq bench pipeline --jobs N --workers 64`
# against a nats-server of its own (ack wait 2 s), with two more `stemq worker` processes
# (fake engine, 32 job loops each, no isolation) pulling from the same pools; one of them
# is killed with SIGKILL a second into the run. The bench fails unless every job's view
# turns terminal; then every job must have exactly one outcome in the log, and the jobs
# the dead worker held were redelivered (started more than once).
# Usage: scripts/bench-kill9.sh [jobs]   (STEMQ_BIN=path: that binary instead of
# target/release/stemq, which must exist; needs python3 and nats-server on PATH)
set -uo pipefail
cd "$(dirname "$0")/.."
bin="$(realpath "${STEMQ_BIN:-target/release/stemq}")"; jobs=${1:-6000}
export PATH="$PWD/.stemq/venv/bin:$PATH" RUST_LOG=warn
tmp=$(mktemp -d); port=$((20000 + RANDOM % 20000))
nats-server -js -a 127.0.0.1 -p $port -sd "$tmp/nats" >"$tmp/nats.log" 2>&1 &
ns=$!
sleep 1
export NATS_URL="nats://127.0.0.1:$port" STEMQ_DATA_DIR="$tmp/data" STEMQ_LOG_FORMAT=json
mkdir -p "$tmp/data"
$bin nats apply --ack-wait-ms 2000 >/dev/null
w=()
for i in 1 2; do
  RUST_LOG=info STEMQ_WORKER_NAME=ext-$i $bin worker --engine fake --isolation none --concurrency 32 \
    --store "file://$tmp/store" >"$tmp/w$i.log" 2>&1 &
  w+=($!)
done
sleep 1
$bin bench pipeline --jobs "$jobs" --workers 64 --ack-wait-ms 2000 >"$tmp/bench.out" 2>&1 &
bench=$!
sleep 1.0
kill -9 "${w[0]}"; echo "killed worker ext-1 (pid ${w[0]}) with SIGKILL"
wait $bench; rc=$?
grep -E "jobs |end to end|latency p99" "$tmp/bench.out"; echo "bench rc=$rc"
python3 - "$port" "$jobs" <<'PY'
import json, socket, sys
port, jobs = int(sys.argv[1]), int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port)); f = s.makefile("rb"); f.readline()
s.sendall(b'CONNECT {"verbose":false,"headers":true}\r\nSUB _INBOX.k 1\r\n')
def info(filt, offset=0):
    body = json.dumps({"subjects_filter": filt, "offset": offset}).encode()
    s.sendall(b"PUB $JS.API.STREAM.INFO.STEMQ_JOBS _INBOX.k %d\r\n%s\r\n" % (len(body), body))
    while True:
        l = f.readline()
        if l.startswith(b"PING"): s.sendall(b"PONG\r\n"); continue
        if l.startswith(b"MSG"):
            return json.loads(f.read(int(l.split()[-1]) + 2)[:-2])
def counts(filt):
    out, off = {}, 0
    while True:
        r = info(filt, off); subj = r["state"].get("subjects") or {}
        out.update(subj); off += len(subj)
        if not subj or off >= r.get("total", 0): return out
outcomes, started = counts("stemq.jobs.*.outcome"), counts("stemq.jobs.*.started")
print(f"jobs with an outcome: {len(outcomes)} of {jobs}; with more than one: {sum(1 for c in outcomes.values() if c > 1)}")
print(f"jobs started more than once (in flight at the kill, redelivered): {sum(1 for c in started.values() if c > 1)}")
sys.exit(0 if len(outcomes) == jobs and all(c == 1 for c in outcomes.values()) else 1)
PY
check=$?
kill -TERM "${w[1]}" 2>/dev/null; wait "${w[1]}" 2>/dev/null
kill -TERM $ns; wait $ns 2>/dev/null
for i in 1 2; do echo "jobs succeeded by ext-$i: $(grep -c 'job.succeeded' "$tmp/w$i.log")"; done
rm -rf "$tmp"
exit $((rc || check))
