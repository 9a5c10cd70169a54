#!/usr/bin/env bash
# The test suite: installs what the tests need, then runs every test of the workspace,
# the HTDemucs pipeline test included.
# Integration tests start their own nats-server per test (random port, temp store).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-nats.sh
if [[ -x scripts/install-test-deps.sh ]]; then scripts/install-test-deps.sh; fi
export PATH="$PWD/.stemq/venv/bin:$PATH"
# The alert rules: valid, and their unit tests (deploy/prometheus/tests.yml) pass. The
# Rust tests then also run `promtool check metrics` on the /metrics bodies.
if command -v promtool >/dev/null 2>&1; then
  promtool check rules deploy/prometheus/alerts.yml
  promtool test rules deploy/prometheus/tests.yml
  export STEMQ_REQUIRE_PROMTOOL=1
else
  echo "SKIPPED: promtool is not installed (Debian package prometheus): alert rules and /metrics bodies unchecked" >&2
fi
# deploy/: Kubernetes manifests, KEDA, NATS cluster config, Containerfiles (seconds).
scripts/check-deploy.sh
# The fuzz targets (`fuzz_*` tests: request, event, audio, checkpoint) mutate their seed
# corpora for STEMQ_FUZZ_SECS each (3 s by default); CI gives each a minute.
if [[ "${CI:-}" == "true" ]]; then export STEMQ_FUZZ_SECS="${STEMQ_FUZZ_SECS:-60}"; fi
# `stemq-tests/demucs` adds the pipeline test with the HTDemucs engine (it needs Burn,
# which the workspace compiles for stemq-demucs's own tests anyway).
cargo test --workspace --locked --features stemq-tests/demucs "$@"
# The API against its own document: Schemathesis (tests/api/, pinned in
# tests/api/requirements.txt) over every operation of /openapi.json on a live
# `stemq dev` (the binary the tests just built), with a fixed seed (under a minute).
if [[ -x .stemq/venv/bin/schemathesis ]]; then
  STEMQ_BIN="$PWD/target/debug/stemq-under-test" tests/api/run.sh
elif [[ "${CI:-}" == "true" ]]; then
  echo "the API test needs schemathesis in .stemq/venv (scripts/install-test-deps.sh)" >&2
  exit 1
else
  echo "SKIPPED: the API test (needs .stemq/venv/bin/schemathesis: scripts/install-test-deps.sh)" >&2
fi
# The page (GET /), as a person uses it: headless Chromium against a live `stemq dev`
# (the binary the tests just built), with axe-core (tests/web/; screenshots go to
# tests/web/artifacts/, not into git).
if [[ -x /usr/bin/chromium ]] && command -v node >/dev/null 2>&1 && [[ -d tests/web/node_modules/playwright-core ]]; then
  STEMQ_BIN="$PWD/target/debug/stemq-under-test" tests/web/run.sh
elif [[ "${CI:-}" == "true" ]]; then
  echo "the page test needs chromium, node and tests/web/node_modules (scripts/install-test-deps.sh)" >&2
  exit 1
else
  echo "SKIPPED: the page test (needs /usr/bin/chromium, node, and npm ci in tests/web)" >&2
fi
