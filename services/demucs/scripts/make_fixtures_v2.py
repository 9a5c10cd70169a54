#!/usr/bin/env python3
"""Reference fixtures for the waveform Demucs port (`demucs.demucs.Demucs`, the v2/v3-era
time-domain model of the `mdx` and `repro_mdx_a*` bags), demucs==4.1.0.

Two reduced Demucs models with every parameter randomised (as make_fixtures.py does),
saved in the official `.th` format and reloaded through demucs's own `load_model`;
references in float64:

- `e5e5e5e5`: with the rewrite convolutions (like the repro_mdx_a members);
- `f6f6f6f6`: without them (`rewrite=False`, like the mdx members 0d19c1c6 / 7ecf8ec1).

Both resample ×2 inside (julius), normalise, use GroupNorm from `norm_starts` and DConv
with BLSTM and LocalState from `dconv_lstm` / `dconv_attn`, over sequences longer than
the BLSTM's 200 steps. Plus a bag mixing `e5e5e5e5` with the Hybrid Demucs `c3c3c3c3`
of make_fixtures_v3.py (run that first), as `mdx` mixes the families: the test
assembles it as `mixed.yaml` (weights [[1,1,0,0],[0,1,1,1],[1,0,1,1]], segment 1.5).

Usage (from the repository root):

    .stemq/venv-ref/bin/python services/demucs/scripts/make_fixtures_v2.py

writes services/demucs/tests/fixtures/v2/.
"""
import json
import sys
from pathlib import Path

import julius
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import SOURCES, f32, make_model, noise, separate, snr_db  # noqa: E402

from demucs.apply import BagOfModels  # noqa: E402
from demucs.demucs import Demucs  # noqa: E402
from demucs.states import load_model  # noqa: E402

V2 = dict(
    sources=SOURCES, audio_channels=2, channels=8, growth=2, depth=4, rewrite=True,
    lstm_layers=0, kernel_size=8, stride=4, context=1, gelu=True, glu=True, norm_starts=2,
    norm_groups=4, dconv_mode=1, dconv_depth=2, dconv_comp=4, dconv_attn=2, dconv_lstm=2,
    dconv_init=1e-3, normalize=True, resample=True, samplerate=8000, segment=2,
)
V2_PLAIN = dict(V2, rewrite=False)


def make(cfg: dict, seed: int, repo: Path, sig: str):
    return make_model(cfg, seed, repo, sig, with_checksum=False, klass=Demucs)


def main():
    fixtures = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
    out = fixtures / "v2"
    repo = out / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    for f in repo.glob("*"):
        f.unlink()
    meta = {"config": {k: str(v) for k, v in V2.items()}, "config_plain": {"rewrite": "False"}}
    _, path_r = make(V2, 5, repo, "e5e5e5e5")
    _, path_p = make(V2_PLAIN, 6, repo, "f6f6f6f6")
    meta["files"] = [path_r.name, path_p.name]
    # The bag of both families (as mdx is) is assembled by the test in a temporary
    # folder from these and fixtures/v3/repo/c3c3c3c3.th: `mixed.yaml` below.
    v3 = fixtures / "v3" / "repo" / "c3c3c3c3.th"
    r64 = load_model(path_r).double().eval()
    p64 = load_model(path_p).double().eval()
    sr = V2["samplerate"]
    tensors = {}
    # julius's resampling alone, ×2 and ÷2.
    x = noise(2, 1001, 50)
    tensors["resample.in"] = f32(x)
    tensors["resample.up"] = f32(julius.resample_frac(x, 1, 2))
    tensors["resample.down"] = f32(julius.resample_frac(x, 2, 1))
    for n, cases in [(int(3.3 * sr), [("rewrite", r64)]), (4321, [("rewrite", r64), ("plain", p64)]),
                     (700, [("rewrite", r64), ("plain", p64)])]:
        x = noise(2, n, 51 + n)[None]
        tensors[f"forward_{n}.in"] = f32(x)
        for name, m in cases:
            with torch.no_grad():
                tensors[f"{name}.forward_{n}.out"] = f32(m(x))
    tensors["valid_length"] = torch.tensor([r64.valid_length(n) for n in [1, 700, 4321, 26400]], dtype=torch.int64)
    with torch.no_grad():
        y32 = load_model(path_r).eval()(tensors[f"forward_{int(3.3 * sr)}.in"])
    meta["torch_f32_vs_f64_forward_snr_db"] = snr_db(tensors[f"rewrite.forward_{int(3.3 * sr)}.out"], y32)
    save_file(tensors, str(out / "blocks.safetensors"))

    track = noise(2, int(3.3 * sr), 61)
    cases = {}
    with torch.no_grad():
        cases["plain"] = separate(p64, track, shifts=0, split=True, overlap=0.25)
        bag = BagOfModels([load_model(repo / "e5e5e5e5.th").double().eval(),
                           load_model(v3).double().eval(),
                           load_model(repo / "f6f6f6f6.th").double().eval()],
                          weights=[[1., 1., 0., 0.], [0., 1., 1., 1.], [1., 0., 1., 1.]], segment=1.5)
        cases["mixed"] = separate(bag, track, shifts=0, split=True, overlap=0.25)
    apply = {"track": f32(track)}
    for k, v in cases.items():
        apply[f"out.{k}"] = f32(v)
    save_file(apply, str(out / "apply.safetensors"))
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
