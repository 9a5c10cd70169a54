//! One layer of DConv ([`crate::dconv`]) on host memory, in chunks that stay in cache:
//! `x += scale · GLU(GroupNorm(Conv1x1(GELU(GroupNorm(Conv3(x))))))`.
//!
//! Run op by op, the layer writes and reads its `2·C`-channel intermediate (twice the
//! size of `x`) four times for a few FLOPs per value, and every GroupNorm, GELU and GLU
//! is a pass of its own over memory. Here the layer runs in three sweeps over column
//! chunks of each normalisation set (one frequency row `(n, f)` of `[N, C, F, T]`, or
//! one item of `[N, C, T]`):
//!
//! 1. the dilated `k = 3` convolution into the hidden layer (`C/8` channels, kept whole,
//!    one gemm per tap reading `x` in place), with each chunk's moments;
//! 2. GroupNorm and GELU on the hidden chunk, the `1×1` convolution into a per-thread
//!    scratch chunk `[2C, tc]`, and that chunk's moments;
//! 3. the same `1×1` convolution again (cheaper than storing the whole result), then
//!    GroupNorm, GLU, LayerScale and the residual add straight into `x`.
//!
//! Moments are summed per row in `f32` lanes around the row's own mean, then merged in
//! `f64` (Chan et al.'s pairwise update), in a fixed order: the result does not depend
//! on the number of threads.

use rayon::prelude::*;

use super::math::{erf, exp};
use super::simd::LANES;
use super::{elements, expect_len, nonzero, or_panic, with_scratch, Rows, ShapeError};

const K: &str = "dconv";

/// About how many values of the `1×1` convolution's result `[2C, tc]` one chunk holds
/// (256 KiB: it stays in the core's L2 cache with the hidden chunk beside it).
const CHUNK_VALUES: usize = 65_536;

/// The shape of one DConv layer over `x` `[N, C, R, T]` (`R = 1` for `[N, C, T]`; the
/// frequency branch's `R = F` rows are PyTorch's `[N·F, C, T]`). The first convolution
/// has kernel 3 with `padding = dilation`, so `T` is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DConvShape {
    /// Batch N.
    pub batch: usize,
    /// Channels C.
    pub channels: usize,
    /// Hidden channels (`C / compress`).
    pub hidden: usize,
    /// Rows R, each its own normalisation set.
    pub rows: usize,
    /// Length T.
    pub len: usize,
    /// Dilation of the first convolution (and its padding).
    pub dilation: usize,
}

/// One DConv layer's parameters, as PyTorch stores them.
#[derive(Debug, Clone, Copy)]
pub struct DConvWeights<'a> {
    /// `Conv1d(C → hidden, 3)` weight `[hidden, C, 3]`.
    pub conv1: &'a [f32],
    /// Its bias `[hidden]`.
    pub conv1_bias: &'a [f32],
    /// `GroupNorm(1, hidden)` weight and bias.
    pub norm1: (&'a [f32], &'a [f32]),
    /// `Conv1d(hidden → 2C, 1)` weight `[2C, hidden, 1]`.
    pub conv2: &'a [f32],
    /// Its bias `[2C]`.
    pub conv2_bias: &'a [f32],
    /// `GroupNorm(1, 2C)` weight and bias.
    pub norm2: (&'a [f32], &'a [f32]),
    /// LayerScale `[C]`.
    pub scale: &'a [f32],
}

/// Sizes derived from a [`DConvShape`] in checked arithmetic.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Columns per chunk.
    chunk: usize,
    /// Chunks per set.
    chunks: usize,
    /// Normalisation sets, `N · R`.
    sets: usize,
    /// Length of `x`.
    x: usize,
}

impl DConvShape {
    /// Checks the shape (every size at least 1, no buffer too large).
    pub fn check(&self) -> Result<(), ShapeError> {
        self.plan().map(|_| ())
    }

