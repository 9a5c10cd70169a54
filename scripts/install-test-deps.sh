#!/usr/bin/env bash
# Installs what the test suite needs besides Rust and nats-server, into ./.venv:
# - moto's S3-compatible server (`moto_server`), used by services/core/tests/s3.rs;
# - nats-py and standardwebhooks, used by tests/python/foreign_service.py
#   (run from tests/tests/python.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/pip ]] || python3 -m venv .venv
if [[ ! -x .venv/bin/moto_server ]]; then
  .venv/bin/pip install -q --disable-pip-version-check 'moto[server]==5.2.1'
fi
if ! .venv/bin/python -c 'import nats, standardwebhooks' 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt
fi
.venv/bin/moto_server --help >/dev/null
.venv/bin/python -c 'import nats, standardwebhooks' 
