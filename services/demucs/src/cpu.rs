//! Host kernels for the CPU backend, where Burn's generic CPU ops leave most of the time
//! on the table: multi-head attention (Flex runs one head at a time with a scalar
//! softmax and libm `expf`) and the exact GELU (scalar libm `erff`). Both work on plain
//! `f32` slices; [`is_cpu`] tells the model code when a backend's tensors can take this
//! path (on CUDA the backend's own fused kernels run instead).
//!
//! The results are as close to PyTorch's as Flex's were: `exp` is a Cephes-style
//! polynomial within 2 ulp of the correctly rounded value, `erf` a fitted polynomial
//! within 2e-7 absolute, and the attention sums run in the same order as the gemm calls
//! they replace (the parity tests pin all of it, block by block).

use std::any::TypeId;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rayon::prelude::*;

/// Tunes glibc's allocator for the model's working set, once per process: large
/// activation buffers (tens of MB, allocated and freed for every layer) come from the
/// heap instead of fresh `mmap`s, and up to 256 MiB of freed memory stays mapped. Without
/// it every such buffer costs page faults and zeroing: 22 % of the CPU time of a
/// separation went to the kernel; with it 4 % (30 s of audio on 2 cores: 14.6 → 12.6 s
/// for the first two settings, → 11.3 s with one arena; peak RSS 830 → 770 MB). A no-op
/// on other C libraries.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: mallopt only changes allocator parameters; it is thread-safe.
        ONCE.call_once(|| unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
            // One arena: a thread arena's heaps are at most 64 MiB, so larger blocks on
            // the forward-pass threads would be mmap'd anyway.
            libc::mallopt(libc::M_ARENA_MAX, 1);
        });
    }
}

/// Whether `B` is the CPU backend whose tensors are host memory ([`crate::CpuBackend`]).
/// `STEMQ_DEMUCS_GENERIC_OPS=1` turns the host kernels off (Burn's own ops everywhere),
/// to compare backends on equal terms.
pub fn is_cpu<B: Backend>() -> bool {
    static GENERIC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let generic = *GENERIC.get_or_init(|| std::env::var_os("STEMQ_DEMUCS_GENERIC_OPS").is_some_and(|v| v == "1"));
    !generic && TypeId::of::<B>() == TypeId::of::<crate::CpuBackend>()
}

/// Queries per task: the score block `[QUERY_BLOCK, tk]` stays in L2 (1.4 MB at tk =
/// 2688, the freq branch of htdemucs), and there are enough tasks to keep cores busy.
const QUERY_BLOCK: usize = 128;

/// Shapes of one [`attention`] call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Batch.
    pub batch: usize,
    /// Query tokens.
    pub tq: usize,
    /// Key (and value) tokens.
    pub tk: usize,
    /// Heads; the model width is `heads * head_dim`.
    pub heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

