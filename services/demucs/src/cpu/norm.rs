//! `nn.GroupNorm` and `nn.LayerNorm` on host memory, with their statistics summed in f64.

use rayon::prelude::*;

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

/// `GroupNorm(1, C, eps=1e-5)` in place on `x` laid out channels last, `[N, T, C]`: what
/// the transformer's `norm_out` computes on `[N, C, T]`, without the two transposes.
/// One normalisation set per item over its `T · C` values (f64 sums, two passes), then
/// each channel's `weight` and `bias`.
pub fn group_norm_channels_last_in_place(x: &mut [f32], weight: &[f32], bias: &[f32], n: usize, c: usize) {
    assert!(n > 0 && c > 0 && weight.len() == c && bias.len() == c, "group norm: channels");
    assert_eq!(x.len() % (n * c), 0, "group norm: shape");
    let per_item = x.len() / n;
    // Statistics per item in blocks of rows, summed in f64.
    let block = (65_536 / c).max(1) * c;
    for item in x.chunks_exact_mut(per_item) {
        let count = per_item as f64;
        let xs: &[f32] = item;
        let mean = xs.par_chunks(block).map(|b| sum_f64(b, 0.0, false)).sum::<f64>() / count;
        let var = xs.par_chunks(block).map(|b| sum_f64(b, mean, true)).sum::<f64>() / count;
        let (mean, inv) = (mean as f32, (1.0 / (var + 1e-5).sqrt()) as f32);
        item.par_chunks_mut(block).for_each(|rows| {
            for row in rows.chunks_exact_mut(c) {
                for ((v, &w), &b) in row.iter_mut().zip(weight).zip(bias) {
                    *v = (*v - mean) * (inv * w) + b;
                }
            }
        });
    }
}

/// `LayerNorm(C, eps=1e-5)` in place on `x` laid out `[rows, C]`: each row normalised
/// over its `C` values (two passes, f64 sums), then scaled by `weight` and shifted by
/// `bias`, in one pass over the row instead of the eight tensor ops it takes in Burn.
pub fn layer_norm_in_place(x: &mut [f32], weight: &[f32], bias: &[f32], c: usize) {
    assert!(c > 0 && weight.len() == c && bias.len() == c, "layer norm: channels");
    assert_eq!(x.len() % c, 0, "layer norm: shape");
    // Rows in blocks of about 64 k values per task.
    let block = (65_536 / c).max(1) * c;
    x.par_chunks_mut(block).for_each(|rows| {
        for row in rows.chunks_exact_mut(c) {
            let mean = sum_f64(row, 0.0, false) / c as f64;
            let var = sum_f64(row, mean, true) / c as f64;
            let (mean, inv) = (mean as f32, (1.0 / (var + 1e-5).sqrt()) as f32);
            for ((v, &w), &b) in row.iter_mut().zip(weight).zip(bias) {
                *v = (*v - mean) * inv * w + b;
            }
        }
    });
}

/// `Σ (x - center)`, or `Σ (x - center)²` with `square`, in f64 lanes (compiled for
/// the widest vector unit the CPU has).
fn sum_f64(x: &[f32], center: f64, square: bool) -> f64 {
    if square {
        dispatch!(sum_sq_f64_impl(x, center))
    } else {
        dispatch!(sum_centered_f64_impl(x, center))
    }
}

/// `Σ (x − center)²`, the portable build.
#[inline(always)]
pub(super) fn sum_sq_f64_impl(x: &[f32], center: f64) -> f64 {
    sum_f64_lanes::<true>(x, center)
}

/// `Σ (x − center)`, the portable build.
#[inline(always)]
pub(super) fn sum_centered_f64_impl(x: &[f32], center: f64) -> f64 {
    sum_f64_lanes::<false>(x, center)
}

/// The loop of [`sum_f64`], inlined into each build of it.
#[inline(always)]
fn sum_f64_lanes<const SQUARE: bool>(x: &[f32], center: f64) -> f64 {
    let square = SQUARE;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_norm_matches_the_definition() {
        let (rows, c) = (70, 48);
        let x0: Vec<f32> = (0..rows * c).map(|i| ((i * 7919 % 1013) as f32) / 100.0 - 4.0).collect();
        let w: Vec<f32> = (0..c).map(|i| 0.5 + i as f32 * 0.1).collect();
        let b: Vec<f32> = (0..c).map(|i| i as f32 * 0.05 - 1.0).collect();
        let mut x = x0.clone();
        layer_norm_in_place(&mut x, &w, &b, c);
        let mut worst = 0f64;
        for r in 0..rows {
            let vals = &x0[r * c..][..c];
            let mean = vals.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            let var = vals.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c as f64;
            for i in 0..c {
                let want = (vals[i] as f64 - mean) / (var + 1e-5).sqrt() * w[i] as f64 + b[i] as f64;
                worst = worst.max((x[r * c + i] as f64 - want).abs());
            }
        }
        assert!(worst < 1e-5, "worst error {worst:e}");
    }

    #[test]
    fn channels_last_group_norm_is_the_transposed_channels_first_one() {
        // [N, T, C] against group_norm_in_place on the transpose [N, C, 1, T]; T spans
        // several of the kernel's row blocks (65 536 / C rows each).
        let (n, t, c) = (2, 3000, 48);
        let x0: Vec<f32> = (0..n * t * c).map(|i| ((i * 7919 % 1013) as f32) / 100.0 + 3.0).collect();
        let w: Vec<f32> = (0..c).map(|i| 0.5 + i as f32 * 0.1).collect();
        let b: Vec<f32> = (0..c).map(|i| i as f32 * 0.05 - 1.0).collect();
        let mut last = x0.clone();
        group_norm_channels_last_in_place(&mut last, &w, &b, n, c);
        let mut first: Vec<f32> = vec![0.0; x0.len()];
        for ni in 0..n {
            for ti in 0..t {
                for ch in 0..c {
                    first[(ni * c + ch) * t + ti] = x0[(ni * t + ti) * c + ch];
                }
            }
        }
        group_norm_in_place(&mut first, &w, &b, [n, c, 1, t], 1);
        let mut worst = 0f32;
        for ni in 0..n {
            for ti in 0..t {
                for ch in 0..c {
                    worst = worst.max((last[(ni * t + ti) * c + ch] - first[(ni * c + ch) * t + ti]).abs());
                }
            }
        }
        assert!(worst < 1e-6, "worst difference {worst:e}");
        // And the items are normalised separately: the second one's values moved by a
        // constant give the same output.
        let mut shifted = x0.clone();
        shifted[t * c..].iter_mut().for_each(|v| *v += 100.0);
        group_norm_channels_last_in_place(&mut shifted, &w, &b, n, c);
        let moved = shifted.iter().zip(&last).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(moved < 1e-4, "a per-item shift changed the output by {moved:e}");
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
}
