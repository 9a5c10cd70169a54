#!/usr/bin/env python3
"""Reference fixtures for the stemq-demucs port (HTDemucs, demucs==4.1.0).

Builds HTDemucs models with *every* parameter randomised (conv weights and biases, layer
scales, norm weights and biases, the frequency embedding, attention projections), saves
them in the official `.th` format (torch.save of {klass, args, kwargs, state (fp16),
training_args}, as demucs.states.serialize_model / save_with_checksum do), reloads them
through demucs's own `load_model`, and writes reference inputs/outputs as safetensors.

References are computed in float64 (the model reloaded from the fp16 state, cast to
double), so they are the exact answer for these weights; the float32 PyTorch output's own
distance to them is recorded in `meta.json` for comparison.

Usage (from the repository root):

    .stemq/venv-ref/bin/python services/demucs/scripts/make_fixtures.py            # reduced, committed
    .stemq/venv-ref/bin/python services/demucs/scripts/make_fixtures.py --full     # full htdemucs size

The reduced fixtures go to services/demucs/tests/fixtures/ (a few MB); `--full` writes to
target/demucs-full/ (not committed): a full-size random htdemucs checkpoint, a 10 s end to
end reference and the PyTorch CPU timing used by the benchmark.
"""
import argparse
import hashlib
import io
import json
import random
import time
from fractions import Fraction
from pathlib import Path

import torch
from safetensors.torch import save_file

from demucs.apply import apply_model, BagOfModels
from demucs.htdemucs import HTDemucs
from demucs.states import load_model

SOURCES = ["drums", "bass", "other", "vocals"]

# A reduced configuration with the same structure as the released htdemucs (4 freq
# layers that never collapse to one frequency, 5 transformer layers self/cross/self/
# cross/self, bottom channels, DConv in encoder and decoder, freq embedding) but tiny
# widths and a short segment at a low sample rate.
REDUCED = dict(
    sources=SOURCES, audio_channels=2, channels=8, growth=2, nfft=2048, depth=4,
    cac=True, wiener_iters=0, end_iters=0, rewrite=True, freq_emb=0.2, emb_scale=10,
    kernel_size=8, stride=4, context=1, context_enc=0, norm_starts=4, dconv_mode=3,
    dconv_depth=2, dconv_comp=4, dconv_init=1e-3, bottom_channels=32, t_layers=5,
    t_heads=4, t_hidden_scale=4.0, t_emb="sin", t_max_period=10000.0, t_norm_in=True,
    t_norm_first=True, t_norm_out=True, t_layer_scale=True, t_gelu=True,
    t_cross_first=False, t_sin_random_shift=0, samplerate=8000,
    segment=Fraction(3, 2),
)

# The released htdemucs (955717e8) hyperparameters.
FULL = dict(
    sources=SOURCES, audio_channels=2, channels=48, growth=2, nfft=4096, depth=4,
    cac=True, wiener_iters=0, end_iters=0, rewrite=True, freq_emb=0.2, emb_scale=10,
    emb_smooth=True, kernel_size=8, stride=4, time_stride=2, context=1, context_enc=0,
    norm_starts=4, norm_groups=4, dconv_mode=3, dconv_depth=2, dconv_comp=8,
    dconv_init=1e-3, bottom_channels=512, t_layers=5, t_heads=8, t_hidden_scale=4.0,
    t_emb="sin", t_max_period=10000.0, t_norm_in=True, t_norm_first=True,
    t_norm_out=True, t_layer_scale=True, t_gelu=True, t_cross_first=False,
    t_sin_random_shift=0, t_dropout=0.0, rescale=0.1, samplerate=44100,
    segment=Fraction(39, 5), use_train_segment=True,
)


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every floating point parameter and buffer with random values of a sane
    scale: weights ~ N(0, 1/fan), biases ~ N(0, 0.1), norm weights 1 + N(0, 0.2),
    layer scales U(0.05, 0.5) with random sign, the frequency embedding N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if not p.is_floating_point():
                continue
            shape = p.shape
            rnd = torch.randn(shape, generator=gen)
            if name.endswith(".scale") or "gamma_" in name:
                mag = 0.05 + 0.45 * torch.rand(shape, generator=gen)
                sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
                new = mag * sign
            elif "embedding" in name:
                new = 0.1 * rnd
            elif p.dim() == 1 and name.endswith("weight"):  # norms
                new = 1.0 + 0.2 * rnd
            elif p.dim() == 1:  # biases
                new = 0.1 * rnd
            else:
                fan = p.numel() // shape[0]
                new = rnd / fan ** 0.5
            p.copy_(new)