/// `softmax(q kᵀ / √d) v` per head, as `nn.MultiheadAttention` computes it after the
/// input projections. `q` `[B, Tq, C]`, `k`, `v` `[B, Tk, C]` (heads are the `C / H`
/// column groups, read in place: no head transposes) → `[B, Tq, C]`.
pub fn attention(q: &[f32], k: &[f32], v: &[f32], s: AttentionShape) -> Vec<f32> {
    let AttentionShape { batch, tq, tk, heads, head_dim } = s;
    let c = heads * head_dim;
    assert_eq!(q.len(), batch * tq * c, "attention: query shape");
    assert_eq!(k.len(), batch * tk * c, "attention: key shape");
    assert_eq!(v.len(), batch * tk * c, "attention: value shape");
    let mut out = vec![0f32; batch * tq * c];
    let scale = 1.0 / (head_dim as f32).sqrt();
    let blocks = tq.div_ceil(QUERY_BLOCK);
    // Tasks: (batch, head, query block). Each writes its own rows x columns of `out`,
    // disjoint from every other task's.
    let out_ptr = SendPtr(out.as_mut_ptr());
    (0..batch * heads * blocks).into_par_iter().for_each_init(
        || vec![0f32; QUERY_BLOCK * tk],
        |scores, task| {
            let (bh, blk) = (task / blocks, task % blocks);
            let (b, h) = (bh / heads, bh % heads);
            let q0 = blk * QUERY_BLOCK;
            let m = QUERY_BLOCK.min(tq - q0);
            let qp = q[(b * tq + q0) * c + h * head_dim..].as_ptr();
            let kp = k[b * tk * c + h * head_dim..].as_ptr();
            let vp = v[b * tk * c + h * head_dim..].as_ptr();
            let scores = &mut scores[..m * tk];
            // SAFETY: the pointers address `m` rows (stride c) of head h of q, and `tk`
            // rows of k and v, all in bounds (shapes asserted above); `scores` is m x tk.
            unsafe {
                // scores[m, tk] = scale * Q[m, d] Kᵀ[d, tk]
                gemm::gemm(
                    m,
                    tk,
                    head_dim,
                    scores.as_mut_ptr(),
                    1,
                    tk as isize,
                    false,
                    qp,
                    1,
                    c as isize,
                    kp,
                    c as isize,
                    1,
                    0.0,
                    scale,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            let mut inv = [0f32; QUERY_BLOCK];
            for (row, inv) in scores.chunks_exact_mut(tk).zip(inv.iter_mut()) {
                *inv = 1.0 / softmax_numerators(row);
            }
            // SAFETY: rows q0..q0+m, columns h*d..(h+1)*d of `out` belong to this task only.
            let op = unsafe { out_ptr.get().add((b * tq + q0) * c + h * head_dim) };
            unsafe {
                // out[m, d] = P[m, tk] V[tk, d]
                gemm::gemm(
                    m,
                    head_dim,
                    tk,
                    op,
                    1,
                    c as isize,
                    false,
                    scores.as_ptr(),
                    1,
                    tk as isize,
                    vp,
                    1,
                    c as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
                for (i, inv) in inv.iter().take(m).enumerate() {
                    let row = std::slice::from_raw_parts_mut(op.add(i * c), head_dim);
                    row.iter_mut().for_each(|x| *x *= inv);
                }
            }
        },
    );
    out
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint parts of the buffer behind the pointer (see `attention`).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Replaces `row` by `exp(row - max(row))` and returns the sum.
fn softmax_numerators(row: &mut [f32]) -> f32 {
    dispatch!(softmax_numerators_impl(row))
}

/// The exact GELU, `x · Φ(x) = x/2 · (1 + erf(x/√2))`, in place.
pub fn gelu_in_place(x: &mut [f32]) {
    dispatch!(gelu_impl(x))
}

/// `out = x + scale[c] · a · σ(b)` where `y` `[N, 2C, R]` holds `a` in its first `C`
/// channels and `b` in the last (`nn.GLU(dim=1)`), `x` and `out` are `[N, C, R]`, in
/// place in `x`: DConv's GLU, LayerScale and residual in one pass.
pub fn glu_scale_add_in_place(x: &mut [f32], y: &[f32], scale: &[f32], n: usize, r: usize) {
    let c = scale.len();
    assert_eq!(x.len(), n * c * r, "glu: residual shape");
    assert_eq!(y.len(), 2 * n * c * r, "glu: input shape");
    dispatch!(glu_scale_add_impl(x, y, scale, r))
}

/// [`gelu_in_place`] on a tensor of the CPU backend, Burn's `gelu` on any other.
pub fn gelu<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    if !is_cpu::<B>() {
        return burn::tensor::activation::gelu(t);
    }
    let (dims, device) = (t.dims(), t.device());
    let mut data = host_vec(t);
    gelu_in_place(&mut data);
    Tensor::from_data(TensorData::new(data, dims), &device)
}

/// `nn.GLU(dim=1)`: `[N, 2C, …]` → `[N, C, …]`; host kernel on the CPU backend.
pub fn glu<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    if !is_cpu::<B>() {
        return burn::tensor::activation::glu(t, 1);
    }
    let mut dims = t.dims();
    dims[1] /= 2;
    let device = t.device();
    let (n, r) = (dims[0], dims[2..].iter().product::<usize>());
    let mut out = vec![0f32; n * dims[1] * r];
    glu_scale_add_in_place(&mut out, &host_vec(t), &vec![1.0; dims[1]], n, r);
    Tensor::from_data(TensorData::new(out, dims), &device)
}

/// `x + scale · glu(y)` with `scale` `[C]` on dim 1 (DConv's last step); one pass on
/// the CPU backend.
pub fn glu_scale_add<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    y: Tensor<B, D>,
    scale: Tensor<B, 1>,
) -> Tensor<B, D> {
    let dims = x.dims();
    if !is_cpu::<B>() {
        let mut shape = [1usize; D];
        shape[1] = dims[1];
        let mut reps = dims;
        reps[1] = 1;
        let mut s = scale.reshape(shape);
        for (d, &k) in reps.iter().enumerate() {
            if k > 1 {
                s = s.repeat_dim(d, k);
            }
        }
        return x + burn::tensor::activation::glu(y, 1) * s;
    }
    let device = x.device();
    let (n, r) = (dims[0], dims[2..].iter().product::<usize>());
    let mut out = host_vec(x);
    glu_scale_add_in_place(&mut out, &host_vec(y), &host_vec(scale), n, r);
    Tensor::from_data(TensorData::new(out, dims), &device)
}

/// One convolution along one axis of `x` laid out `[N, Cin, R, L, I]`: the kernel
/// runs over `L`, every one of the `R` rows and `I` inner columns shares it (so
/// `Conv1d` is `R = I = 1`, DConv on frequency rows is `R = F`, and the encoders'
/// `[k, 1]` Conv2d over frequency is `L = F, I = T`).
#[derive(Debug, Clone, Copy)]
pub struct ConvAxis {
    /// Batch N.
    pub batch: usize,
    /// Input channels.
    pub cin: usize,
    /// Output channels.
    pub cout: usize,
    /// Rows R.
    pub rows: usize,
    /// Length L of the convolved axis.
    pub len: usize,
    /// Inner columns I.
    pub inner: usize,
    /// Kernel size.
    pub kernel: usize,
    /// Stride (with dilation 1).
    pub stride: usize,
    /// Zero padding on both ends of `L`.
    pub pad: usize,
    /// Dilation (with stride 1).
    pub dilation: usize,
}

impl ConvAxis {
    /// Output length along `L`.
    pub fn out_len(&self) -> usize {
        (self.len + 2 * self.pad - self.dilation * (self.kernel - 1) - 1) / self.stride + 1
    }
}

/// The convolution of [`ConvAxis`] without im2col: the padded input is laid out once in
/// polyphase order (`[Cin·s, R, Lq, I]`, phase `p` of channel `c` holding samples
/// `j·s + p`), which turns a stride-`s` kernel of `k` taps into a stride-1 kernel of
/// `⌈k/s⌉` taps over `Cin·s` channels; each tap is then one large gemm over every row
/// and column at once, accumulated in place. `w` `[Cout, Cin, K]`, `bias` `[Cout]` →
/// `[N, Cout, R, Lout, I]`.
pub fn conv_axis(x: &[f32], w: &[f32], bias: &[f32], c: ConvAxis) -> Vec<f32> {
    let ConvAxis { batch, cin, cout, rows, len, inner, kernel, stride: s, pad, dilation } = c;
    assert!(s == 1 || dilation == 1, "conv: stride and dilation together");
    assert_eq!(x.len(), batch * cin * rows * len * inner, "conv: input shape");
    assert_eq!(w.len(), cout * cin * kernel, "conv: weight shape");
    assert_eq!(bias.len(), cout, "conv: bias shape");
    let lout = c.out_len();
    let taps = kernel.div_ceil(s);
    let step = if s == 1 { dilation } else { 1 };
    let lq = lout + (taps - 1) * step;
    let cq = cin * s;
    let ncols = rows * lq * inner;
    // Per-tap weights [Cout, Cin·s].
    let mut wt = vec![0f32; taps * cout * cq];
    for tap in 0..taps {
        for co in 0..cout {
            for ci in 0..cin {
                for ph in 0..s {
                    let k = tap * s + ph;
                    if k < kernel {
                        wt[(tap * cout + co) * cq + ci * s + ph] = w[(co * cin + ci) * kernel + k];
                    }
                }
            }
        }
    }
    let mut out = vec![0f32; batch * cout * rows * lout * inner];
    // The last taps read up to (taps-1)·step columns past a row: zeros at the very end.
    let mut xq = vec![0f32; cq * ncols + (taps - 1) * step * inner];
    let mut y = vec![0f32; cout * ncols];
    for n in 0..batch {
        xq[..cq * ncols].par_chunks_mut(ncols).enumerate().for_each(|(q, dst)| {
            let (ci, ph) = (q / s, q % s);
            for r in 0..rows {
                let src = &x[((n * cin + ci) * rows + r) * len * inner..][..len * inner];
                let dst = &mut dst[r * lq * inner..][..lq * inner];
                for j in 0..lq {
                    let at = j * s + ph;
                    let d = &mut dst[j * inner..][..inner];
                    match at.checked_sub(pad).filter(|l| *l < len) {
                        Some(l) => d.copy_from_slice(&src[l * inner..][..inner]),
                        None => d.fill(0.0),
                    }
                }
            }
        });
        for tap in 0..taps {
            // SAFETY: y is [cout, ncols]; wt's tap block is [cout, cq]; xq from the tap's
            // offset holds cq rows of ncols (plus the zero tail) — all in bounds.
            unsafe {
                gemm::gemm(
                    cout,
                    ncols,
                    cq,
                    y.as_mut_ptr(),
                    1,
                    ncols as isize,
                    tap > 0,
                    wt[tap * cout * cq..].as_ptr(),
                    1,
                    cq as isize,
                    xq[tap * step * inner..].as_ptr(),
                    1,
                    ncols as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(0),
                );
            }
        }
        out[n * cout * rows * lout * inner..][..cout * rows * lout * inner]
            .par_chunks_mut(rows * lout * inner)
            .enumerate()
            .for_each(|(co, dst)| {
                let b = bias[co];
                for r in 0..rows {
                    let src = &y[co * ncols + r * lq * inner..][..lout * inner];
                    let d = &mut dst[r * lout * inner..][..lout * inner];
                    d.iter_mut().zip(src).for_each(|(o, v)| *o = v + b);
                }
            });
    }
    out
}

/// `GroupNorm(groups, C, eps=1e-5)` in place on `x` laid out `[N, C, F, T]`, one
/// normalisation set per `(n, group, f)` over its `C / groups` channels × `T` values
/// (`F = 1` is the plain `[N, C, T]` case; `groups = 1` with `F` rows is DConv on
/// frequency rows, PyTorch's `[N·F, C, T]`). Statistics are summed in f64 (sets reach
/// 500 k values, where f32 sums lose digits), two passes like PyTorch's.
pub fn group_norm_in_place(x: &mut [f32], weight: &[f32], bias: &[f32], shape: [usize; 4], groups: usize) {
    let [n, c, f, t] = shape;
    assert_eq!(x.len(), n * c * f * t, "group norm: shape");
    assert!(groups > 0 && c % groups == 0 && weight.len() == c && bias.len() == c, "group norm: channels");
    let cg = c / groups;
    let xs: &[f32] = x;
    let row = |ni: usize, ch: usize, fi: usize| &xs[((ni * c + ch) * f + fi) * t..][..t];
    let stats: Vec<(f32, f32)> = (0..n * groups * f)
        .into_par_iter()
        .map(|set| {
            let (ni, g, fi) = (set / (groups * f), set / f % groups, set % f);
            let count = (cg * t) as f64;
            let sum: f64 = (g * cg..(g + 1) * cg).map(|ch| sum_f64(row(ni, ch, fi), 0.0, false)).sum();
            let mean = sum / count;
            let var: f64 = (g * cg..(g + 1) * cg).map(|ch| sum_f64(row(ni, ch, fi), mean, true)).sum::<f64>() / count;
            (mean as f32, (1.0 / (var + 1e-5).sqrt()) as f32)
        })
        .collect();
    x.par_chunks_mut(f * t).enumerate().for_each(|(nc, chunk)| {
        let (ni, ch) = (nc / c, nc % c);
        for (fi, r) in chunk.chunks_exact_mut(t).enumerate() {
            let (mean, inv) = stats[(ni * groups + ch / cg) * f + fi];
            let (a, b) = (inv * weight[ch], bias[ch]);
            r.iter_mut().for_each(|v| *v = (*v - mean) * a + b);
        }
    });
}

/// `Σ (x - center)`, or `Σ (x - center)²` with `square`, in f64 lanes.
fn sum_f64(x: &[f32], center: f64, square: bool) -> f64 {
    let mut acc = [0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for ch in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(ch) {
            let d = v as f64 - center;
            *a += if square { d * d } else { d };
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| v as f64 - center).map(|d| if square { d * d } else { d }).sum();
    acc.iter().sum::<f64>() + tail
}

/// A CPU tensor's values, row-major (a copy only where the tensor was a strided view).
pub fn host_vec<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().into_vec::<f32>().expect("the model runs in f32")
}

/// Runs the body compiled for the widest vector unit the CPU has (chosen at run time).
macro_rules! dispatch {
    ($f:ident($($a:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the feature was detected.
                return unsafe { x86::avx512::$f($($a),*) };
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the features were detected.
                return unsafe { x86::avx2::$f($($a),*) };
            }
        }
        $f($($a),*)
    }};
}
use dispatch;

