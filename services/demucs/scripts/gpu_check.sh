#!/usr/bin/env bash
# One short device check for a machine with an NVIDIA GPU (run from the repository
# root, after `make_fixtures.py --full` has written target/demucs-full/ and with the
# reference venv for the PyTorch timing). Prints parity and timing; nothing else.
set -euo pipefail
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# Block and end-to-end parity of the reduced model, on CUDA.
cargo test -p stemq-demucs --release --features cuda --test parity -- --include-ignored --nocapture --test-threads 1 2>&1 | grep -E "PARITY|test result|panicked"
# Full-size: parity on 10 s, then speed on 30 s (one segment per pass, then 4).
cargo run -p stemq-demucs --release --features cuda --example bench -- --device cuda --seconds 30 --parity
cargo run -p stemq-demucs --release --features cuda --example bench -- --device cuda --seconds 30 --batch 4
if [ -x .stemq/venv-ref/bin/python ]; then
  .stemq/venv-ref/bin/python - <<'PY'
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
print(f"pytorch cuda: 30 s of audio in {time.perf_counter() - t0:.2f} s")
PY
fi
