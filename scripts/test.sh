#!/usr/bin/env bash
# The test suite: installs what the tests need, then runs every test of the workspace,
# the HTDemucs pipeline test included.
# Integration tests start their own nats-server per test (random port, temp store).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-nats.sh
if [[ -x scripts/install-test-deps.sh ]]; then scripts/install-test-deps.sh; fi
export PATH="$PWD/.stemq/venv/bin:$PATH"
# The skip rule for a check whose tool is missing: in CI (CI=true) the run fails; elsewhere
# it prints a SKIPPED line and goes on. $1 says what is skipped, $2 what it needs.
missing() {
  if [[ "${CI:-}" == "true" ]]; then
    echo "$1 needs $2 (scripts/install-test-deps.sh installs it)" >&2
    exit 1
  fi
  echo "SKIPPED: $1 (needs $2: scripts/install-test-deps.sh)" >&2
}
# The alert rules: valid, and their unit tests (deploy/prometheus/tests.yml) pass. The
# Rust tests also run `promtool check metrics` on the /metrics bodies.
if command -v promtool >/dev/null 2>&1; then
  promtool check rules deploy/prometheus/alerts.yml
  promtool test rules deploy/prometheus/tests.yml
else
  missing "checking the alert rules" "promtool, Debian package prometheus"
fi
# The NATS contract, schemas/asyncapi.json (its staleness is a Rust test): a valid
# AsyncAPI 3.0 document for the AsyncAPI CLI (`asyncapi validate`, tests/asyncapi/, pinned;
# its usage metrics off; seconds).
if command -v node >/dev/null 2>&1 && [[ -x tests/asyncapi/node_modules/.bin/asyncapi ]]; then
  ASYNCAPI_METRICS_CONFIG_PATH="$PWD/tests/asyncapi/analytics-off.json" SUPPRESS_NO_CONFIG_WARNING=1 \
    tests/asyncapi/node_modules/.bin/asyncapi validate schemas/asyncapi.json --fail-severity error
else
  missing "validating schemas/asyncapi.json" "node, and npm ci in tests/asyncapi"
fi
# deploy/: Kubernetes manifests, KEDA, NATS cluster config, Containerfiles (seconds).
scripts/check-deploy.sh
# The fuzz targets (`fuzz_*` tests: request, event, ledger, audio, checkpoint) mutate their seed
# corpora for STEMQ_FUZZ_SECS each (3 s by default); CI gives each 30 s from a fixed seed,
# so a CI run is reproducible (random seeds, elsewhere, explore: docs/reliability.md).
if [[ "${CI:-}" == "true" ]]; then
  export STEMQ_FUZZ_SECS="${STEMQ_FUZZ_SECS:-30}" STEMQ_FUZZ_SEED="${STEMQ_FUZZ_SEED:-0x000000000005eed1}"
fi
# `stemq-tests/demucs` adds the pipeline test with the HTDemucs engine (it needs Burn,
# which the workspace compiles for stemq-demucs's own tests anyway). `stemq-tests/vulkan`
# adds Burn's Vulkan backend (CubeCL's kernels, the ones CUDA runs, through its SPIR-V
# compiler), here on Mesa's lavapipe: every parity suite runs again on the device (its
# `vulkan::` tests), and so do the engine's and the pipeline's Vulkan tests (a `stemq
# worker --device vulkan` serving a job, cross-job batching, a device allocation failure
# down the ladder, a worker killed mid-job). Without a Vulkan device they say SKIPPED
# (a failure in CI).
features=stemq-tests/demucs,stemq-tests/vulkan
if command -v vulkaninfo >/dev/null 2>&1; then
  echo "Vulkan device: $(vulkaninfo --summary 2>/dev/null | sed -n 's/^[[:space:]]*deviceName *= *//p' | head -n 1)" >&2
fi
# On lavapipe the bags and streamed runs of the LSTM families (v2, v3) take minutes
# each (a BLSTM launches thousands of tiny kernels): CI runs every family's blocks and
# whole models, and HTDemucs's suite whole; `STEMQ_VULKAN_ALL=1` runs the rest too
# (figures in docs/benchmarks.md).
skip=(--skip vulkan::apply_model_and_a_bag_of_both --skip vulkan::streaming_matches_apply_model)
# lavapipe's window-system code wants a runtime folder, which CI's shell lacks.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
[[ "${STEMQ_VULKAN_ALL:-}" == "1" ]] && skip=()
if [[ $# -gt 0 ]]; then
  cargo test --workspace --locked --features "$features" "$@"
else
  cargo test --workspace --locked --features "$features" -- "${skip[@]}"
fi
# The code path CUDA runs (Burn's generic tensor ops, none of the CPU host kernels), on
# the CPU: every parity suite's `cpu::` tests again (about 20 s).
# Same package selection and features as above, so cargo reuses those binaries instead of
# building Burn and the suites a second time with other features.
STEMQ_DEMUCS_GENERIC_OPS=1 cargo test --workspace --locked --features "$features" \
  --test parity --test parity_v3 --test parity_v2 --test parity_diffq -- cpu::
# Runs a test against a live `stemq dev` (the binary the tests just built) when what it
# needs is installed: $1 says what it is, $2 what it needs, $3 is the script, the rest
# the check that it can run.
live_test() {
  local what="$1" needs="$2" script="$3"
  shift 3
  if "$@"; then
    STEMQ_BIN="$PWD/target/debug/stemq-under-test" "$script"
  else
    missing "$what" "$needs"
  fi
}
# The API against its own document: Schemathesis (tests/api/, pinned in
# tests/api/requirements.txt) over every operation of /openapi.json, with a fixed seed
# (under a minute).
live_test "the API test" ".stemq/venv/bin/schemathesis" tests/api/run.sh test -x .stemq/venv/bin/schemathesis
# The page (GET /), as a person uses it: headless Chromium with axe-core (tests/web/;
# screenshots go to tests/web/artifacts/, not into git).
page_ready() {
  [[ -x /usr/bin/chromium ]] && command -v node >/dev/null 2>&1 && [[ -d tests/web/node_modules/playwright-core ]]
}
live_test "the page test" "/usr/bin/chromium, node, and npm ci in tests/web" tests/web/run.sh page_ready
# The clients other services use, each end to end against a live `stemq dev`: their models
# against schemas/ (drift), then submit over HTTP, NATS request-reply and a direct publish,
# watch to the end as the owner's NATS reader, verify a webhook, and another owner's users
# refused (about 10 s each).
live_test "the Python client test" "clients/python/requirements-dev.txt in .stemq/venv" clients/python/run-e2e.sh \
  .stemq/venv/bin/python -c 'import nats, httpx, standardwebhooks, pytest_asyncio, datamodel_code_generator'
ts_client_ready() {
  command -v node >/dev/null 2>&1 && [[ -d clients/typescript/node_modules/@nats-io/transport-node ]]
}
live_test "the TypeScript client test" "node, and npm ci in clients/typescript" clients/typescript/run-e2e.sh ts_client_ready
