#!/usr/bin/env bash
# Runs Schemathesis against a live `stemq dev`: every operation of /openapi.json, with
# the operator's key (so the operators' routes are reached too), every check (no 5xx;
# statuses, content types, headers and bodies as documented; schema-valid requests
# accepted and schema-violating ones refused; authentication enforced; unsupported
# methods 405), with a fixed seed and a bounded number of examples per operation, then
# the stateful phase that follows the document's links (upload → submit → the job's
# routes). Starts `stemq dev` in a temporary data dir on a free port, with one job
# that succeeded (so the stems routes have something to serve), and stops it after.
# Fails on any failure.
#
# STEMQ_BIN: the stemq binary (default target/debug/stemq); SCHEMATHESIS: the
# schemathesis command (default .stemq/venv/bin/schemathesis, tests/api/requirements.txt);
# STEMQ_API_SEED, STEMQ_API_EXAMPLES: the seed (default 20260105) and the examples per
# operation (default 100). The JUnit report goes to tests/api/artifacts/ (not in git).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${STEMQ_BIN:-$root/target/debug/stemq}"
st="${SCHEMATHESIS:-$root/.stemq/venv/bin/schemathesis}"
seed="${STEMQ_API_SEED:-20260105}"
examples="${STEMQ_API_EXAMPLES:-100}"
source "$root/tests/dev-stack.sh"
key="$(cat "$data/operator.key")"
# One job that succeeded: the newest job at first, which the list's links lead to.
"$bin" synth --seconds 4 -o "$data/song.wav" >/dev/null
"$bin" submit "$data/song.wav" --wait --api "$base" --api-key "$key" >"$data/submit.log" 2>&1 ||
  { echo "the seed job failed:"; cat "$data/submit.log"; tail -n 40 "$data/dev.log"; exit 1; }
mkdir -p "$here/artifacts"
status=0
# Schemathesis keeps nothing between runs (schemathesis.toml); its working files go to
# the temporary dir.
(cd "$data" && "$st" --config-file "$here/schemathesis.toml" run "$base/openapi.json" \
  -H "Authorization: Bearer $key" --seed "$seed" --max-examples "$examples" \
  --request-timeout 30 --report junit,har --report-junit-path "$here/artifacts/schemathesis.xml" \
  --report-har-path "$here/artifacts/schemathesis.har") || status=$?
if [[ $status -ne 0 ]]; then echo "--- stemq dev log (tail)"; tail -n 40 "$data/dev.log"; fi
exit $status
