#!/usr/bin/env python3
"""Reference fixtures for the Hybrid Demucs (v3, `demucs.hdemucs.HDemucs`) port, demucs==4.1.0.

Two reduced HDemucs models with every parameter randomised (as make_fixtures.py does for
HTDemucs), saved in the official `.th` format and reloaded through demucs's own
`load_model`; references computed in float64:

- `c3c3c3c3`: complex-as-channels (cac=True), like hdemucs_mmi and two of mdx_extra;
- `d4d4d4d4`: magnitude with the mixture's phase (cac=False) and `hybrid_old` (the
  zero-padded, shifted spectrogram of the MDX models), like the other two of mdx_extra.

Both have the structure of the released v3 models at a small size: frequency layers until
the frequency axis collapses (the last one with kernel = the remaining bins and the time
branch injected), a time layer after the merge, GroupNorm from `norm_starts`, and DConv
with BLSTM and LocalState from `dconv_lstm` / `dconv_attn` on, over sequences longer than
the BLSTM's 200 steps (so its framing runs).

Usage (from the repository root):

    .stemq/venv-ref/bin/python services/demucs/scripts/make_fixtures_v3.py

writes services/demucs/tests/fixtures/v3/ (well under a MB).
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import SOURCES, Recorder, f32, make_model, noise, separate, snr_db  # noqa: E402

from demucs.apply import BagOfModels  # noqa: E402
from demucs.hdemucs import HDemucs  # noqa: E402
from demucs.states import load_model  # noqa: E402

# nfft 256 (hop 64 = 4^3): freq layers 128 -> 32 -> 8 bins, then the last freq layer
# (kernel 8 = the remaining bins, no pad, time branch injected) -> 1 bin, then a time
# layer (k4 s2). BLSTM + LocalState and GroupNorm from layer 2 on.
V3 = dict(
    sources=SOURCES, audio_channels=2, channels=8, growth=2, nfft=256, depth=4,
    wiener_iters=0, end_iters=0, cac=True, rewrite=True, hybrid=True, hybrid_old=False,
    freq_emb=0.2, emb_scale=10, kernel_size=8, time_stride=2, stride=4, context=1,
    context_enc=0, norm_starts=2, norm_groups=4, dconv_mode=1, dconv_depth=2,
    dconv_comp=4, dconv_attn=2, dconv_lstm=2, dconv_init=1e-3, samplerate=8000, segment=2,
)
V3_MAG = dict(V3, cac=False, hybrid_old=True)


def make(cfg: dict, seed: int, repo: Path, sig: str):
    return make_model(cfg, seed, repo, sig, with_checksum=False, klass=HDemucs)


def blocks(m64, prefix: str, tensors: dict, hooks: bool) -> None:
    """With `hooks`: inputs and outputs of the new blocks during a forward on 3.3 s (413
    frames at layer 2 and 207 at layer 3, both over the BLSTM's 200 steps). Always:
    whole forwards at other lengths."""
    sr = V3["samplerate"]
    rec = Recorder()
    if hooks:
        rec.watch(m64.encoder[2], f"{prefix}enc2")      # last freq layer, with inject
        rec.watch(m64.tencoder[2], f"{prefix}tenc2")    # empty
        rec.watch(m64.encoder[3], f"{prefix}enc3")      # time layer after the merge
        rec.watch(m64.encoder[3].dconv.layers[0][3], f"{prefix}blstm")
        rec.watch(m64.encoder[3].dconv.layers[1][4], f"{prefix}localstate")
        rec.watch(m64.decoder[0], f"{prefix}dec0")      # time layer
        rec.watch(m64.decoder[1], f"{prefix}dec1")      # last freq layer, 3-D input
        rec.watch(m64.tdecoder[0], f"{prefix}tdec0")    # empty, fed `pre`
    if hooks:
        mix = noise(2, int(3.3 * sr), 31)[None]
        with torch.no_grad():
            y = m64(mix)
        rec.close()
        tensors.update(rec.tensors)
        tensors[f"{prefix}forward.in"] = f32(mix)
        tensors[f"{prefix}forward.out"] = f32(y)
    # Any length works (no training-length padding): odd lengths, and inputs shorter
    # than the first padding (pad1d's extra zeros).
    for n in [4321, 700, 1]:
        x = noise(2, n, 32 + n)[None]
        with torch.no_grad():
            tensors[f"{prefix}forward_{n}.in"] = f32(x)
            tensors[f"{prefix}forward_{n}.out"] = f32(m64(x))


def main():
    out = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "v3"
    repo = out / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    for f in repo.glob("*"):
        f.unlink()
    meta = {"config": {k: str(v) for k, v in V3.items()}, "config_mag": {"cac": "False", "hybrid_old": "True"}}
    cac, path_c = make(V3, 3, repo, "c3c3c3c3")
    mag, path_m = make(V3_MAG, 4, repo, "d4d4d4d4")
    (repo / "hybrid.yaml").write_text("models: ['c3c3c3c3', 'd4d4d4d4']\nsegment: 1.5\n")
    meta["files"] = [path_c.name, path_m.name]
    c64 = load_model(path_c).double().eval()
    m64 = load_model(path_m).double().eval()

    tensors = {}
    blocks(c64, "cac.", tensors, hooks=True)
    blocks(m64, "mag.", tensors, hooks=False)
    with torch.no_grad():
        y32 = load_model(path_c).eval()(tensors["cac.forward.in"])
    meta["torch_f32_vs_f64_forward_snr_db"] = snr_db(tensors["cac.forward.out"], y32)
    save_file(tensors, str(out / "blocks.safetensors"))

    # apply_model end to end: 2 s segments (the model's), the last chunk shorter and fed
    # as is; the bag with its segment 1.5 s and the default equal weights.
    sr = V3["samplerate"]
    track = noise(2, int(3.3 * sr), 41)
    cases = {}
    with torch.no_grad():
        cases["cac"] = separate(c64, track, shifts=0, split=True, overlap=0.25)
        bag = BagOfModels([load_model(path_c).double().eval(), load_model(path_m).double().eval()], segment=1.5)
        cases["bag"] = separate(bag, track, shifts=0, split=True, overlap=0.25)
    apply = {"track": f32(track)}
    for k, v in cases.items():
        apply[f"out.{k}"] = f32(v)
    save_file(apply, str(out / "apply.safetensors"))
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
