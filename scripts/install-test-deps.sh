#!/usr/bin/env bash
# Installs what the test suite needs besides Rust and nats-server:
# - moto's S3-compatible server (`moto_server`), used by services/core/tests/s3.rs,
#   which skips (with a printed message) when it is absent.
set -euo pipefail
python3 -m pip install --quiet 'moto[server]==5.2.1'
command -v moto_server >/dev/null || { echo "moto_server not on PATH after install" >&2; exit 1; }
