#!/usr/bin/env bash
# Fails when the committed models (src/stemq/models/*.py but __init__.py)
# differ from what generate.sh makes of schemas/ now: run generate.sh and commit.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$here/generate.sh" "$tmp"
status=0
for f in "$tmp"/*.py; do
  name="$(basename "$f")"
  if ! diff -u "$here/src/stemq/models/$name" "$f" >"$tmp/$name.diff"; then
    echo "drift: src/stemq/models/$name differs from a fresh generation (run clients/python/generate.sh):" >&2
    head -n 40 "$tmp/$name.diff" >&2
    status=1
  fi
done
[[ $status -eq 0 ]] && echo "models: no drift from schemas/"
exit $status
