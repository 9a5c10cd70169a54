//! Transposed convolution along one axis on host memory, without col2im: the output is
//! split by phase (`p mod stride`), and each phase is a plain stride-1 correlation of
//! the input with its `⌈k / s⌉` taps, one gemm per tap into that phase's rows. Serves
//! the decoders' `nn.ConvTranspose1d` and their `[k, 1]` `nn.ConvTranspose2d`.

use rayon::prelude::*;

use super::{elements, expect_conv_lens, nonzero, or_panic, ShapeError};

/// A transposed convolution (no padding, no dilation) along `L` of `x` laid out
/// `[N, Cin, L, I]`: `ConvTranspose1d` is `I = 1`, a `[k, 1]` `ConvTranspose2d` over
/// `[N, C, H, W]` is `L = H, I = W`. The output is `[N, Cout, (L − 1)·stride + kernel, I]`.
#[derive(Debug, Clone, Copy)]
pub struct ConvTransposeAxis {
    /// Batch N.
    pub batch: usize,
    /// Input channels.
    pub cin: usize,
    /// Output channels.
    pub cout: usize,
    /// Length L of the axis.
    pub len: usize,
    /// Inner columns I.
    pub inner: usize,
    /// Kernel size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
}

/// The sizes [`conv_transpose_axis`] works with, in checked arithmetic.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Output length, `(len − 1)·stride + kernel`.
    lout: usize,
    /// Taps of the phase with the most, `⌈kernel / stride⌉`.
    taps: usize,
    /// Rows of the zero-padded input, `len + 2·(taps − 1)`.
    lp: usize,
    /// Lengths of the input and the weights.
    x: usize,
    w: usize,
    /// Length of the padded input and of the phases' gemm results.
    xp: usize,
    y: usize,
}

impl ConvTransposeAxis {
    /// Checks the shape and returns the output length.
    pub fn check(&self) -> Result<usize, ShapeError> {
        self.plan().map(|p| p.lout)
    }

    /// Output length along `L`.
    ///
    /// # Panics
    ///
    /// When [`ConvTransposeAxis::check`] refuses the shape.
    pub fn out_len(&self) -> usize {
        or_panic(self.check())
    }

    fn plan(&self) -> Result<Plan, ShapeError> {
        const K: &str = "conv_transpose_axis";
        let ConvTransposeAxis { batch, cin, cout, len, inner, kernel, stride } = *self;
        nonzero(
            K,
            &[
                ("batch", batch),
                ("cin", cin),
                ("cout", cout),
                ("len", len),
                ("inner", inner),
                ("kernel", kernel),
                ("stride", stride),
            ],
        )?;
        let overflow = |what| ShapeError::Overflow { kernel: K, what };
        let lout = (len - 1).checked_mul(stride).and_then(|l| l.checked_add(kernel)).ok_or(overflow("the output"))?;
        let taps = kernel.div_ceil(stride);
        let lp = (taps - 1).checked_mul(2).and_then(|p| p.checked_add(len)).ok_or(overflow("the padded input"))?;
        // The whole output fits in memory, so any crop of it does.
        elements(K, "the output", &[batch, cout, lout, inner])?;
        Ok(Plan {
            lout,
            taps,
            lp,
            x: elements(K, "the input", &[batch, cin, len, inner])?,
            w: elements(K, "the weights", &[cin, cout, kernel])?,
            xp: elements(K, "the padded input", &[cin, lp, inner])?,
            y: elements(K, "the phase results", &[cout, lout, inner])?,
        })
    }
}

/// The transposed convolution of [`ConvTransposeAxis`]: output row `p = q·s + ph` gets
/// `Σ_m W[·, ·, ph + m·s]ᵀ · x[q − m]`, so each phase `ph` is a correlation of the
/// input (padded with `taps − 1` zero rows at both ends) with its taps, one gemm per tap
/// accumulated into the phase's rows, which are then written into every `s`-th output
/// row with the bias. `w` `[Cin, Cout, K]` (PyTorch's layout), `bias` `[Cout]`.
///
/// # Panics
///
/// When [`ConvTransposeAxis::check`] refuses the shape or a slice's length does not
/// match it, with a [`ShapeError`] message, before any memory is read.
pub fn conv_transpose_axis(x: &[f32], w: &[f32], bias: &[f32], c: ConvTransposeAxis) -> Vec<f32> {
    let lout = or_panic(c.check());
    conv_transpose_axis_crop(x, w, bias, c, (0, lout), false)
}