def package(model: HTDemucs) -> dict:
    args, kwargs = model._init_args_kwargs
    state = {k: p.data.to(device="cpu", dtype=torch.half) for k, p in model.state_dict().items()}
    return {
        "klass": model.__class__,
        "args": args,
        "kwargs": kwargs,
        "state": state,
        "training_args": {"model": "htdemucs", "seed": 42, "note": "randomised for tests"},
    }


def save_th(pkg: dict, path: Path, with_checksum: bool) -> Path:
    buf = io.BytesIO()
    torch.save(pkg, buf)
    if with_checksum:
        sig = hashlib.sha256(buf.getvalue()).hexdigest()[:8]
        path = path.parent / (path.stem + "-" + sig + path.suffix)
    path.write_bytes(buf.getvalue())
    return path


def make_model(cfg: dict, seed: int, repo: Path, sig: str, with_checksum: bool, klass=HTDemucs):
    """A `klass` model with `cfg`, randomised, saved as `<sig>.th` and reloaded as demucs
    loads it."""
    torch.manual_seed(seed)
    model = klass(**cfg)
    randomise(model, seed)
    pkg = package(model)
    pkg["training_args"]["model"] = klass.__name__.lower()
    path = save_th(pkg, repo / f"{sig}.th", with_checksum)
    # Reload exactly as demucs does (fp16 state into fp32 params).
    loaded = load_model(path)
    loaded.eval()
    return loaded, path


def snr_db(ref: torch.Tensor, est: torch.Tensor) -> float:
    ref = ref.double()
    err = (est.double() - ref).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / err.clamp_min(1e-300)))


def f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


def separate(model, wav: torch.Tensor, **kw) -> torch.Tensor:
    """demucs.api.Separator.separate_tensor: whole-track normalisation around apply_model."""
    ref = wav.mean(0)
    mean = ref.mean()
    std = ref.std() + 1e-8
    out = apply_model(model, ((wav - mean) / std)[None], **kw)
    return out[0] * std + mean


