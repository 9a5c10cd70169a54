//! Speed of the host kernels alone, on the shapes of the full-size htdemucs, as the
//! engine runs them on two cores: `--passes N` (2 by default) concurrent calls, each on
//! a one-thread pool of its own. Prints the GFLOPS of all passes together.
//!
//! ```text
//! cargo run -p stemq-demucs --release --example kernels [-- --passes 1] [--gemm-only]
//! ```
//!
//! The plain gemm rows are the ceiling a forward pass works under at that moment. On the
//! project's 2-vCPU machines it moves with the neighbours: two concurrent calls reached
//! anything from 191 to 391 GFLOPS within the same hour (one call: 148–213).

use std::time::Instant;

use stemq_demucs::cpu::{attention, conv3x3, conv3x3_weights, conv_axis, AttentionShape, Conv3x3, ConvAxis};

fn main() {
    stemq_demucs::cpu::tune_allocator(); // as the worker does
    let args: Vec<String> = std::env::args().collect();
    let passes: usize = args
        .iter()
        .position(|a| a == "--passes")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.parse().expect("--passes N"))
        .unwrap_or(2);
    for (m, n, k) in [(1024, 1024, 1024), (2688, 2048, 512), (2688, 512, 2048)] {
        let a = vec![0.5f32; m * k];
        let b = vec![0.25f32; k * n];
        let flop = 2.0 * (m * n * k) as f64 * passes as f64;
        let best = best_of(passes, || {
            let mut c = vec![0f32; m * n];
            // SAFETY: row-major m×k, k×n and m×n buffers of exactly those lengths,
            // owned here; no aliasing.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    a.as_ptr(),
                    1,
                    k as isize,
                    b.as_ptr(),
                    1,
                    n as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            std::hint::black_box(c);
        });
        println!("gemm {m}×{n}×{k} ×{passes}: {:7.2} ms, {:6.1} GFLOPS", best * 1e3, flop / best / 1e9);
    }
    if args.iter().any(|a| a == "--gemm-only") {
        return;
    }
    for (name, tq, tk) in [("freq self", 2688, 2688), ("time self", 1344, 1344), ("freq→time cross", 2688, 1344)] {
        let (heads, head_dim) = (8, 64);
        let c = heads * head_dim;
        let fill = |n: usize, seed: u32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / 16_777_216.0 - 0.5)
                .collect()
        };
        let (q, k, v) = (fill(tq * c, 1), fill(tk * c, 2), fill(tk * c, 3));
        let shape = AttentionShape { batch: 1, tq, tk, heads, head_dim };
        let flop = 4.0 * (tq * tk * c) as f64 * passes as f64;
        let best = best_of(passes, || {
            std::hint::black_box(attention(&q, &k, &v, shape));
        });
        println!("attention {name:>16} ×{passes}: {:7.2} ms, {:6.1} GFLOPS", best * 1e3, flop / best / 1e9);
    }
    // The frequency encoders' [8, 1] stride-4 convolution, [cin, F, 336] → [cout, F/4, 336].
    for (cin, cout, f) in [(4, 48, 2048), (48, 96, 512), (96, 192, 128), (192, 384, 32)] {
        let t = 336;
        let (x, w, b) = conv_inputs(cin, cout, f * t, 8);
        let flop = 2.0 * (cout * cin * 8 * (f / 4) * t) as f64 * passes as f64;
        let axis = freq_axis(cin, cout, f, t, (8, 4, 2), (1, 0));
        let best = best_of(passes, || {
            std::hint::black_box(conv_axis(&x, &w, &b, axis));
        });
        println!(
            "conv [8,1]/4 {cin:>3}→{cout:<3} F {f:<4} ×{passes}: {:7.2} ms ({:5.1} GFLOPS)",
            best * 1e3,
            flop / best / 1e9
        );
    }
    // The decoders' 3×3 rewrite, [cin, F, 336] → [2·cin, F, 336]: per tap (conv_axis)
    // and by Winograd (conv3x3), in the FLOPs of the direct convolution.
    for (cin, f) in [(384, 8), (192, 32), (96, 128), (48, 512)] {
        let (cout, t) = (2 * cin, 336);
        let (x, w, b) = conv_inputs(cin, cout, f * t, 9);
        let flop = 2.0 * (cout * cin * 9 * f * t) as f64 * passes as f64;
        let axis = freq_axis(cin, cout, f, t, (3, 1, 1), (3, 1));
        let per_tap = best_of(passes, || {
            std::hint::black_box(conv_axis(&x, &w, &b, axis));
        });
        let u = conv3x3_weights(&w, cout, cin);
        let c = Conv3x3 { batch: 1, cin, cout, height: f, width: t, pad_h: 1, pad_w: 1, glu: false };
        let wino = best_of(passes, || {
            std::hint::black_box(conv3x3(&x, None, &u, &b, c));
        });
        println!(
            "conv 3×3 {cin:>3}→{cout:<3} F {f:<3} ×{passes}: per tap {:7.2} ms ({:5.1} GFLOPS), Winograd {:7.2} ms ({:5.1}), {:.2}×",
            per_tap * 1e3,
            flop / per_tap / 1e9,
            wino * 1e3,
            flop / wino / 1e9,
            per_tap / wino
        );
    }
}

/// Input `[cin, values]`, weights `[cout, cin, taps]` and bias of a convolution.
fn conv_inputs(cin: usize, cout: usize, values: usize, taps: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let x = (0..cin * values).map(|i| (i % 97) as f32 / 97.0 - 0.5).collect();
    let w = (0..cout * cin * taps).map(|i| (i % 89) as f32 / 890.0 - 0.05).collect();
    (x, w, vec![0.1f32; cout])
}

/// A convolution over frequency of `[cin, F, T]`: (kernel, stride, pad) along F,
/// (kernel, pad) along T.
fn freq_axis(
    cin: usize,
    cout: usize,
    f: usize,
    t: usize,
    (kernel, stride, pad): (usize, usize, usize),
    (inner_kernel, inner_pad): (usize, usize),
) -> ConvAxis {
    ConvAxis {
        batch: 1,
        cin,
        cout,
        rows: 1,
        len: f,
        inner: t,
        kernel,
        stride,
        pad,
        dilation: 1,
        inner_kernel,
        inner_pad,
    }
}

/// The best of five rounds, in seconds, of `passes` concurrent calls of `f`, each on a
/// one-thread rayon pool of its own (as the engine runs its passes).
fn best_of(passes: usize, f: impl Fn() + Sync) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..passes {
                s.spawn(|| {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
                    pool.install(&f);
                });
            }
        });
        best = best.min(t0.elapsed().as_secs_f64());
    }
    best
}