    fn plan(&self) -> Result<Plan, ShapeError> {
        let DConvShape { batch, channels, hidden, rows, len, dilation } = *self;
        nonzero(
            K,
            &[
                ("batch", batch),
                ("channels", channels),
                ("hidden", hidden),
                ("rows", rows),
                ("len", len),
                ("dilation", dilation),
            ],
        )?;
        let c2 = elements(K, "the 1×1 result", &[channels, 2])?;
        // A whole set when its 1×1 result fits in four chunks' room (the frequency rows),
        // else columns in multiples of the vector width.
        let chunk = if c2.saturating_mul(len) <= 4 * CHUNK_VALUES {
            len
        } else {
            (CHUNK_VALUES / c2 / LANES * LANES).max(LANES).min(len)
        };
        let chunks = len.div_ceil(chunk);
        let sets = elements(K, "the input", &[batch, rows])?;
        elements(K, "the hidden layer", &[sets, chunks, hidden, chunk])?;
        elements(K, "the 1×1 result", &[c2, chunk])?;
        let padded = dilation.checked_mul(2).and_then(|p| p.checked_add(chunk));
        elements(
            K,
            "the padded input chunk",
            &[channels, padded.ok_or(ShapeError::Overflow { kernel: K, what: "the padded input chunk" })?],
        )?;
        Ok(Plan { chunk, chunks, sets, x: elements(K, "the input", &[batch, channels, rows, len])? })
    }
}

/// Count, mean and sum of squared deviations of a set of values.
#[derive(Debug, Clone, Copy, Default)]
struct Moments {
    n: f64,
    mean: f64,
    m2: f64,
}

impl Moments {
    /// The moments of `row`: its sum in `f32` lanes, then the squared deviations from
    /// that mean (corrected for the mean's rounding to `f32`).
    fn of(row: &[f32]) -> Moments {
        let n = row.len() as f64;
        let mean = sum_lanes(row) as f64 / n;
        let center = mean as f32;
        let dev = mean - center as f64;
        let m2 = (sum_sq_dev_lanes(row, center) as f64 - n * dev * dev).max(0.0);
        Moments { n, mean, m2 }
    }

    /// The moments of both sets together.
    fn merge(self, o: Moments) -> Moments {
        if o.n == 0.0 {
            return self;
        }
        if self.n == 0.0 {
            return o;
        }
        let n = self.n + o.n;
        let d = o.mean - self.mean;
        Moments { n, mean: self.mean + d * o.n / n, m2: self.m2 + o.m2 + d * d * self.n * o.n / n }
    }

    /// `(mean, 1 / √(var + 1e-5))` with the biased variance, as `nn.GroupNorm`.
    fn norm(self) -> (f32, f32) {
        (self.mean as f32, (1.0 / (self.m2 / self.n + 1e-5).sqrt()) as f32)
    }
}

/// The moments of rows `0 .. rows` (`width` values each, row stride `stride`) of `buf`.
fn moments(buf: &[f32], rows: usize, stride: usize, width: usize) -> Moments {
    (0..rows).map(|r| Moments::of(&buf[r * stride..][..width])).fold(Moments::default(), Moments::merge)
}

/// `(α, δ)` with `(v − mean) · inv · w + b = v · α + δ`.
fn affine((mean, inv): (f32, f32), w: f32, b: f32) -> (f32, f32) {
    let a = inv * w;
    (a, b - mean * a)
}