def noise(channels: int, length: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Correlated stereo 'music-like' noise: a few tones plus filtered noise."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(length, dtype=dtype)
    x = torch.zeros(channels, length, dtype=dtype)
    for k in range(5):
        f = 0.002 + 0.05 * float(torch.rand(1, generator=gen))
        amp = 0.1 + 0.2 * float(torch.rand(1, generator=gen))
        x += amp * torch.sin(2 * torch.pi * f * t)[None] * (1 + 0.3 * torch.randn(channels, 1, generator=gen, dtype=dtype))
    x += 0.05 * torch.randn(channels, length, generator=gen, dtype=dtype)
    return x + 0.01


class Recorder:
    """Forward hooks that keep the first call's inputs and outputs of chosen blocks."""

    def __init__(self):
        self.tensors = {}
        self.handles = []

    def watch(self, module, name):
        def hook(mod, inputs, output):
            if f"{name}.out0" in self.tensors:
                return
            for i, a in enumerate(inputs):
                if isinstance(a, torch.Tensor):
                    self.tensors[f"{name}.in{i}"] = f32(a)
                elif isinstance(a, int):
                    self.tensors[f"{name}.in{i}"] = torch.tensor([a], dtype=torch.int64)
            outs = output if isinstance(output, tuple) else (output,)
            for i, o in enumerate(outs):
                if isinstance(o, torch.Tensor):
                    self.tensors[f"{name}.out{i}"] = f32(o)
        self.handles.append(module.register_forward_hook(hook))

    def close(self):
        for h in self.handles:
            h.remove()


def reduced(out: Path) -> None:
    repo = out / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    for f in repo.glob("*"):
        f.unlink()
    meta = {"config": {k: str(v) for k, v in REDUCED.items()}}

    model_a, path_a = make_model(REDUCED, 1, repo, "a0a0a0a0", with_checksum=False)
    model_b, path_b = make_model(REDUCED, 2, repo, "b1b1b1b1", with_checksum=True)
    meta["files"] = [path_a.name, path_b.name]
    (repo / "tinybag.yaml").write_text(
        "models: ['a0a0a0a0', 'b1b1b1b1']\n"
        "weights: [[1.0, 0.5, 0.0, 1.0], [0.0, 0.5, 1.0, 1.0]]\n"
        "segment: 1.2\n")
    (repo / "tiny.yaml").write_text("models: ['a0a0a0a0']\n")

    m64 = load_model(path_a).double().eval()
    sr = REDUCED["samplerate"]
    seg = int(REDUCED["segment"] * sr)

    # --- STFT / iSTFT (the model's _spec / _ispec, Demucs padding and cropping) --------
    x = noise(2, 5000, 10)
    z = m64._spec(x[None])
    back = m64._ispec(z, 5000)
    save_file({"x": f32(x), "spec": f32(torch.view_as_real(z[0])), "ispec": f32(back[0])},
              str(out / "stft.safetensors"))

    # --- Block level and one full forward, with hooks --------------------------------
    mix = noise(2, seg, 11)[None]
    rec = Recorder()
    rec.watch(m64.encoder[0], "enc0")
    rec.watch(m64.tencoder[0], "tenc0")
    rec.watch(m64.encoder[3], "enc3")
    rec.watch(m64.crosstransformer.layers[0], "tlayer0")
    rec.watch(m64.crosstransformer.layers_t[1], "tlayer_t1")
    rec.watch(m64.crosstransformer, "transformer")
    rec.watch(m64.decoder[0], "dec0")
    rec.watch(m64.decoder[1], "dec1")
    rec.watch(m64.tdecoder[2], "tdec2")
    with torch.no_grad():
        y = m64(mix)
    rec.close()
    rec.tensors["forward.in"] = f32(mix)
    rec.tensors["forward.out"] = f32(y)
    # the same forward on a 0.6 s input (padded to the training length inside)
    short = noise(2, 4800, 12)[None]
    with torch.no_grad():
        rec.tensors["forward_short.in"] = f32(short)
        rec.tensors["forward_short.out"] = f32(m64(short))
    save_file(rec.tensors, str(out / "blocks.safetensors"))
    with torch.no_grad():
        y32 = load_model(path_a).eval()(f32(mix))
    meta["torch_f32_vs_f64_forward_snr_db"] = snr_db(y, y32)
    meta["torch_f32_vs_f64_forward_max_abs"] = float((y - y32).abs().max())

    # --- apply_model end to end -------------------------------------------------------
    track = noise(2, int(2.2 * sr), 13)
    short_track = noise(2, int(0.7 * sr), 14)
    cases = {}
    with torch.no_grad():
        cases["split"] = separate(m64, track, shifts=0, split=True, overlap=0.25)
        cases["segment"] = separate(m64, track, shifts=0, split=True, overlap=0.25, segment=1.0)
        cases["short"] = separate(m64, short_track, shifts=0, split=True, overlap=0.25)
        # shifts=2 with the offsets recorded so the port can replay them.
        offsets = []
        orig = random.randint

        def rec_randint(a, b):
            v = orig(a, b)
            offsets.append(v)
            return v
        random.seed(1234)
        random.randint = rec_randint
        try:
            cases["shifts"] = separate(m64, track, shifts=2, split=True, overlap=0.25)
        finally:
            random.randint = orig
        meta["shift_offsets"] = offsets
        bag = BagOfModels([load_model(path_a).double().eval(), load_model(path_b).double().eval()],
                          weights=[[1.0, 0.5, 0.0, 1.0], [0.0, 0.5, 1.0, 1.0]], segment=1.2)
        cases["bag"] = separate(bag, track, shifts=0, split=True, overlap=0.25)
        m32 = load_model(path_a).eval()
        split32 = separate(m32, f32(track), shifts=0, split=True, overlap=0.25)
    meta["torch_f32_vs_f64_apply_snr_db"] = snr_db(cases["split"], split32)
    meta["torch_f32_vs_f64_apply_max_abs"] = float((cases["split"] - split32.double()).abs().max())
    tensors = {"track": f32(track), "short_track": f32(short_track)}
    for k, v in cases.items():
        tensors[f"out.{k}"] = f32(v)
    # two_stems=vocals on the split case: demucs.separate's add/minus.
    voc = SOURCES.index("vocals")
    tensors["two_stems.no_vocals_add"] = f32(sum(cases["split"][i] for i in range(4) if i != voc))
    tensors["two_stems.no_vocals_minus"] = f32(track - cases["split"][voc])
    save_file(tensors, str(out / "apply.safetensors"))
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta, indent=1))