#[cfg(target_arch = "x86_64")]
mod x86 {
    pub mod avx512 {
        #[target_feature(enable = "avx512f")]
        pub unsafe fn softmax_numerators_impl(row: &mut [f32]) -> f32 {
            super::super::softmax_numerators_impl(row)
        }
        #[target_feature(enable = "avx512f")]
        pub unsafe fn gelu_impl(x: &mut [f32]) {
            super::super::gelu_impl(x)
        }
        #[target_feature(enable = "avx512f")]
        pub unsafe fn glu_scale_add_impl(x: &mut [f32], y: &[f32], scale: &[f32], r: usize) {
            super::super::glu_scale_add_impl(x, y, scale, r)
        }
    }
    pub mod avx2 {
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn softmax_numerators_impl(row: &mut [f32]) -> f32 {
            super::super::softmax_numerators_impl(row)
        }
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn gelu_impl(x: &mut [f32]) {
            super::super::gelu_impl(x)
        }
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn glu_scale_add_impl(x: &mut [f32], y: &[f32], scale: &[f32], r: usize) {
            super::super::glu_scale_add_impl(x, y, scale, r)
        }
    }
}

/// Lanes the loops below are written for; the compiler maps them onto the vector unit.
const LANES: usize = 16;

#[inline(always)]
fn softmax_numerators_impl(row: &mut [f32]) -> f32 {
    let mut mx = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for ch in &mut chunks {
        for (m, &x) in mx.iter_mut().zip(ch) {
            *m = m.max(x);
        }
    }
    let mut max = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for m in mx {
        max = max.max(m);
    }
    let mut acc = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for ch in &mut chunks {
        for (a, x) in acc.iter_mut().zip(ch.iter_mut()) {
            *x = exp(*x - max);
            *a += *x;
        }
    }
    let mut sum = 0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x - max);
        sum += *x;
    }
    sum + acc.iter().sum::<f32>()
}