/// `x` `[N, C, R, T]` through one DConv layer, in place (see the module's text).
///
/// # Panics
///
/// When [`DConvShape::check`] refuses the shape or a slice's length does not match it,
/// with a [`ShapeError`] message, before any memory is read.
pub fn dconv_layer_in_place(x: &mut [f32], w: &DConvWeights<'_>, s: DConvShape) {
    let DConvShape { channels: c, hidden: h, rows, len, dilation: d, .. } = s;
    let p = or_panic(s.plan().and_then(|p| {
        expect_len(K, "the input", x.len(), p.x)?;
        for (what, got, want) in [
            ("the first convolution's weights", w.conv1.len(), h * c * 3),
            ("the first convolution's bias", w.conv1_bias.len(), h),
            ("the first norm's weight", w.norm1.0.len(), h),
            ("the first norm's bias", w.norm1.1.len(), h),
            ("the 1×1 convolution's weights", w.conv2.len(), 2 * c * h),
            ("the 1×1 convolution's bias", w.conv2_bias.len(), 2 * c),
            ("the second norm's weight", w.norm2.0.len(), 2 * c),
            ("the second norm's bias", w.norm2.1.len(), 2 * c),
            ("the layer scale", w.scale.len(), c),
        ] {
            expect_len(K, what, got, want)?;
        }
        Ok(p)
    }));
    let Plan { chunk: tc, chunks, sets, .. } = p;
    // The first convolution's taps as [3, hidden, C] matrices.
    let mut w1 = vec![0f32; 3 * h * c];
    for (i, v) in w.conv1.iter().enumerate() {
        let (hc, k) = (i / 3, i % 3);
        w1[k * h * c + hc] = *v;
    }
    // Where chunk i starts in `x` (channel 0 of its set, and its first column), and its
    // width.
    let at = |i: usize| {
        let (set, j) = (i / chunks, i % chunks);
        let (n, r) = (set / rows, set % rows);
        let t0 = j * tc;
        (n * c * rows * len + r * len, t0, tc.min(len - t0))
    };
    let xr = Rows(x.as_mut_ptr());
    // The dilated convolution of chunk i into `y` [hidden, tc], and its moments: the
    // chunk's columns t0 − d .. t0 + width + d are copied with zeros outside 0 .. len
    // (one copy, where gemm would pack the shifted columns of each tap), then each tap
    // is one gemm on them.
    let conv3 = |y: &mut [f32], i: usize| -> Moments {
        let (base, t0, width) = at(i);
        let wp = width + 2 * d;
        with_scratch(c * wp, |xp| {
            let (from, to) = (t0.saturating_sub(d), (t0 + width + d).min(len));
            let lead = from + d - t0;
            for (ch, dst) in xp.chunks_exact_mut(wp).enumerate() {
                // SAFETY: columns from .. to (≤ len) of channel row ch of this set, within
                // x. No task writes x while this one runs (in the sweep that writes it,
                // a task reads only its own set's whole row, before it writes it).
                let src = unsafe { xr.get(base + ch * rows * len + from, to - from) };
                dst[..lead].fill(0.0);
                dst[lead..lead + src.len()].copy_from_slice(src);
                dst[lead + src.len()..].fill(0.0);
            }
            for (row, &b) in y.chunks_exact_mut(tc).zip(w.conv1_bias) {
                row[..width].fill(b);
            }
            for k in 0..3 {
                let lhs = &w1[k * h * c..][..h * c];
                let rhs = &xp[k * d..];
                // SAFETY: gemm writes y as h × width with row stride tc: the last element
                // is at (h − 1)·tc + width − 1 < h·tc ≤ y.len(). It reads lhs as h × c,
                // row stride c: exactly `lhs`; rhs as c × width, row stride wp: the last
                // element is at k·d + (c − 1)·wp + width − 1 < c·wp = xp.len(), within
                // `rhs` (which starts at k·d). `plan` checked these sizes fit in memory;
                // y, w1 and xp are distinct buffers.
                unsafe {
                    super::gemm_rows(
                        gemm::Parallelism::None,
                        h,
                        width,
                        c,
                        y.as_mut_ptr(),
                        tc,
                        true,
                        lhs.as_ptr(),
                        c,
                        rhs.as_ptr(),
                        wp,
                    );
                }
            }
        });
        moments(y, h, tc, width)
    };
    // GroupNorm then GELU on the hidden chunk i.
    let norm_gelu = |y: &mut [f32], i: usize, stats: (f32, f32)| {
        let (_, _, width) = at(i);
        for (hi, row) in y.chunks_exact_mut(tc).enumerate() {
            let (a, b) = affine(stats, w.norm1.0[hi], w.norm1.1[hi]);
            affine_gelu(&mut row[..width], a, b);
        }
    };
    // GroupNorm, GLU, LayerScale and the residual from the 1×1 result `z` [2C, width]
    // of chunk i into x.
    let residual = |z: &[f32], i: usize, stats: (f32, f32)| {
        let (base, t0, width) = at(i);
        for ch in 0..c {
            let (aa, ad) = affine(stats, w.norm2.0[ch], w.norm2.1[ch]);
            let (ba, bd) = affine(stats, w.norm2.0[c + ch], w.norm2.1[c + ch]);
            // SAFETY: row ch of this chunk, x[base + ch·rows·len + t0 ..][..width], lies
            // within x (t0 + width ≤ len), and no other task reads or writes it while
            // this one runs: each task owns its set's columns t0 .. t0 + width, its rows
            // are distinct channels, and the copy this task read of them has ended.
            let dst = unsafe { xr.row(base + ch * rows * len + t0, width) };
            glu_affine_add(
                dst,
                &z[ch * width..][..width],
                &z[(c + ch) * width..][..width],
                [aa, ad, ba, bd, w.scale[ch]],
            );
        }
    };
    let mut y1 = vec![0f32; sets * chunks * h * tc];
    if chunks == 1 {
        // A set is one chunk: the whole layer in one sweep, each set on its own.
        y1.par_chunks_mut(h * tc).enumerate().for_each(|(i, y)| {
            let stats = conv3(y, i).norm();
            norm_gelu(y, i, stats);
            let (_, _, width) = at(i);
            with_scratch(2 * c * width, |z| {
                conv1x1(z, y, w, (c, h, tc, width));
                residual(z, i, moments(z, 2 * c, width, width).norm());
            });
        });
        return;
    }
    let per_set = |m: Vec<Moments>| -> Vec<(f32, f32)> {
        m.chunks_exact(chunks).map(|s| s.iter().copied().fold(Moments::default(), Moments::merge).norm()).collect()
    };
    // 1. The dilated convolution into the hidden layer [sets, chunks, hidden, tc].
    let m1: Vec<Moments> = y1.par_chunks_mut(h * tc).enumerate().map(|(i, y)| conv3(y, i)).collect();
    let norm1 = per_set(m1);
    // 2. GroupNorm and GELU on the hidden layer, and the moments of the 1×1 result.
    let m2: Vec<Moments> = y1
        .par_chunks_mut(h * tc)
        .enumerate()
        .map(|(i, y)| {
            norm_gelu(y, i, norm1[i / chunks]);
            let (_, _, width) = at(i);
            with_scratch(2 * c * width, |z| {
                conv1x1(z, y, w, (c, h, tc, width));
                moments(z, 2 * c, width, width)
            })
        })
        .collect();
    let norm2 = per_set(m2);
    // 3. The 1×1 convolution again (cheaper than keeping its result), then the rest.
    y1.par_chunks(h * tc).enumerate().for_each(|(i, y)| {
        let (_, _, width) = at(i);
        with_scratch(2 * c * width, |z| {
            conv1x1(z, y, w, (c, h, tc, width));
            residual(z, i, norm2[i / chunks]);
        });
    });
}