/// [`conv_transpose_axis`] keeping only output rows `keep.0 .. keep.0 + keep.1` along
/// `L`, through the exact GELU with `gelu`: the decoders' crop and activation, written
/// as each channel's rows are assembled (no full-size output, no pass of their own).
/// → `[N, Cout, keep.1, I]`.
///
/// # Panics
///
/// When [`ConvTransposeAxis::check`] refuses the shape, the rows kept run past the
/// output, or a slice's length does not match the shape, with a [`ShapeError`] message,
/// before any memory is read.
pub fn conv_transpose_axis_crop(
    x: &[f32],
    w: &[f32],
    bias: &[f32],
    c: ConvTransposeAxis,
    keep: (usize, usize),
    gelu: bool,
) -> Vec<f32> {
    const K: &str = "conv_transpose_axis";
    let p = or_panic(c.plan().and_then(|p| {
        expect_conv_lens(K, (x, w, bias), [p.x, p.w, c.cout])?;
        if keep.0.checked_add(keep.1).is_none_or(|end| end > p.lout) {
            return Err(ShapeError::Crop { kernel: K, start: keep.0, len: keep.1, out: p.lout });
        }
        Ok(p)
    }));
    let ConvTransposeAxis { batch, cin, cout, len, inner, kernel, stride: s } = c;
    let Plan { lout, taps, lp, .. } = p;
    let pad = taps - 1;
    // Per-tap weights [Cout, Cin], tap index kk = ph + m·s.
    let mut wt = vec![0f32; cout * cin * kernel];
    for kk in 0..kernel {
        for ci in 0..cin {
            for co in 0..cout {
                wt[(kk * cout + co) * cin + ci] = w[(ci * cout + co) * kernel + kk];
            }
        }
    }
    // Each phase's rows and taps, and where its gemm result starts in `y`.
    let phases: Vec<(usize, usize, usize)> = (0..s)
        .scan(0, |at, ph| {
            let rows = (lout - ph).div_ceil(s);
            let start = *at;
            *at += cout * rows * inner;
            Some((rows, (kernel - ph.min(kernel)).div_ceil(s), start))
        })
        .collect();
    let kept = cout * keep.1 * inner;
    let mut out = vec![0f32; batch * kept];
    if kept == 0 {
        return out;
    }
    let mut xp = vec![0f32; p.xp];
    let mut y = vec![0f32; p.y];
    let row = lp * inner;
    for n in 0..batch {
        xp.par_chunks_mut(row).enumerate().for_each(|(ci, dst)| {
            dst[pad * inner..][..len * inner].copy_from_slice(&x[(n * cin + ci) * len * inner..][..len * inner]);
        });
        for (ph, &(rows, phase_taps, start)) in phases.iter().enumerate() {
            let cols = rows * inner;
            let dst = &mut y[start..][..cout * cols];
            for m in 0..phase_taps {
                let kk = ph + m * s;
                // Safe slicing first: these panic rather than hand gemm a pointer outside.
                let lhs = &wt[kk * cout * cin..][..cout * cin];
                // Row q of the result reads padded row q + pad − m = input row q − m.
                let rhs = &xp[(pad - m) * inner..];
                // SAFETY: gemm writes `dst` as cout x cols, row stride cols: exactly
                // dst.len() values, borrowed mutably here only. It reads lhs as cout x
                // cin, row stride cin: exactly `lhs`. It reads rhs as cin x cols, row
                // stride lp·inner, from (pad − m)·inner: the last element is
                // (pad − m)·inner + (cin − 1)·lp·inner + cols − 1, and cols = rows·inner
                // with rows <= ⌈lout / s⌉ <= len + taps − 1 = lp − pad, so it is below
                // cin·lp·inner = xp.len(), within `rhs`. `plan` checked that every size
                // fits in memory, so no product wrapped and the strides fit in isize.
                // No input overlaps `dst`.
                unsafe {
                    super::gemm_rows(
                        gemm::Parallelism::Rayon(0),
                        cout,
                        cols,
                        cin,
                        dst.as_mut_ptr(),
                        cols,
                        m > 0,
                        lhs.as_ptr(),
                        cin,
                        rhs.as_ptr(),
                        row,
                    );
                }
            }
        }
        // Each channel's kept rows from its phases, plus the bias (a phase with no tap
        // is the bias alone), then the GELU while they are in cache.
        let y = &y[..];
        out[n * kept..][..kept].par_chunks_mut(keep.1 * inner).zip(bias).enumerate().for_each(|(co, (o, &b))| {
            // Phase by phase: kept row r is output row keep.0 + r, phase (keep.0 + r) mod s,
            // row (keep.0 + r) div s of that phase; every s-th kept row from r0.
            for (ph, &(rows, phase_taps, start)) in phases.iter().enumerate() {
                let r0 = (ph + s - keep.0 % s) % s;
                let q0 = (keep.0 + r0) / s;
                for (i, r) in (r0..keep.1).step_by(s).enumerate() {
                    let d = &mut o[r * inner..][..inner];
                    if phase_taps == 0 {
                        d.fill(b);
                    } else {
                        let src = &y[start + (co * rows + q0 + i) * inner..][..inner];
                        d.iter_mut().zip(src).for_each(|(o, v)| *o = v + b);
                    }
                }
            }
            if gelu {
                super::gelu_in_place(o);
            }
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_transpose_axis_matches_the_definition() {
        // (kernel, stride, len, inner): HTDemucs's 8/4, kernels shorter than the
        // stride (phases with no tap), stride 1, and columns.
        for (kernel, stride, len, inner) in
            [(8, 4, 9, 1), (8, 4, 5, 3), (3, 4, 6, 2), (5, 2, 7, 1), (3, 1, 4, 2), (1, 1, 3, 1)]
        {
            let c = ConvTransposeAxis { batch: 2, cin: 3, cout: 4, len, inner, kernel, stride };
            let x: Vec<f32> = (0..2 * 3 * len * inner).map(|i| ((i * 7919 % 997) as f32) / 500.0 - 1.0).collect();
            let w: Vec<f32> = (0..3 * 4 * kernel).map(|i| ((i * 104729 % 611) as f32) / 300.0 - 1.0).collect();
            let b = [0.5f32, -0.25, 1.0, 0.0];
            let got = conv_transpose_axis(&x, &w, &b, c);
            let lout = c.out_len();
            assert_eq!(lout, (len - 1) * stride + kernel);
            let mut want = vec![0f64; 2 * 4 * lout * inner];
            for n in 0..2 {
                for co in 0..4 {
                    for p in 0..lout {
                        for i in 0..inner {
                            want[((n * 4 + co) * lout + p) * inner + i] = b[co] as f64;
                        }
                    }
                    for ci in 0..3 {
                        for l in 0..len {
                            for kk in 0..kernel {
                                for i in 0..inner {
                                    let xv = x[((n * 3 + ci) * len + l) * inner + i] as f64;
                                    want[((n * 4 + co) * lout + l * stride + kk) * inner + i] +=
                                        w[(ci * 4 + co) * kernel + kk] as f64 * xv;
                                }
                            }
                        }
                    }
                }
            }
            let worst = got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).abs()).fold(0f64, f64::max);
            assert!(worst < 1e-5, "{c:?}: worst error {worst:e}");
        }
    }

    #[test]
    fn the_crop_and_gelu_are_those_of_the_whole_output() {
        // Crops at both ends and none, with and without GELU, rows and columns.
        for (len, inner, keep) in [(9, 1, (2, 30)), (5, 3, (0, 24)), (6, 2, (3, 4)), (4, 1, (0, 0))] {
            let c = ConvTransposeAxis { batch: 2, cin: 3, cout: 4, len, inner, kernel: 8, stride: 4 };
            let x: Vec<f32> = (0..2 * 3 * len * inner).map(|i| ((i * 7919 % 997) as f32) / 500.0 - 1.0).collect();
            let w: Vec<f32> = (0..3 * 4 * 8).map(|i| ((i * 104729 % 611) as f32) / 300.0 - 1.0).collect();
            let b = [0.5f32, -0.25, 1.0, 0.0];
            let full = conv_transpose_axis(&x, &w, &b, c);
            let lout = c.out_len();
            for gelu in [false, true] {
                let got = conv_transpose_axis_crop(&x, &w, &b, c, keep, gelu);
                let mut want: Vec<f32> = full
                    .chunks_exact(lout * inner)
                    .flat_map(|ch| ch[keep.0 * inner..(keep.0 + keep.1) * inner].to_vec())
                    .collect();
                if gelu {
                    crate::cpu::gelu_in_place(&mut want);
                }
                assert_eq!(got, want, "len {len}, inner {inner}, keep {keep:?}, gelu {gelu}");
            }
        }
        let c = ConvTransposeAxis { batch: 1, cin: 2, cout: 3, len: 4, inner: 1, kernel: 8, stride: 4 };
        let past =
            std::panic::catch_unwind(|| conv_transpose_axis_crop(&[0.0; 8], &[0.0; 48], &[0.0; 3], c, (5, 16), true));
        let message = stemq_core::engine::panic_message(&*past.unwrap_err()).unwrap();
        assert_eq!(message, "conv_transpose_axis: rows 5 .. 5 + 16 run past the output's 20");
    }

    #[test]
    fn bad_shapes_are_refused_before_any_memory_is_read() {
        let c = ConvTransposeAxis { batch: 1, cin: 2, cout: 3, len: 4, inner: 1, kernel: 8, stride: 4 };
        assert_eq!(c.check(), Ok(20));
        assert_eq!(
            ConvTransposeAxis { stride: 0, ..c }.check(),
            Err(ShapeError::Zero { kernel: "conv_transpose_axis", field: "stride" })
        );
        assert!(matches!(ConvTransposeAxis { len: usize::MAX, ..c }.check(), Err(ShapeError::Overflow { .. })));
        let short = std::panic::catch_unwind(|| conv_transpose_axis(&[0.0; 8], &[0.0; 5], &[0.0; 3], c));
        let message = stemq_core::engine::panic_message(&*short.unwrap_err()).unwrap();
        assert_eq!(message, "conv_transpose_axis: the weights: 5 values where the shape says 48");
    }
}
