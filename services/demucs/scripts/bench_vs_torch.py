#!/usr/bin/env python3
"""Side-by-side CPU benchmark: PyTorch demucs 4.1.0 against the Burn port, same machine,
same full-size (randomised) htdemucs weights, same thread count, in one run.

For each track length and thread count it runs, one after the other in fresh processes:
  * PyTorch: demucs.apply.apply_model (shifts 0, split, overlap 0.25), torch threads = N;
  * ours: the `bench` example's streamed path (what the worker runs), N rayon threads and
    N concurrent segment passes;
and prints wall seconds, real-time factor, the ratio (PyTorch time / ours) and each
process's peak RSS (from wait4, so the figure is the child's own).

    .stemq/venv-ref/bin/python services/demucs/scripts/make_fixtures.py --full --bench-seconds 0
    cargo build -p stemq-demucs --release --example bench
    .stemq/venv-ref/bin/python services/demucs/scripts/bench_vs_torch.py --seconds 30 300 --threads 2 1

`--repeat N` runs each pair N times, alternating PyTorch and ours, and reports the
medians with the range of the pairs' ratios: on a shared VM one pair moves by ±10 %.

`--ceiling` (needs `cargo build -p stemq-demucs --release --example kernels`) also measures,
in the same run, what each side's matrix product reaches on this machine: PyTorch's
`a @ b` with 1 and N threads, and the `gemm` crate with 1 call and N concurrent calls
(the `kernels` example), and prints each forward pass's GFLOPS (254 GFLOP per 7.8 s
segment, counted by `torch.utils.flop_counter` on the full-size htdemucs) as a fraction
of its own gemm ceiling. On a shared VM that ceiling moves from minute to minute, and
with it both sides' times.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

TORCH = r"""
import json, sys, time, torch
from demucs.states import load_model
from demucs.apply import apply_model
seconds, threads, path = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(threads)
model = load_model(path).eval()
g = torch.Generator().manual_seed(22)
x = (torch.randn(1, 2, int(seconds * model.samplerate), generator=g) * 0.1).float()
with torch.no_grad():
    t0 = time.perf_counter()
    apply_model(model, x, shifts=0, split=True, overlap=0.25, progress=False)
    dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "torch": torch.__version__}))
"""


TORCH_GEMM = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
out = []
for m, n, k in [(1024, 1024, 1024), (2688, 2048, 512), (2688, 512, 2048)]:
    a, b = torch.rand(m, k), torch.rand(k, n)
    for _ in range(3):
        a @ b
    best = min((lambda t: (a @ b, time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(7))
    out.append(2 * m * n * k / best / 1e9)
print(json.dumps(out))
"""

# torch.utils.flop_counter on the full-size htdemucs: GFLOP per 7.8 s segment.
GFLOP_PER_SEGMENT = 254.0
SEGMENT = 343980  # samples, 7.8 s at 44.1 kHz
STRIDE = int(0.75 * SEGMENT)  # overlap 0.25