#[inline(always)]
fn glu_scale_add_impl(x: &mut [f32], y: &[f32], scale: &[f32], r: usize) {
    let c = scale.len();
    for (xn, yn) in x.chunks_exact_mut(c * r).zip(y.chunks_exact(2 * c * r)) {
        let (a, b) = yn.split_at(c * r);
        for (ch, &s) in scale.iter().enumerate() {
            let span = ch * r..(ch + 1) * r;
            for ((o, &a), &b) in xn[span.clone()].iter_mut().zip(&a[span.clone()]).zip(&b[span]) {
                // σ(b) = 1 / (1 + e^-b), as PyTorch's float sigmoid
                *o += s * (a / (1.0 + exp(-b)));
            }
        }
    }
}

#[inline(always)]
fn gelu_impl(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
    }
}

/// `exp(x)`: Cephes's `expf` reduction `x = n ln2 + r`, `|r| <= ln2/2`, and its
/// degree-6 polynomial, then `2^n` through the exponent bits. Arguments are clamped to
/// [-87.3, 88.3]: below, 1.2e-38 (nothing against the softmax row maximum's 1 or
/// sigmoid's 1; PyTorch returns a subnormal or 0); above, 2e38 (sigmoid's 1/(1+e^x)
/// is 0 either way).
#[inline(always)]
#[allow(clippy::excessive_precision)] // Cephes's coefficients, as published
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4; // ln 2, high part (exact in few bits)
    const C2: f32 = -2.121_944_4e-4; // ln 2 - C1
    let x = x.clamp(-87.3, 88.3);
    // round-to-nearest of x·log2(e) via the 1.5·2^23 shifter
    let shifter = 12_582_912.0f32;
    let t = x.mul_add(LOG2E, shifter);
    let n = t - shifter;
    let r = n.mul_add(-C2, n.mul_add(-C1, x));
    let mut p = 1.987_569_2e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 5.000_000_1e-1);
    let e = (p * r).mul_add(r, r) + 1.0;
    // 2^n: n is an integer in [-126, 127]; the shifter left it in t's low mantissa bits.
    let bits = (t.to_bits() as i32).wrapping_sub(0x4B40_0000).wrapping_add(127) << 23;
    e * f32::from_bits(bits as u32)
}

