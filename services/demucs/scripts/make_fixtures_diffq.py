#!/usr/bin/env python3
"""Reference fixture for DiffQ-quantised checkpoints (the `_q` models: `mdx_q`,
`mdx_extra_q`), demucs==4.1.0 with diffq==0.2.4.

Quantises two reduced random models as demucs exports them (`get_state` with a
`DiffQuantizer(min_size, group_size=8)`: `quantized` / `others` / `meta`,
`__quantized`): the Hybrid Demucs `d4d4d4d4` (magnitude, hybrid_old: like the mdx_q
members) and the waveform Demucs `f6f6f6f6`, with random bit widths (2 to 14 per group
of 8; `min_size` small so that most tensors are quantised). References: the models
restored by diffq's own `restore_quantized_state`, run in float64.

Usage (from the repository root, after make_fixtures_v3.py and make_fixtures_v2.py):

    .stemq/venv-ref/bin/python services/demucs/scripts/make_fixtures_diffq.py

writes services/demucs/tests/fixtures/diffq/.
"""
import io
import sys
from pathlib import Path

import torch
from diffq import DiffQuantizer
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import f32, noise  # noqa: E402

from demucs.states import load_model  # noqa: E402


def quantise(src: Path, dst: Path, seed: int) -> torch.nn.Module:
    model = load_model(src)
    quantizer = DiffQuantizer(model, min_size=0.004, group_size=8)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for qp in quantizer._qparams:
            # bits = round(2 + 13·sigmoid(logit)): up to 14 (15 is not stored by diffq).
            qp.logit.copy_(torch.empty_like(qp.logit).uniform_(-4.0, 2.9, generator=gen))
    pkg = torch.load(src, weights_only=False)
    state = quantizer.get_quantized_state()
    state["__quantized"] = True
    pkg["state"] = state
    buf = io.BytesIO()
    torch.save(pkg, buf)
    dst.write_bytes(buf.getvalue())
    restored = load_model(dst)
    restored.eval()
    return restored


def main():
    fixtures = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
    out = fixtures / "diffq"
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for src, sig, seed in [(fixtures / "v3/repo/d4d4d4d4.th", "d4d4d4d4", 81),
                           (fixtures / "v2/repo/f6f6f6f6.th", "f6f6f6f6", 82)]:
        model = quantise(src, out / f"{sig}q.th", seed)
        x = noise(2, 4321, 90 + seed)[None]
        with torch.no_grad():
            tensors[f"{sig}.in"] = f32(x)
            tensors[f"{sig}.out"] = f32(model.double()(x))
    save_file(tensors, str(out / "forward.safetensors"))


if __name__ == "__main__":
    main()
