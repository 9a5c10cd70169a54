#!/usr/bin/env bash
# Checks deploy/ offline (under a minute): renders the Kustomize overlays, validates every
# object against the Kubernetes schemas (strict: unknown fields fail), checks what the
# schemas cannot (KEDA ScaledObjects, probes, resources, PDBs, secrets, env names:
# deploy/kubernetes/check.py), tests the NATS cluster configurations (Kubernetes and
# nats/cluster/) with nats-server itself, and lints the Containerfiles. Needs
# scripts/install-test-deps.sh and scripts/install-nats.sh (scripts/test.sh runs both
# first).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.stemq/venv/bin
for tool in kubernetes-validate hadolint nats-server python; do
  [[ -x $venv/$tool ]] || { echo "check-deploy: $venv/$tool missing: run scripts/install-test-deps.sh and scripts/install-nats.sh" >&2; exit 1; }
done
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
k=deploy/kubernetes

echo "== render (deploy/kubernetes/render.py: the Kustomize subset the overlays use)"
for overlay in dev production; do
  $venv/python $k/render.py $k/overlays/$overlay "$out/$overlay.yaml"
  echo "$overlay: $(grep -c '^kind:' "$out/$overlay.yaml") objects"
  # Where kubectl has kustomize built in, render.py must agree with it.
  if kubectl kustomize $k/overlays/$overlay > "$out/$overlay.kustomize.yaml" 2>/dev/null; then
    $venv/python $k/render.py --same-as "$out/$overlay.kustomize.yaml" $k/overlays/$overlay
    echo "$overlay: same objects as kubectl kustomize ($(kubectl version --client 2>/dev/null | grep -o 'Kustomize Version: .*'))"
  fi
done

echo "== Kubernetes schemas (kubernetes-validate --strict; 1.30 is the oldest with the preStop sleep action)"
for version in 1.30.0 1.37.0; do
  $venv/kubernetes-validate --strict --quiet --no-warn -k "$version" \
    "$out/dev.yaml" "$out/production.yaml" $k/secrets-example/secrets.yaml
  echo "$version: ok"
done

echo "== KEDA ScaledObjects, probes, resources, PDBs, secrets, env names"
$venv/python $k/check.py . "$out/dev.yaml" "$out/production.yaml"

echo "== NATS cluster configuration (nats-server -t)"
mkdir -p "$out/nats/config" "$out/nats/auth"
$venv/python - "$out/production.yaml" "$out/nats/config/nats.conf" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
(conf,) = [d["data"]["nats.conf"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config"]
# The Secret nats-tls is mounted at /etc/nats/tls in the pod; here it is a folder beside.
open(sys.argv[2], "w").write(conf.replace("/etc/nats/tls/", sys.argv[2].rsplit("/", 2)[0] + "/tls/"))
PY
# Stand-ins for the Secrets nats-auth (`stemq nats users conf` output) and nats-tls.
printf 'authorization {\n  users: [ {user: placeholder, password: placeholder} ]\n}\n' > "$out/nats/auth/auth.conf"
mkdir -p "$out/nats/tls"
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=nats -addext subjectAltName=DNS:nats \
  -keyout "$out/nats/tls/tls.key" -out "$out/nats/tls/tls.crt" 2>/dev/null
cp "$out/nats/tls/tls.crt" "$out/nats/tls/ca.crt"
POD_NAME=nats-0 $venv/nats-server -t -c "$out/nats/config/nats.conf"

echo "== nats/cluster (nats-server -t on each node's configuration)"
cp -r nats/cluster "$out/nats-cluster"
printf 'authorization {\n  users: [ {user: placeholder, password: placeholder} ]\n}\n' > "$out/nats-cluster/auth.conf"
for node in n1 n2 n3; do $venv/nats-server -t -c "$out/nats-cluster/$node.conf"; done

echo "== Containerfiles (hadolint)"
$venv/hadolint deploy/images/Containerfile.services deploy/images/Containerfile.worker-cuda deploy/images/Containerfile.worker-vulkan
for path in target/ .stemq/; do
  grep -qx "$path" deploy/images/context.ignore || { echo "deploy/images/context.ignore does not exclude $path" >&2; exit 1; }
done
echo "deploy: ok"