/// `erf(x)`, within 2e-7 absolute of the exact value (f32 carries ~6e-8 at 1):
/// the Maclaurin series on `|x| < 1`, `1 - erfc(|x|)` from a Chebyshev fit above, both
/// evaluated and selected without branches so the loop vectorises.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    // |x| < 1: x · P(x²), the series to x²⁰ (the next term is 1e-9).
    let z = a * a;
    let mut p = ERF_SMALL[0];
    for &c in &ERF_SMALL[1..] {
        p = p.mul_add(z, c);
    }
    let small = a * p;
    // |x| >= 1: erfc(a) = t · exp(-a² + Q(t)), t = 1/(1 + a/2).
    let t = 1.0 / (1.0 + 0.5 * a);
    let mut q = ERF_LARGE[0];
    for &c in &ERF_LARGE[1..] {
        q = q.mul_add(t, c);
    }
    let large = 1.0 - t * exp(-z + q);
    let r = if a < 1.0 { small } else { large.min(1.0) };
    r.copysign(x)
}

/// Coefficients of `erf(x)/x` as a polynomial in `x²`, highest first (Maclaurin series
/// of erf: 2/√π · Σ (-1)ⁿ x²ⁿ / (n! (2n+1)), truncated where the terms fall below 1e-9
/// on |x| < 1).
const ERF_SMALL: [f32; 11] = {
    // 2/sqrt(pi) * (-1)^n / (n! (2n+1)), n = 10..0
    const K: f64 = std::f64::consts::FRAC_2_SQRT_PI;
    const fn term(n: u32) -> f32 {
        let mut fact = 1.0f64;
        let mut i = 1;
        while i <= n {
            fact *= i as f64;
            i += 1;
        }
        let sign = if n.is_multiple_of(2) { 1.0 } else { -1.0 };
        (K * sign / (fact * (2 * n + 1) as f64)) as f32
    }
    [term(10), term(9), term(8), term(7), term(6), term(5), term(4), term(3), term(2), term(1), term(0)]
};

