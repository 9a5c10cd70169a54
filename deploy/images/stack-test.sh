#!/usr/bin/env bash
# The services image run the way deploy/kubernetes runs it, with podman on one host: a
# nats-server with stemq's NATS users (installed by scripts/install-nats.sh), moto as S3
# (scripts/install-test-deps.sh), then `nats apply`, projector, worker, relay and ingress
# each in its own container, as its own NATS user, read-only root filesystem, the
# environment variables of deploy/kubernetes/base; a song submitted over HTTP with an
# API key must come back as four stems. Not part of scripts/test.sh (needs podman).
#   deploy/images/stack-test.sh localhost/stemq/services:test
set -euo pipefail
cd "$(dirname "$0")/../.."
image=${1:?image}
venv=$PWD/.stemq/venv/bin
w=$(mktemp -d)
chmod 0777 "$w"
pids=()
containers=()
cleanup() {
  for c in "${containers[@]}"; do podman rm -f "$c" >/dev/null 2>&1 || true; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$w"
}
trap cleanup EXIT
logs() { for c in "${containers[@]}"; do echo "--- $c"; podman logs "$c" 2>&1 | tail -5; done; }
trap 'echo "failed at line $LINENO" >&2; logs' ERR
tag=stemq-stack-$$

echo "== NATS users (stemq nats users, in the image)"
for u in operator ingress worker projector relay; do
  podman run --rm -v "$w:/w" "$image" nats users add "$u" --dir /w/creds >/dev/null && echo "user $u"
done
podman run --rm -v "$w:/w" "$image" nats users conf --dir /w/creds > "$w/auth.conf"
cat > "$w/nats.conf" <<CONF
listen: 127.0.0.1:14222
http: 127.0.0.1:18222
server_name: stack
max_payload: 8MB
jetstream { store_dir: "$w/js" }
include auth.conf
CONF
"$venv/nats-server" -c "$w/nats.conf" > "$w/nats.log" 2>&1 & pids+=($!)
"$venv/moto_server" -H 127.0.0.1 -p 15000 > "$w/moto.log" 2>&1 & pids+=($!)
for _ in $(seq 30); do curl -fsS http://127.0.0.1:18222/healthz >/dev/null 2>&1 && curl -fsS http://127.0.0.1:15000/ >/dev/null 2>&1 && break; sleep 0.5; done
curl -fsS -X PUT http://127.0.0.1:15000/stemq >/dev/null   # the bucket

# What stemq-config, stemq-s3 and each Deployment set (deploy/kubernetes/base).
common=(--network host --read-only --tmpfs /data:rw,U
  -e NATS_URL=nats://127.0.0.1:14222 -e STEMQ_STORE=s3://stemq/data -e STEMQ_DATA_DIR=/data
  -e STEMQ_LOG_FORMAT=json -e AWS_REGION=us-east-1 -e AWS_ACCESS_KEY_ID=test
  -e AWS_SECRET_ACCESS_KEY=test -e AWS_ENDPOINT_URL=http://127.0.0.1:15000 -e AWS_ALLOW_HTTP=true)
as() { # as USER: mount USER's credentials as its Secret would be
  echo -v "$w/creds/$1.nk:/var/run/secrets/stemq/nats/$1.nk:ro" -e "STEMQ_NATS_CREDS=/var/run/secrets/stemq/nats/$1.nk"
}
start() { # start NAME USER "K=V K=V" ARGS...: a Deployment's container
  local name=$tag-$1 user=$2 envs=() kv; shift 2
  for kv in $1; do envs+=(-e "$kv"); done
  shift
  # shellcheck disable=SC2046
  podman run -d --name "$name" "${common[@]}" $(as "$user") "${envs[@]}" "$image" "$@" >/dev/null
  containers+=("$name")
}

echo "== nats apply (the Job)"
# shellcheck disable=SC2046
podman run --rm "${common[@]}" $(as operator) "$image" nats apply > "$w/apply.log" && tail -3 "$w/apply.log"
start projector projector "STEMQ_METRICS_ADDR=127.0.0.1:19465 STEMQ_QUEUE_METRICS=true" projector
start worker worker "STEMQ_METRICS_ADDR=127.0.0.1:19464 STEMQ_ENGINE=dsp STEMQ_GRACE_S=600 STEMQ_WORKER_NAME=stack-worker" worker
start relay relay "STEMQ_METRICS_ADDR=127.0.0.1:19466" relay
start ingress ingress "STEMQ_HTTP_ADDR=127.0.0.1:18081" ingress
for _ in $(seq 60); do curl -fsS http://127.0.0.1:18081/readyz >/dev/null 2>&1 && break; sleep 1; done
echo "readyz: $(curl -fsS http://127.0.0.1:18081/readyz)" || { logs; exit 1; }
for port in 19464 19465 19466; do
  for _ in $(seq 20); do curl -fsS "http://127.0.0.1:$port/metrics" >/dev/null 2>&1 && break; sleep 0.5; done
  curl -fsS "http://127.0.0.1:$port/metrics" | grep -q '^# ' && echo "metrics on $port: ok"
done

echo "== an API key, a song through the HTTP API"
# shellcheck disable=SC2046
key=$(podman run --rm "${common[@]}" $(as operator) "$image" keys create --owner stack --role admin | grep -o 'sk_[0-9a-f_]*' | head -1)
[[ -n $key ]] || { echo "no key" >&2; exit 1; }
podman run --rm -v "$w:/w" "$image" synth --seconds 5 -o /w/song.wav
podman run --rm --network host -v "$w:/w" -e STEMQ_API_KEY="$key" "$image" \
  submit /w/song.wav --api http://127.0.0.1:18081 --wait -o /w/stems > "$w/submit.log" && tail -4 "$w/submit.log"
n=$(find "$w/stems" -name '*.wav' | wc -l)
if [[ $n -lt 4 ]]; then
  logs
  echo "expected 4 stems, got $n" >&2; exit 1
fi
echo "== SIGTERM: the worker drains and exits"
podman stop -t 30 "$tag-worker" >/dev/null && echo "worker exit code $(podman inspect -f '{{.State.ExitCode}}' "$tag-worker")"
echo "stack test: ok ($n stems, five containers as their own NATS users)"
