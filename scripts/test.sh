#!/usr/bin/env bash
# The test suite: installs what the tests need, then runs every test of the workspace.
# Integration tests start their own nats-server per test (random port, temp store).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-nats.sh
if [[ -x scripts/install-test-deps.sh ]]; then scripts/install-test-deps.sh; fi
export PATH="$PWD/.stemq/venv/bin:$PATH"
cargo test --workspace --locked "$@"
