#!/usr/bin/env bash
# Generates the typed models of src/stemq/models/ from the JSON Schemas in schemas/
# (the request, the status view, the events' CloudEvents envelope, the submit and upload
# answers, the submit reply of NATS, the error body, the job and batch webhook bodies)
# with the pinned datamodel-code-generator (requirements-dev.txt): TypedDicts, so the
# package needs no pydantic at run time and reads documents as plain dicts (unknown
# failure codes and new optional fields pass through, as docs/events.md asks of readers).
# --use-title-as-name names the submit reply's variants by their titles (`Accepted`,
# `Refused`); it changes nothing in the other files.
#
#   clients/python/generate.sh [OUT_DIR]     (default: src/stemq/models)
#
# DATAMODEL_CODEGEN names the generator (default: the one next to the venv's python).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$here/src/stemq/models}"
if [[ -z "${DATAMODEL_CODEGEN:-}" ]]; then
  for venv in "$root/.stemq/venv" /tmp/pyclient-venv; do
    [[ -x "$venv/bin/datamodel-codegen" ]] && { DATAMODEL_CODEGEN="$venv/bin/datamodel-codegen"; break; }
  done
fi
gen="${DATAMODEL_CODEGEN:-datamodel-codegen}"
want="$(sed -n 's/^datamodel-code-generator==//p' "$here/requirements-dev.txt")"
have="$("$gen" --version 2>/dev/null || true)"
[[ "$have" == *"$want"* ]] || { echo "datamodel-codegen $want is needed (found: ${have:-none}); pip install -r clients/python/requirements-dev.txt" >&2; exit 1; }
mkdir -p "$out"
for schema in job-request job-view event submit-response submit-reply upload-response error webhook-job webhook-batch; do
  # Run from the repository root so the header names schemas/<file> the same everywhere.
  (cd "$root" && "$gen" \
    --input "schemas/$schema.json" \
    --input-file-type jsonschema \
    --output-model-type typing.TypedDict \
    --target-python-version 3.11 \
    --enum-field-as-literal all \
    --use-tag-as-union-variant-name \
    --use-title-as-name \
    --formatters builtin \
    --disable-timestamp \
    --output "$out/${schema//-/_}.py" 2> >(grep -v "format of '.*' not understood\|return _get_type" >&2))
done
