# Sourced by tests/web/run.sh and tests/api/run.sh: starts `stemq dev` ($bin) in a
# temporary data dir on a free port and waits until it says it is up (its one-time
# sign-in link is printed then, after its worker and keys are in place). Sets `data`,
# `port`, `base`, `link` and `dev`; on exit the stack is stopped and the dir removed.
data="$(mktemp -d)"
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
base="http://127.0.0.1:$port"
"$bin" --data-dir "$data" --log-format text dev --http "127.0.0.1:$port" --isolation none >"$data/dev.log" 2>&1 &
dev=$!
stop_dev() {
  if kill -0 "$dev" 2>/dev/null; then kill -TERM "$dev"; wait "$dev" || true; fi
  rm -rf "$data"
}
trap stop_dev EXIT
link=""
for _ in $(seq 1 600); do
  link="$(grep -o "http://[^ ]*#signin=[0-9a-f]*" "$data/dev.log" || true)"
  [[ -n "$link" ]] && break
  kill -0 "$dev" 2>/dev/null || { echo "stemq dev exited:"; cat "$data/dev.log"; exit 1; }
  sleep 0.1
done
[[ -n "$link" ]] || { echo "stemq dev did not come up:"; tail -n 40 "$data/dev.log"; exit 1; }
