#!/usr/bin/env bash
# Installs what the test suite needs besides Rust and nats-server, into ./.stemq/venv:
# - moto's S3-compatible server (`moto_server`), used by services/core/tests/s3.rs;
# - nats-py (with nkeys) and standardwebhooks, used by tests/python/foreign_service.py
#   (run from tests/tests/python.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .stemq/venv/bin/pip ]] || python3 -m venv .stemq/venv
if [[ ! -x .stemq/venv/bin/moto_server ]]; then
  .stemq/venv/bin/pip install -q --disable-pip-version-check 'moto[server]==5.2.1'
fi
if ! .stemq/venv/bin/python -c 'import nats, nkeys, standardwebhooks' 2>/dev/null; then
  .stemq/venv/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt
fi
.stemq/venv/bin/moto_server --help >/dev/null
.stemq/venv/bin/python -c 'import nats, nkeys, standardwebhooks'