def full(out: Path, bench_seconds: float) -> None:
    repo = out / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    model, path = make_model(FULL, 7, repo, "f0f0f0f0", with_checksum=False)
    (repo / "htdemucs_random.yaml").write_text("models: ['f0f0f0f0']\n")
    sr = FULL["samplerate"]
    track = noise(2, int(10.0 * sr), 21)
    meta = {"file": path.name}
    m64 = load_model(path).double().eval()
    with torch.no_grad():
        ref = separate(m64, track, shifts=0, split=True, overlap=0.25)
        t0 = time.perf_counter()
        out32 = separate(model, f32(track), shifts=0, split=True, overlap=0.25)
        meta["torch_f32_10s_seconds"] = time.perf_counter() - t0
    meta["torch_f32_vs_f64_apply_snr_db"] = snr_db(ref, out32)
    meta["torch_f32_vs_f64_apply_max_abs"] = float((ref - out32.double()).abs().max())
    save_file({"track": f32(track), "out.split": f32(ref)}, str(out / "apply_full.safetensors"))
    if bench_seconds > 0:
        bench = f32(noise(2, int(bench_seconds * sr), 22))
        with torch.no_grad():
            t0 = time.perf_counter()
            separate(model, bench, shifts=0, split=True, overlap=0.25)
            dt = time.perf_counter() - t0
        meta["torch_bench"] = {"seconds_audio": bench_seconds, "seconds": dt,
                               "rtf": dt / bench_seconds, "threads": torch.get_num_threads()}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta, indent=1))


def bench_only(out: Path, seconds: float, threads: int) -> None:
    """Times PyTorch apply_model (shifts 0, overlap 0.25) on the existing full model."""
    if threads:
        torch.set_num_threads(threads)
    model = load_model(out / "repo" / "f0f0f0f0.th").eval()
    sr = FULL["samplerate"]
    bench = f32(noise(2, int(seconds * sr), 22))
    with torch.no_grad():
        t0 = time.perf_counter()
        separate(model, bench, shifts=0, split=True, overlap=0.25)
        dt = time.perf_counter() - t0
    res = {"torch": torch.__version__, "seconds_audio": seconds, "seconds": dt, "rtf": dt / seconds,
           "threads": torch.get_num_threads()}
    print(json.dumps(res))


def main():
    here = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="full-size htdemucs instead of the reduced config")
    p.add_argument("--out", type=Path, help="output folder")
    p.add_argument("--bench-seconds", type=float, default=30.0,
                   help="with --full: time PyTorch apply_model on this much audio (0 = skip)")
    p.add_argument("--bench-only", action="store_true",
                   help="with --full: only time PyTorch on the already generated full model")
    p.add_argument("--threads", type=int, default=0, help="torch threads for --bench-only (0 = default)")
    args = p.parse_args()
    if args.full and args.bench_only:
        bench_only(args.out or here.parent.parent / "target" / "demucs-full", args.bench_seconds, args.threads)
    elif args.full:
        full(args.out or here.parent.parent / "target" / "demucs-full", args.bench_seconds)
    else:
        reduced(args.out or here / "tests" / "fixtures")


if __name__ == "__main__":
    main()
