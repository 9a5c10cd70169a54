#!/usr/bin/env bash
# The pipeline benchmark with its stems stored on S3 across a network: moto's S3 server
# (installed by scripts/install-test-deps.sh) behind scripts/delay-proxy.py, which holds
# every chunk DELAY_MS each way (5 by default), all on loopback.
# Usage: scripts/bench-s3.sh [JOBS] [RATE]   (300 jobs at 20/s by default)
# STEMQ_BIN=path: measure that binary instead of target/release/stemq.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${1:-300}"
rate="${2:-20}"
delay_ms="${DELAY_MS:-5}"
scripts/install-nats.sh >/dev/null
export PATH="$PWD/.stemq/venv/bin:$PATH"
command -v moto_server >/dev/null || { echo "moto_server is needed: scripts/install-test-deps.sh" >&2; exit 1; }
bin="${STEMQ_BIN:-target/release/stemq}"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
s3_port="$(free_port)"
proxy_port="$(free_port)"
moto_server -p "$s3_port" >/dev/null 2>&1 &
moto=$!
python3 scripts/delay-proxy.py "$proxy_port" "$s3_port" "$(python3 -c "print($delay_ms / 1000)")" &
proxy=$!
trap 'kill $moto $proxy 2>/dev/null' EXIT
for _ in $(seq 1 100); do curl -fs -o /dev/null "http://127.0.0.1:$s3_port/" && break; sleep 0.1; done
curl -fs -X PUT -o /dev/null "http://127.0.0.1:$s3_port/bench"
export AWS_ENDPOINT_URL="http://127.0.0.1:$proxy_port" AWS_ALLOW_HTTP=true AWS_REGION=us-east-1 \
  AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing
echo "S3: moto on $s3_port, reached through a proxy holding each chunk ${delay_ms} ms each way" >&2
RUST_LOG="${RUST_LOG:-warn}" "$bin" bench pipeline --store s3://bench --jobs "$jobs" --rate "$rate" --workers 16
