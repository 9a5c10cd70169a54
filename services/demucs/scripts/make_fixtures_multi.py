#!/usr/bin/env python3
"""Reference fixture for Hybrid Demucs with MultiWrap (`multi_freqs`, the `mdx` member
7d865c68): a reduced HDemucs like make_fixtures_v3.py's `c3c3c3c3` (wider spectrogram, narrower
channels) whose two outer frequency layers are split into three frequency bands ([0.1, 0.3] of the bins), every
parameter randomised, references in float64.

Usage (from the repository root, after make_fixtures_v3.py):

    .stemq/venv-ref/bin/python services/demucs/scripts/make_fixtures_multi.py

writes services/demucs/tests/fixtures/v3/repo/g7g7g7g7.th and
services/demucs/tests/fixtures/v3/multi.safetensors.
"""
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import Recorder, f32, noise, snr_db  # noqa: E402
from make_fixtures_v3 import V3, make  # noqa: E402

from demucs.states import load_model  # noqa: E402

# nfft 1024 (512 bins, hop 256 = 4^4): four frequency layers, the last one collapsing
# 8 bins into 1, then a time layer; the two outer ones MultiWrapped.
MULTI = dict(V3, channels=4, nfft=1024, depth=5, dconv_lstm=3, dconv_attn=3,
             multi_freqs=[0.1, 0.3], multi_freqs_depth=2)


def main():
    out = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "v3"
    repo = out / "repo"
    _, path = make(MULTI, 7, repo, "g7g7g7g7")
    m64 = load_model(path).double().eval()
    sr = V3["samplerate"]
    rec = Recorder()
    rec.watch(m64.encoder[0], "enc0")
    rec.watch(m64.encoder[1], "enc1")
    rec.watch(m64.decoder[2], "dec2")
    rec.watch(m64.decoder[3], "dec3")
    mix = noise(2, int(1.1 * sr), 71)[None]
    with torch.no_grad():
        y = m64(mix)
    rec.close()
    tensors = dict(rec.tensors)
    tensors["forward.in"] = f32(mix)
    tensors["forward.out"] = f32(y)
    with torch.no_grad():
        y32 = load_model(path).eval()(f32(mix))
    print("f32 vs f64 forward snr", snr_db(y, y32))
    save_file(tensors, str(out / "multi.safetensors"))


if __name__ == "__main__":
    main()