def segments(seconds):
    return -(-int(seconds * 44100) // STRIDE)


def ceilings(threads, root):
    """Median GFLOPS of the three product shapes: PyTorch at `threads`, ours with
    `threads` concurrent calls."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", TORCH_GEMM, str(threads)], env=env, capture_output=True,
                         text=True, check=True).stdout
    torch_g = sorted(json.loads(out.strip().splitlines()[-1]))[1]
    kernels = root / "target" / "release" / "examples" / "kernels"
    if not kernels.exists():
        sys.exit(f"{kernels} is missing: cargo build -p stemq-demucs --release --example kernels")
    out = subprocess.run([str(kernels), "--passes", str(threads), "--gemm-only"], capture_output=True, text=True,
                         check=True).stdout
    ours_g = sorted(float(x) for x in re.findall(r"([0-9.]+) GFLOPS", out))[1]
    return torch_g, ours_g


def pair(args, model, seconds, threads):
    """One PyTorch run, then one of ours: (torch s, ours s, torch MiB, ours MiB)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    out, torch_rss = peak_rss_run([sys.executable, "-c", TORCH, str(seconds), str(threads), str(model)], env)
    torch_s = json.loads(out.strip().splitlines()[-1])["seconds"]
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out, ours_rss = peak_rss_run(
        [str(args.bench), "--dir", str(args.dir), "--seconds", str(seconds), "--stream", "--jobs", str(threads)],
        env,
    )
    m = re.search(r"in ([0-9.]+) s, real-time factor", out)
    if not m:
        sys.exit(f"unexpected bench output:\n{out}")
    return torch_s, float(m.group(1)), torch_rss, ours_rss


def peak_rss_run(cmd, env):
    """Runs cmd with os.wait4 to read the child's own peak RSS (MiB)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    if status != 0:
        sys.exit(f"{cmd[0]} failed ({status}):\n{err[-2000:]}")
    return out, usage.ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, nargs="+", default=[30.0, 300.0])
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--dir", type=Path, default=ROOT / "target" / "demucs-full")
    ap.add_argument("--bench", type=Path, default=ROOT / "target" / "release" / "examples" / "bench")
    ap.add_argument("--ceiling", action="store_true", help="also measure each side's gemm ceiling")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each pair N times, alternating, and report medians (the box is noisy)")
    args = ap.parse_args()
    model = args.dir / "repo" / "f0f0f0f0.th"
    if not model.exists():
        sys.exit(f"{model} is missing: run make_fixtures.py --full first")
    if not args.bench.exists():
        sys.exit(f"{args.bench} is missing: cargo build -p stemq-demucs --release --example bench")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"machine: {os.cpu_count()} cores, {cpu}; load average before: {os.getloadavg()[0]:.2f}")
    print("| audio | threads | PyTorch s (RTF) | ours s (RTF) | PyTorch / ours | PyTorch peak RSS | ours peak RSS |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for seconds in args.seconds:
        for threads in args.threads:
            pairs = [pair(args, model, seconds, threads) for _ in range(args.repeat)]
            torch_s = statistics.median(p[0] for p in pairs)
            ours_s = statistics.median(p[1] for p in pairs)
            torch_rss = max(p[2] for p in pairs)
            ours_rss = max(p[3] for p in pairs)
            row = dict(audio=seconds, threads=threads, torch_s=torch_s, ours_s=ours_s,
                       ratio=torch_s / ours_s, torch_rss_mib=torch_rss, ours_rss_mib=ours_rss,
                       pairs=[dict(torch_s=p[0], ours_s=p[1]) for p in pairs])
            rows.append(row)
            spread = ""
            if len(pairs) > 1:
                ratios = sorted(p[0] / p[1] for p in pairs)
                spread = f" (pairs {ratios[0]:.2f}–{ratios[-1]:.2f}×, median of {len(pairs)})"
            print(f"| {seconds:g} s | {threads} | {torch_s:.1f} ({torch_s / seconds:.2f}) | "
                  f"{ours_s:.1f} ({ours_s / seconds:.2f}) | **{torch_s / ours_s:.2f}×**{spread} | "
                  f"{torch_rss:.0f} MiB | {ours_rss:.0f} MiB |", flush=True)
    if args.ceiling:
        print()
        print("| threads | PyTorch gemm GFLOPS | ours gemm GFLOPS (concurrent calls) | audio | PyTorch forward GFLOPS (of its ceiling) | ours forward GFLOPS (of its ceiling) |")
        print("|---:|---:|---:|---:|---:|---:|")
        for threads in sorted(set([1] + args.threads)):
            torch_g, ours_g = ceilings(threads, ROOT)
            for row in (r for r in rows if r["threads"] == threads):
                work = segments(row["audio"]) * GFLOP_PER_SEGMENT
                tf, of = work / row["torch_s"], work / row["ours_s"]
                print(f"| {threads} | {torch_g:.0f} | {ours_g:.0f} | {row['audio']:g} s | {tf:.0f} ({tf / torch_g:.0%}) | "
                      f"{of:.0f} ({of / ours_g:.0%}) |", flush=True)
            if not any(r["threads"] == threads for r in rows):
                print(f"| {threads} | {torch_g:.0f} | {ours_g:.0f} | | | |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