/// `z` `[2C, width]` = `conv2 · y[.., ..width] + bias` for the hidden chunk `y`
/// `[hidden, tc]`.
fn conv1x1(z: &mut [f32], y: &[f32], w: &DConvWeights<'_>, (c, h, tc, width): (usize, usize, usize, usize)) {
    assert!(z.len() >= 2 * c * width && y.len() >= h * tc && width <= tc, "dconv: chunk sizes");
    for (row, &b) in z.chunks_exact_mut(width).zip(w.conv2_bias) {
        row.fill(b);
    }
    // SAFETY: gemm writes z as 2c × width, row stride width: within `z` (checked above).
    // It reads conv2 as 2c × h, row stride h: exactly `w.conv2` (its length was checked
    // by the caller); y as h × width, row stride tc: the last element is at
    // (h − 1)·tc + width − 1 < h·tc ≤ y.len(). The three are distinct buffers.
    unsafe {
        super::gemm_rows(
            gemm::Parallelism::None,
            2 * c,
            width,
            h,
            z.as_mut_ptr(),
            width,
            true,
            w.conv2.as_ptr(),
            h,
            y.as_ptr(),
            tc,
        );
    }
}

/// `Σ x` in `f32` lanes.
fn sum_lanes(x: &[f32]) -> f32 {
    dispatch!(sum_lanes_impl(x))
}

/// `Σ (x − center)²` in `f32` lanes.
fn sum_sq_dev_lanes(x: &[f32], center: f32) -> f32 {
    dispatch!(sum_sq_dev_lanes_impl(x, center))
}

/// `x = gelu(x · a + b)`, in place.
fn affine_gelu(x: &mut [f32], a: f32, b: f32) {
    dispatch!(affine_gelu_impl(x, a, b))
}

