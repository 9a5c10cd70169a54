#!/usr/bin/env bash
# The Python client's checks: the models' drift from schemas/, the type check, the unit
# tests, then the end-to-end tests against a live `stemq dev` ($STEMQ_BIN, default
# /tmp/stemq-bin/stemq) started by tests/dev-stack.sh. Exits non-zero on any failure.
#
#   clients/python/run-e2e.sh
#
# Python: $STEMQ_PYTHON, else ./.stemq/venv/bin/python (scripts/install-test-deps.sh
# installs clients/python/requirements-dev.txt there), else /tmp/pyclient-venv.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
here=clients/python
bin="${STEMQ_BIN:-/tmp/stemq-bin/stemq}"
[[ -x "$bin" ]] || { echo "no stemq binary at $bin (set STEMQ_BIN)" >&2; exit 1; }
py="${STEMQ_PYTHON:-}"
for cand in "$root/.stemq/venv/bin/python" /tmp/pyclient-venv/bin/python; do
  [[ -z "$py" && -x "$cand" ]] && "$cand" -c 'import nats, nkeys, httpx, standardwebhooks, pytest, pytest_asyncio' 2>/dev/null && py="$cand"
done
[[ -n "$py" ]] || { echo "no python with clients/python/requirements-dev.txt installed (scripts/install-test-deps.sh)" >&2; exit 1; }
export DATAMODEL_CODEGEN="$(dirname "$py")/datamodel-codegen"
# stemq dev runs nats-server from PATH (scripts/install-nats.sh puts it in .stemq/venv/bin).
export PATH="$root/.stemq/venv/bin:$(dirname "$py"):$PATH"
start=$SECONDS

"$here/check-drift.sh"
(cd "$here" && "$(dirname "$py")/mypy" --config-file pyproject.toml --cache-dir /tmp/stemq-pyclient-mypy-cache)

export STEMQ_WEBHOOK_ALLOW=127.0.0.1
# shellcheck source=../../tests/dev-stack.sh
source tests/dev-stack.sh
creds="$data/nats/creds"
"$bin" --data-dir "$data" nats users add-publisher --owner local >/dev/null
"$bin" --data-dir "$data" nats users add-publisher --owner other >/dev/null
"$bin" --data-dir "$data" nats users add-reader --owner local >/dev/null
# Views are keyed by owner (`<owner token>.<id>`): the owner's own users read them.
export STEMQ_VIEW_KEYS=owner STEMQ_READER_CREDS="$creds/reader-local.nk" STEMQ_STATUS_READER_CREDS="$creds/status-reader.nk"
"$bin" synth --seconds 4 -o "$data/song.wav" >/dev/null
export STEMQ_HTTP="$base" STEMQ_API_KEY="$(cat "$data/admin.key")" STEMQ_OWNER=local
export NATS_URL="$(cat "$data/nats.url")" STEMQ_AUDIO_FILE="$data/song.wav"
export STEMQ_PUBLISHER_CREDS="$creds/publisher-local.nk" STEMQ_OTHER_CREDS="$creds/publisher-other.nk"
export STEMQ_SUBMIT_CREDS="${STEMQ_SUBMIT_CREDS:-$STEMQ_PUBLISHER_CREDS}"
PYTHONPATH="$root/$here/src" "$py" -m pytest -q -p no:cacheprovider -c "$here/pyproject.toml" --rootdir "$here" "$here/tests" || {
  echo "--- stemq dev log (last 40 lines) ---"; tail -n 40 "$data/dev.log"; exit 1; }
echo "clients/python: all checks passed in $((SECONDS - start)) s"