/// Numerical Recipes' `erfc` Chebyshev fit (`erfcc`, fractional error < 1.2e-7):
/// `erfc(a) = t · exp(-a² - 1.26551223 + t·(1.00002368 + t·(…)))`, `t = 1/(1 + a/2)`;
/// highest power first, the constant term folded in.
#[allow(clippy::excessive_precision)] // as published
const ERF_LARGE: [f32; 10] = [
    0.170_872_77,
    -0.822_152_23,
    1.488_515_87,
    -1.135_203_98,
    0.278_868_07,
    -0.186_288_06,
    0.096_784_18,
    0.374_091_96,
    1.000_023_68,
    -1.265_512_23,
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Relative error of `a` against the f64 value `b`.
    fn close(a: f32, b: f64) -> f64 {
        ((a as f64) - b).abs() / b.abs().max(f64::MIN_POSITIVE)
    }

    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            worst = worst.max(close(exp(x), (x as f64).exp()));
            x += 0.000_731;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1.3e-38);
    }

    #[test]
    fn erf_is_within_2e7_absolute() {
        let mut worst = 0f64;
        let mut x = -6.0f32;
        while x <= 6.0 {
            let exact = libm_erf(x as f64);
            worst = worst.max(((erf(x) as f64) - exact).abs());
            x += 0.000_37;
        }
        assert!(worst < 2e-7, "worst absolute error {worst:e}");
    }

    /// erf in f64 from its continued fraction / series (reference only).
    fn libm_erf(x: f64) -> f64 {
        // Series for |x| < 3, asymptotic complement above: both far below f32's error.
        let a = x.abs();
        let r = if a < 3.0 {
            let mut sum = 0f64;
            let mut term = a;
            let mut n = 0f64;
            loop {
                let t = term / (2.0 * n + 1.0);
                sum += t;
                if t.abs() < 1e-17 {
                    break;
                }
                n += 1.0;
                term *= -a * a / n;
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc continued fraction (Lentz), 60 terms.
            let mut f = 0f64;
            for k in (1..60).rev() {
                f = (k as f64 / 2.0) / (a + f);
            }
            1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / (a + f)
        };
        r.copysign(x)
    }

    #[test]
    fn attention_matches_the_definition() {
        let s = AttentionShape { batch: 2, tq: 300, tk: 77, heads: 3, head_dim: 8 };
        let c = s.heads * s.head_dim;
        let mut seed = 7u64;
        let mut rnd = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
                })
                .collect()
        };
        let (q, k, v) = (rnd(s.batch * s.tq * c), rnd(s.batch * s.tk * c), rnd(s.batch * s.tk * c));
        let got = attention(&q, &k, &v, s);
        let mut worst = 0f64;
        for b in 0..s.batch {
            for h in 0..s.heads {
                for i in 0..s.tq {
                    let qi = &q[(b * s.tq + i) * c + h * s.head_dim..][..s.head_dim];
                    let logits: Vec<f64> = (0..s.tk)
                        .map(|j| {
                            let kj = &k[(b * s.tk + j) * c + h * s.head_dim..][..s.head_dim];
                            qi.iter().zip(kj).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                                / (s.head_dim as f64).sqrt()
                        })
                        .collect();
                    let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    for d in 0..s.head_dim {
                        let want: f64 =
                            (0..s.tk).map(|j| w[j] / sum * v[(b * s.tk + j) * c + h * s.head_dim + d] as f64).sum();
                        let have = got[(b * s.tq + i) * c + h * s.head_dim + d] as f64;
                        worst = worst.max((want - have).abs());
                    }
                }
            }
        }
        assert!(worst < 2e-6, "worst absolute error {worst:e}");
    }

    #[test]
    fn gelu_matches_the_definition() {
        let mut x: Vec<f32> = (-4000..4000).map(|i| i as f32 * 0.002).collect();
        let want: Vec<f64> = x.iter().map(|&v| 0.5 * v as f64 * (1.0 + libm_erf(v as f64 / 2f64.sqrt()))).collect();
        gelu_in_place(&mut x);
        let worst = x.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0f64, f64::max);
        assert!(worst < 1e-6, "worst absolute error {worst:e}");
    }

    #[test]
    fn glu_scale_add_matches_the_definition() {
        let (n, c, r) = (3, 5, 37);
        let y: Vec<f32> = (0..2 * n * c * r).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 40.0).collect();
        let x0: Vec<f32> = (0..n * c * r).map(|i| (i % 13) as f32 - 6.0).collect();
        let scale: Vec<f32> = (0..c).map(|i| 0.1 + i as f32).collect();
        let mut x = x0.clone();
        glu_scale_add_in_place(&mut x, &y, &scale, n, r);
        let mut worst = 0f64;
        for i in 0..n {
            for ch in 0..c {
                for t in 0..r {
                    let a = y[(i * 2 * c + ch) * r + t] as f64;
                    let b = y[(i * 2 * c + c + ch) * r + t] as f64;
                    let want = x0[(i * c + ch) * r + t] as f64 + scale[ch] as f64 * a / (1.0 + (-b).exp());
                    worst = worst.max((x[(i * c + ch) * r + t] as f64 - want).abs() / want.abs().max(1.0));
                }
            }
        }
        assert!(worst < 1e-6, "worst error {worst:e}");
    }

    #[test]
    fn group_norm_matches_the_definition() {
        // [N, C, F, T] with 2 groups of rows, and with F rows of one group.
        for (shape, groups) in [([2, 4, 1, 1000], 2), ([2, 3, 5, 77], 1)] {
            let [n, c, f, t] = shape;
            let x0: Vec<f32> = (0..n * c * f * t).map(|i| ((i * 7919 % 1013) as f32) / 100.0 + 3.0).collect();
            let w: Vec<f32> = (0..c).map(|i| 0.5 + i as f32).collect();
            let b: Vec<f32> = (0..c).map(|i| i as f32 - 1.0).collect();
            let mut x = x0.clone();
            group_norm_in_place(&mut x, &w, &b, shape, groups);
            let cg = c / groups;
            let mut worst = 0f64;
            for ni in 0..n {
                for g in 0..groups {
                    for fi in 0..f {
                        let idx = |ch: usize, ti: usize| ((ni * c + ch) * f + fi) * t + ti;
                        let vals: Vec<f64> = (g * cg..(g + 1) * cg)
                            .flat_map(|ch| (0..t).map(move |ti| (ch, ti)))
                            .map(|(ch, ti)| x0[idx(ch, ti)] as f64)
                            .collect();
                        let mean = vals.iter().sum::<f64>() / vals.len() as f64;
                        let var = vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / vals.len() as f64;
                        for ch in g * cg..(g + 1) * cg {
                            for ti in 0..t {
                                let want =
                                    (x0[idx(ch, ti)] as f64 - mean) / (var + 1e-5).sqrt() * w[ch] as f64 + b[ch] as f64;
                                worst = worst.max((x[idx(ch, ti)] as f64 - want).abs());
                            }
                        }
                    }
                }
            }
            assert!(worst < 2e-5, "{shape:?}: worst error {worst:e}");
        }
    }

    #[test]
    fn conv_axis_matches_the_definition() {
        // (kernel, stride, pad, dilation, rows, inner)
        for (kernel, stride, pad, dil, rows, inner) in
            [(3, 1, 1, 1, 3, 1), (3, 1, 2, 2, 2, 1), (8, 4, 2, 1, 1, 1), (8, 4, 2, 1, 1, 5), (3, 1, 1, 1, 1, 1)]
        {
            let c = ConvAxis { batch: 2, cin: 3, cout: 4, rows, len: 37, inner, kernel, stride, pad, dilation: dil };
            let x: Vec<f32> =
                (0..c.batch * c.cin * rows * c.len * inner).map(|i| ((i * 7919 % 997) as f32) / 500.0 - 1.0).collect();
            let w: Vec<f32> = (0..c.cout * c.cin * kernel).map(|i| ((i * 104729 % 611) as f32) / 300.0 - 1.0).collect();
            let b: Vec<f32> = (0..c.cout).map(|i| i as f32 * 0.25).collect();
            let got = conv_axis(&x, &w, &b, c);
            let lout = c.out_len();
            assert_eq!(got.len(), c.batch * c.cout * rows * lout * inner);
            let mut worst = 0f64;
            for n in 0..c.batch {
                for co in 0..c.cout {
                    for r in 0..rows {
                        for t in 0..lout {
                            for i in 0..inner {
                                let mut want = b[co] as f64;
                                for ci in 0..c.cin {
                                    for k in 0..kernel {
                                        let at = (t * stride + k * dil) as isize - pad as isize;
                                        if at >= 0 && (at as usize) < c.len {
                                            let xv =
                                                x[(((n * c.cin + ci) * rows + r) * c.len + at as usize) * inner + i];
                                            want += w[(co * c.cin + ci) * kernel + k] as f64 * xv as f64;
                                        }
                                    }
                                }
                                let have = got[(((n * c.cout + co) * rows + r) * lout + t) * inner + i] as f64;
                                worst = worst.max((have - want).abs());
                            }
                        }
                    }
                }
            }
            assert!(worst < 1e-5, "{c:?}: worst error {worst:e}");
        }
    }
}