/// `out += s · (a · αa + δa) · σ(b · αb + δb)` with `k = [αa, δa, αb, δb, s]`.
pub(super) fn glu_affine_add(out: &mut [f32], a: &[f32], b: &[f32], k: [f32; 5]) {
    dispatch!(glu_affine_add_impl(out, a, b, k))
}

#[inline(always)]
pub(super) fn sum_lanes_impl(x: &[f32]) -> f32 {
    let mut acc = [0f32; 2 * LANES];
    let mut chunks = x.chunks_exact(2 * LANES);
    for ch in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

#[inline(always)]
pub(super) fn sum_sq_dev_lanes_impl(x: &[f32], center: f32) -> f32 {
    let mut acc = [0f32; 2 * LANES];
    let mut chunks = x.chunks_exact(2 * LANES);
    for ch in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(ch) {
            let d = v - center;
            *a = d.mul_add(d, *a);
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().map(|&v| (v - center) * (v - center)).sum::<f32>()
}

#[inline(always)]
pub(super) fn affine_gelu_impl(x: &mut [f32], a: f32, b: f32) {
    for v in x.iter_mut() {
        let u = v.mul_add(a, b);
        *v = 0.5 * u * (1.0 + erf(u * std::f32::consts::FRAC_1_SQRT_2));
    }
}

#[inline(always)]
pub(super) fn glu_affine_add_impl(out: &mut [f32], a: &[f32], b: &[f32], k: [f32; 5]) {
    let [aa, ad, ba, bd, s] = k;
    for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
        let (a, b) = (a.mul_add(aa, ad), b.mul_add(ba, bd));
        // σ(b) = 1 / (1 + e^-b), as PyTorch's float sigmoid
        *o += s * (a / (1.0 + exp(-b)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::math::tests::libm_erf;

    /// The layer op by op in f64, as PyTorch defines it.
    fn reference(x: &[f32], w: &DConvWeights<'_>, s: DConvShape) -> Vec<f64> {
        let DConvShape { batch, channels: c, hidden: h, rows, len, dilation: d } = s;
        let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let norm = |y: &mut [Vec<f64>], g: &[f32], b: &[f32]| {
            let n = (y.len() * len) as f64;
            let mean = y.iter().flatten().sum::<f64>() / n;
            let var = y.iter().flatten().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
            for (ch, row) in y.iter_mut().enumerate() {
                row.iter_mut().for_each(|v| *v = (*v - mean) / (var + 1e-5).sqrt() * g[ch] as f64 + b[ch] as f64);
            }
        };
        for n in 0..batch {
            for r in 0..rows {
                let xr = |ch: usize, t: isize| -> f64 {
                    if t < 0 || t >= len as isize {
                        0.0
                    } else {
                        x[((n * c + ch) * rows + r) * len + t as usize] as f64
                    }
                };
                let mut y1: Vec<Vec<f64>> = (0..h)
                    .map(|o| {
                        (0..len as isize)
                            .map(|t| {
                                w.conv1_bias[o] as f64
                                    + (0..c)
                                        .flat_map(|ch| (0..3).map(move |k| (ch, k)))
                                        .map(|(ch, k)| {
                                            w.conv1[(o * c + ch) * 3 + k] as f64
                                                * xr(ch, t + (k as isize - 1) * d as isize)
                                        })
                                        .sum::<f64>()
                            })
                            .collect()
                    })
                    .collect();
                norm(&mut y1, w.norm1.0, w.norm1.1);
                y1.iter_mut().flatten().for_each(|v| *v = 0.5 * *v * (1.0 + libm_erf(*v / 2f64.sqrt())));
                let mut y2: Vec<Vec<f64>> = (0..2 * c)
                    .map(|o| {
                        (0..len)
                            .map(|t| {
                                w.conv2_bias[o] as f64
                                    + (0..h).map(|i| w.conv2[o * h + i] as f64 * y1[i][t]).sum::<f64>()
                            })
                            .collect()
                    })
                    .collect();
                norm(&mut y2, w.norm2.0, w.norm2.1);
                for ch in 0..c {
                    for t in 0..len {
                        let (a, b) = (y2[ch][t], y2[c + ch][t]);
                        out[((n * c + ch) * rows + r) * len + t] += w.scale[ch] as f64 * a / (1.0 + (-b).exp());
                    }
                }
            }
        }
        out
    }

    fn fill(n: usize, seed: usize, scale: f32, offset: f32) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 + seed * 104_729) % 1013) as f32 / 1013.0 * scale + offset).collect()
    }

    #[test]
    fn dconv_layer_matches_the_definition() {
        // Rows and items, dilations 1 and 2 (and one wider than a short row), one sweep
        // (a set in one chunk) and three (C = 600 over 300 columns: chunks of 48, the
        // last one 12 wide), offsets that make f32 sums of raw values lose digits.
        for s in [
            DConvShape { batch: 2, channels: 8, hidden: 3, rows: 3, len: 37, dilation: 1 },
            DConvShape { batch: 1, channels: 8, hidden: 2, rows: 2, len: 5, dilation: 8 },
            DConvShape { batch: 2, channels: 600, hidden: 4, rows: 1, len: 300, dilation: 2 },
            DConvShape { batch: 1, channels: 600, hidden: 4, rows: 2, len: 100, dilation: 2 },
            DConvShape { batch: 1, channels: 6, hidden: 3, rows: 1, len: 1, dilation: 1 },
        ] {
            let (c, h) = (s.channels, s.hidden);
            let x0 = fill(s.batch * c * s.rows * s.len, 1, 4.0, 30.0);
            let (w1, b1) = (fill(h * c * 3, 2, 0.2, -0.1), fill(h, 3, 1.0, -0.5));
            let (g1, n1) = (fill(h, 4, 1.0, 0.5), fill(h, 5, 0.4, -0.2));
            let (w2, b2) = (fill(2 * c * h, 6, 1.0, -0.5), fill(2 * c, 7, 1.0, -0.5));
            let (g2, n2) = (fill(2 * c, 8, 1.0, 0.5), fill(2 * c, 9, 0.4, -0.2));
            let scale = fill(c, 10, 0.2, 0.01);
            let w = DConvWeights {
                conv1: &w1,
                conv1_bias: &b1,
                norm1: (&g1, &n1),
                conv2: &w2,
                conv2_bias: &b2,
                norm2: (&g2, &n2),
                scale: &scale,
            };
            let chunks = s.plan().expect("a valid shape").chunks;
            assert_eq!(chunks > 1, s.len == 300, "{s:?}: {chunks} chunks");
            let want = reference(&x0, &w, s);
            let mut x = x0.clone();
            dconv_layer_in_place(&mut x, &w, s);
            let worst = x.iter().zip(&want).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0, f64::max);
            assert!(worst < 2e-5, "{s:?}: worst error {worst:e}");
            // The layer did something: the residual moved x.
            let moved = x.iter().zip(&x0).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(moved > 1e-3, "{s:?}: the layer left x as it was");
        }
    }

    #[test]
    fn moments_merge_to_the_whole_sets() {
        let x = fill(1000, 3, 2.0, 1000.0);
        let whole = Moments::of(&x);
        let parts = x.chunks(77).map(Moments::of).fold(Moments::default(), Moments::merge);
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / 1000.0;
        let m2 = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>();
        for m in [whole, parts] {
            assert!((m.mean - mean).abs() < 1e-4 && (m.m2 / m2 - 1.0).abs() < 1e-4, "{m:?} vs {mean} {m2}");
        }
    }

    #[test]
    fn dconv_layer_refuses_bad_shapes() {
        let s = DConvShape { batch: 1, channels: 2, hidden: 1, rows: 1, len: 4, dilation: 1 };
        assert_eq!(DConvShape { hidden: 0, ..s }.check(), Err(ShapeError::Zero { kernel: K, field: "hidden" }));
        let w = DConvWeights {
            conv1: &[0.0; 6],
            conv1_bias: &[0.0],
            norm1: (&[1.0], &[0.0]),
            conv2: &[0.0; 4],
            conv2_bias: &[0.0; 4],
            norm2: (&[1.0; 4], &[0.0; 4]),
            scale: &[0.0; 1],
        };
        let r = std::panic::catch_unwind(|| dconv_layer_in_place(&mut [0.0; 8], &w, s));
        let msg = r.expect_err("a short layer scale").downcast::<String>().expect("a message");
        assert_eq!(*msg, "dconv: the layer scale: 1 values where the shape says 2");
    }
}
