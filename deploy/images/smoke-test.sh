#!/usr/bin/env bash
# Smoke test of a built services image with podman (not part of scripts/test.sh: it needs
# podman and a built image). Separates the synthetic song through `stemq dev` in a
# container and checks the image's basics (version, non-root user, no build tools).
#   deploy/images/smoke-test.sh localhost/stemq/services:test
# nats-server is not in the image (production runs NATS apart): the one scripts/install-nats.sh
# installs (a static binary) is mounted in for `stemq dev`.
# On the project's dev machines podman needs CONTAINERS_CONF (docs/deploy.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
image=${1:?image}
port=${SMOKE_PORT:-18080}
data=$(mktemp -d)
chmod 0777 "$data"
name=stemq-smoke-$$
cleanup() { podman rm -f "$name" >/dev/null 2>&1 || true; rm -rf "$data"; }
trap cleanup EXIT
run() { podman run --rm --network host -v "$data:/data" "$image" "$@"; }

echo "== version, user, no build tools"
podman run --rm "$image" --version
user=$(podman image inspect -f '{{.Config.User}}' "$image")
[[ $user == 65532:65532 ]] || { echo "image user is '$user', want 65532:65532" >&2; exit 1; }
for tool in cargo rustc cc gcc; do
  if podman run --rm --entrypoint /usr/bin/env "$image" sh -c "command -v $tool" >/dev/null 2>&1; then
    echo "$tool found in the image" >&2; exit 1
  fi
done
echo "user $user; no cargo/rustc/cc/gcc"

echo "== stemq dev in a container, a song separated through its HTTP API"
podman run -d --name "$name" --network host -v "$data:/data" \
  -v "$PWD/.stemq/venv/bin/nats-server:/usr/local/bin/nats-server:ro" \
  -e STEMQ_LOG_FORMAT=text "$image" dev --http "127.0.0.1:$port" >/dev/null
for _ in $(seq 60); do
  curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
  sleep 1
done
curl -fsS "http://127.0.0.1:$port/healthz"; echo " (healthz)"
curl -fsS "http://127.0.0.1:$port/readyz"; echo " (readyz)"
podman healthcheck run "$name" && echo "HEALTHCHECK ok"
run synth --seconds 5 -o /data/song.wav
run submit /data/song.wav --api "http://127.0.0.1:$port" --wait -o /data/stems
ls -l "$data/stems"
n=$(find "$data/stems" -name '*.wav' | wc -l)
[[ $n -ge 4 ]] || { echo "expected 4 stems, got $n" >&2; podman logs "$name" | tail -30; exit 1; }
echo "smoke test: ok ($n stems)"
