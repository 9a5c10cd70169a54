#!/usr/bin/env bash
# The device check, on the GPU machine (no Rust toolchain, no network): run
# services/demucs/scripts/gpu_prep.sh here first, then run this there with
# `carry: [".gpu"]`. Prints one markdown table for docs/benchmarks.md:
#   - parity of every family on CUDA (the reduced fixtures, blocks and end to end);
#   - the engine on CUDA, the out-of-memory ladder's injected failures included;
#   - speed of a full-size random htdemucs on CUDA (1, then 4 segments per pass, then
#     4 with the weights kept in f16, parity included) against PyTorch CUDA with the
#     same weights, 30 s of audio;
#   - cross-job batching on CUDA: 4 jobs at once, each on its own passes, then sharing
#     forward passes (the engine suite also checks their stems are unchanged on CUDA).
set -uo pipefail
cd "$(dirname "$0")/../../.."
out="${OUT:-/tmp}/gpu_check.log"
export STEMQ_DEMUCS_FIXTURES="$PWD/services/demucs/tests/fixtures"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site
rows=()
for t in parity parity_v3 parity_v2 parity_diffq engine; do
  t0=$SECONDS
  if .gpu/bin/$t --include-ignored --nocapture --test-threads 1 >>"$out" 2>&1; then r=pass; else r=FAIL; fi
  rows+=("| cuda \`$t\` | $r | $(grep -c '^PARITY' "$out") PARITY lines so far, $((SECONDS - t0)) s |")
done
worst=$(grep '^PARITY' "$out" | awk '{for(i=1;i<=NF;i++) if($i=="SNR") print $(i+1)}' | sort -n | head -1)
rows+=("| worst parity SNR on CUDA | ${worst:-none} dB | every PARITY line in $out |")
# Full-size random htdemucs (made here by PyTorch demucs), then the timings.
python3 services/demucs/scripts/make_fixtures.py --full --bench-seconds 0 >>"$out" 2>&1 &&
  rows+=("| full-size fixture | made | target/demucs-full |") || rows+=("| full-size fixture | FAIL | see $out |")
for run in "1 f32" "4 f32" "4 f16"; do
  set -- $run
  extra=(); { [ "$1" = 1 ] || [ "$2" = f16 ]; } && extra=(--parity)
  line=$(.gpu/bin/bench --device cuda --seconds 30 --batch "$1" --weights "$2" "${extra[@]}" 2>&1 | tee -a "$out" |
    grep -E '^burn/cuda|full-size parity|on the device' | tr '\n' ' ')
  rows+=("| stemq cuda, 30 s, batch $1, weights $2 | ${line:-FAIL} | \`.gpu/bin/bench --device cuda --seconds 30 --batch $1 --weights $2\` |")
done
line=$(.gpu/bin/bench --device cuda --seconds 30 --together 4 2>>"$out" | grep -E '^burn/cuda' | tr '\n' ' ')
rows+=("| stemq cuda, 4 jobs × 30 s at once | ${line:-FAIL} | \`.gpu/bin/bench --device cuda --seconds 30 --together 4\` |")
torch_line=$(python3 - <<'PY' 2>>"$out"
import time, torch
from demucs.states import load_model
from demucs.apply import apply_model
m = load_model('target/demucs-full/repo/f0f0f0f0.th').cuda().eval()
x = torch.randn(1, 2, 30 * 44100) * 0.1
with torch.no_grad():
    apply_model(m, x[..., :44100 * 8], shifts=0, device='cuda')  # warm-up
    torch.cuda.synchronize(); t0 = time.perf_counter()
    apply_model(m, x, shifts=0, split=True, overlap=0.25, device='cuda')
    torch.cuda.synchronize()
print(f"{time.perf_counter() - t0:.2f} s (torch {torch.__version__})")
PY
)
rows+=("| PyTorch demucs 4.1.0 cuda, 30 s | ${torch_line:-FAIL} | same weights, shifts 0, overlap 0.25 |")
echo
echo "| check | result | notes |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
