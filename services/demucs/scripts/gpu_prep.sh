#!/usr/bin/env bash
# Prepares the device check HERE (a machine with the Rust toolchain and network to
# PyPI), because the GPU machine has no Rust toolchain and no network: builds the CUDA
# test and bench binaries (release, x86-64) and downloads the wheels PyTorch demucs
# needs there (Python 3.12), all into .gpu/ (git-ignored via .git/info/exclude, carried
# to the device with `carry: [".gpu"]`, 64 MiB at most). Then, on the device:
#   services/demucs/scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/bin .gpu/whl
# The parity suites and the engine test on CUDA (`common::B` is the CUDA backend with
# --features cuda), and the bench.
cargo test -p stemq-demucs --release --locked --features cuda --no-run --message-format=json \
    --test parity --test parity_v3 --test parity_v2 --test parity_diffq --test engine 2>/dev/null |
  python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable")
    if exe and m.get("target", {}).get("kind") == ["test"]:
        shutil.copy(exe, ".gpu/bin/" + m["target"]["name"])
'
cargo build -p stemq-demucs --release --locked --features cuda --example bench
cp target/release/examples/bench .gpu/bin/bench
strip .gpu/bin/* 2>/dev/null || true
# PyTorch demucs for the reference timings and the full-size random checkpoint (the
# device has torch; these are pure Python or small binary wheels).
py=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    -d .gpu/whl)
"${py[@]}" demucs==4.1.0 julius==0.2.8 lameenc==1.9.0 >/dev/null
ls -la .gpu/bin .gpu/whl
du -sh .gpu
