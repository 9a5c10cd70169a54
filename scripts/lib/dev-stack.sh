# Sourced by the HTTP benchmarks: one `stemq dev` stack (fake engine) for them to load.
# dev_stack PORT: builds target/release/stemq unless STEMQ_BIN names a binary, starts the
# stack with its data on tmpfs where there is one (STEMQ_BENCH_DIR overrides: a
# deployment's store is S3 on other machines, and on a churned ext4 the worker's file
# creations cost more CPU than the ingress; docs/benchmarks.md, "Settings, each against
# its alternative"), waits until it is ready, and stops it and removes its data on exit.
# It sets bin, data, http (host:port) and exports STEMQ_STORE_BASE.
# dev_key NAME [keys create options…]: prints a new operator key of owner `local`.
dev_stack() {
  scripts/install-nats.sh >/dev/null
  export PATH="$PWD/.stemq/venv/bin:$PATH"
  bin="${STEMQ_BIN:-}"
  if [[ -z "$bin" ]]; then
    cargo build --release --locked -p stemq >/dev/null
    bin=target/release/stemq
  fi
  local parent="${STEMQ_BENCH_DIR:-}"
  if [[ -z "$parent" && -d /dev/shm && -w /dev/shm ]]; then parent=/dev/shm; fi
  data="$(mktemp -d -p "${parent:-${TMPDIR:-/tmp}}")"
  echo "stack data in $data" >&2
  http="127.0.0.1:$1"
  RUST_LOG=warn "$bin" dev --engine fake --concurrency 8 --data-dir "$data" --http "$http" \
    --log-format json >"$data/dev.log" 2>&1 &
  dev_pid=$!
  trap 'kill -TERM $dev_pid 2>/dev/null; wait $dev_pid 2>/dev/null; rm -rf "$data"' EXIT
  for _ in $(seq 1 300); do
    curl -fs "http://$http/readyz" >/dev/null 2>&1 && break
    sleep 0.1
  done
  for _ in $(seq 1 300); do [[ -s "$data/nats.url" ]] && break; sleep 0.1; done
  export STEMQ_STORE_BASE="file://$(cd "$data" && pwd)/store"
}

dev_key() {
  NATS_URL="$(cat "$data/nats.url")" STEMQ_DATA_DIR="$data" "$bin" keys create --owner local --role operator \
    --name "bench-$1" "${@:2}" 2>/dev/null
}
