#!/usr/bin/env bash
# Captures the reference command line's help, `python -m demucs.separate --help`
# (demucs 4.1.0, from the reference venv: see services/demucs/README.md), into
# tests/fixtures/demucs-separate-help.txt. tests/tests/cli_separate.rs tries every flag
# it lists on `stemq separate`: against the live reference when the venv is there (and
# then checks this capture is current), against the capture otherwise (CI).
set -euo pipefail
cd "$(dirname "$0")/../../.."
py="${PYTHON:-.stemq/venv-ref/bin/python}"
COLUMNS=80 "$py" -m demucs.separate --help 2>/dev/null > tests/fixtures/demucs-separate-help.txt
"$py" -c 'import demucs; print("demucs", demucs.__version__)' >&2
