//! `glu(conv(x [+ skip]))` along one axis on host memory, in cache-sized chunks: the
//! encoders' `1×1` rewrite and the time decoders' `k = 3` one (`nn.Conv1d(C, 2C, k,
//! padding = k / 2)` then `nn.GLU(dim=1)`; a frequency layer's `[B, C, F, T]` is
//! `[B, C, F·T]` for a `1×1` kernel).
//!
//! Run op by op, the `2C`-channel result is written to memory and read back for the
//! GLU, and the decoders' `x + skip` is a pass of its own. Here each chunk of columns is
//! copied once with the skip added and zeros past the ends (a `1×1` kernel without a
//! skip reads `x` in place), each tap is one gemm into a per-thread `[2C, tc]` scratch,
//! and the GLU writes the chunk's `C` output rows from there.

use rayon::prelude::*;

use super::dconv::glu_affine_add;
use super::simd::LANES;
use super::{elements, expect_len, nonzero, or_panic, with_scratch, Rows, ShapeError};

const K: &str = "conv_glu";

/// About how many values of the convolution's result `[2C, tc]` one chunk holds.
const CHUNK_VALUES: usize = 65_536;

/// `Conv1d(cin → cout, kernel, padding = kernel / 2)` then `GLU(dim=1)` over `x`
/// `[N, cin, L]` → `[N, cout / 2, L]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGlu {
    /// Batch N.
    pub batch: usize,
    /// Input channels.
    pub cin: usize,
    /// Output channels of the convolution (twice the GLU's).
    pub cout: usize,
    /// Length L.
    pub len: usize,
    /// Kernel size, odd.
    pub kernel: usize,
}

/// Sizes derived from a [`ConvGlu`] in checked arithmetic.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Columns per chunk.
    chunk: usize,
    /// Chunks per item.
    chunks: usize,
    /// Length of the input.
    x: usize,
    /// Length of the output.
    out: usize,
    /// Length of the per-tap weights.
    w: usize,
}

impl ConvGlu {
    /// Checks the shape (every size at least 1, an odd kernel, an even `cout`, no buffer
    /// too large).
    pub fn check(&self) -> Result<(), ShapeError> {
        self.plan().map(|_| ())
    }

    fn plan(&self) -> Result<Plan, ShapeError> {
        let ConvGlu { batch, cin, cout, len, kernel } = *self;
        nonzero(K, &[("batch", batch), ("cin", cin), ("cout", cout), ("len", len), ("kernel", kernel)])?;
        if cout % 2 != 0 {
            return Err(ShapeError::OddGlu { kernel: K, channels: cout });
        }
        if kernel % 2 == 0 {
            return Err(ShapeError::EvenKernel { kernel: K, size: kernel });
        }
        let chunk = (CHUNK_VALUES / cout / LANES * LANES).max(LANES).min(len);
        let padded =
            chunk.checked_add(kernel - 1).ok_or(ShapeError::Overflow { kernel: K, what: "the padded chunk" })?;
        elements(K, "the chunk scratch", &[cin, padded])?
            .checked_add(elements(K, "the chunk scratch", &[cout, chunk])?)
            .ok_or(ShapeError::Overflow { kernel: K, what: "the chunk scratch" })?;
        Ok(Plan {
            chunk,
            chunks: len.div_ceil(chunk),
            x: elements(K, "the input", &[batch, cin, len])?,
            out: elements(K, "the output", &[batch, cout / 2, len])?,
            w: elements(K, "the weights", &[cout, cin, kernel])?,
        })
    }
}

/// `glu(conv(x + skip))` of [`ConvGlu`]: `x` and `skip` `[N, cin, L]`, `w` `[cout, cin,
/// kernel]`, `bias` `[cout]` → `[N, cout / 2, L]` (see the module's text).
///
/// # Panics
///
/// When [`ConvGlu::check`] refuses the shape or a slice's length does not match it,
/// with a [`ShapeError`] message, before any memory is read.
pub fn conv_glu(x: &[f32], skip: Option<&[f32]>, w: &[f32], bias: &[f32], c: ConvGlu) -> Vec<f32> {
    let p = or_panic(c.plan().and_then(|p| {
        expect_len(K, "the input", x.len(), p.x)?;
        if let Some(skip) = skip {
            expect_len(K, "the skip input", skip.len(), p.x)?;
        }
        expect_len(K, "the weights", w.len(), p.w)?;
        expect_len(K, "the bias", bias.len(), c.cout)?;
        Ok(p)
    }));
    let ConvGlu { cin, cout, len, kernel: k, .. } = c;
    let Plan { chunk: tc, chunks, .. } = p;
    let (half, planes) = (k / 2, cout / 2);
    // Per-tap weights [k, cout, cin] (a 1×1 kernel's are `w` as it is).
    let wt: std::borrow::Cow<'_, [f32]> = if k == 1 {
        w.into()
    } else {
        let mut wt = vec![0f32; p.w];
        for (i, v) in w.iter().enumerate() {
            let (oc, tap) = (i / k, i % k);
            wt[tap * cout * cin + oc] = *v;
        }
        wt.into()
    };
    let mut out = vec![0f32; p.out];
    let dst = Rows(out.as_mut_ptr());
    (0..c.batch * chunks).into_par_iter().for_each(|i| {
        let (n, t0) = (i / chunks, i % chunks * tc);
        let width = tc.min(len - t0);
        let xn = &x[n * cin * len..][..cin * len];
        let skip = skip.map(|s| &s[n * cin * len..][..cin * len]);
        let wp = width + k - 1;
        // In place: a 1×1 kernel on x alone reads the chunk's columns where they are.
        let copy = k > 1 || skip.is_some();
        let xp_len = if copy { cin * wp } else { 0 };
        with_scratch(xp_len + cout * width, |scratch| {
            let (xp, z) = scratch.split_at_mut(xp_len);
            if copy {
                // Columns t0 − half .. t0 + width + half, zeros outside 0 .. len.
                let (from, to) = (t0.saturating_sub(half), (t0 + width + half).min(len));
                let lead = from + half - t0;
                for (ci, row) in xp.chunks_exact_mut(wp).enumerate() {
                    let src = &xn[ci * len + from..ci * len + to];
                    row[..lead].fill(0.0);
                    let body = &mut row[lead..lead + src.len()];
                    match skip {
                        Some(s) => {
                            let s = &s[ci * len + from..ci * len + to];
                            body.iter_mut().zip(src).zip(s).for_each(|((d, a), b)| *d = a + b);
                        }
                        None => body.copy_from_slice(src),
                    }
                    row[lead + src.len()..].fill(0.0);
                }
            }
            let (rhs, rhs_rs): (&[f32], usize) = if copy { (xp, wp) } else { (&xn[t0..], len) };
            for (row, &b) in z.chunks_exact_mut(width).zip(bias) {
                row.fill(b);
            }
            for tap in 0..k {
                let lhs = &wt[tap * cout * cin..][..cout * cin];
                let rhs = &rhs[tap..];
                // SAFETY: gemm writes z as cout × width, row stride width: exactly `z`. It
                // reads lhs as cout × cin, row stride cin: exactly `lhs`; rhs as cin ×
                // width with row stride rhs_rs, from `tap` (0 without a copy): the last
                // element is at tap + (cin − 1)·rhs_rs + width − 1, below cin·wp =
                // xp.len() for the copy (tap + width ≤ wp), and below cin·len − t0 (the
                // length of `&xn[t0..]`) in place (t0 + width ≤ len). `plan` checked
                // these sizes fit in memory; z, wt and the input are distinct buffers.
                unsafe {
                    super::gemm_rows(
                        gemm::Parallelism::None,
                        cout,
                        width,
                        cin,
                        z.as_mut_ptr(),
                        width,
                        true,
                        lhs.as_ptr(),
                        cin,
                        rhs.as_ptr(),
                        rhs_rs,
                    );
                }
            }
            for co in 0..planes {
                // SAFETY: output row co of this chunk, out[(n·planes + co)·len + t0 ..]
                // [..width], lies within out (t0 + width ≤ len), and no other task holds
                // it: each task owns its item's columns t0 .. t0 + width, and its rows are
                // distinct channels. Nothing else reads out during the sweep.
                let o = unsafe { dst.row((n * planes + co) * len + t0, width) };
                let (a, b) = (&z[co * width..][..width], &z[(planes + co) * width..][..width]);
                // out holds zeros: out += 1 · a · σ(b).
                glu_affine_add(o, a, b, [1.0, 0.0, 1.0, 0.0, 1.0]);
            }
        });
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 + seed * 104_729) % 1013) as f32 / 500.0 - 1.0).collect()
    }

    #[test]
    fn conv_glu_matches_the_definition() {
        // 1×1 in place and with a skip, k = 3 and 5, one chunk and several (cout 1024:
        // chunks of 64 columns), a length shorter than the kernel.
        for (c, with_skip) in [
            (ConvGlu { batch: 2, cin: 5, cout: 8, len: 37, kernel: 1 }, false),
            (ConvGlu { batch: 2, cin: 5, cout: 8, len: 37, kernel: 1 }, true),
            (ConvGlu { batch: 2, cin: 7, cout: 6, len: 50, kernel: 3 }, true),
            (ConvGlu { batch: 1, cin: 3, cout: 1024, len: 150, kernel: 3 }, true),
            (ConvGlu { batch: 1, cin: 3, cout: 1024, len: 150, kernel: 1 }, false),
            (ConvGlu { batch: 1, cin: 4, cout: 4, len: 2, kernel: 5 }, false),
        ] {
            let ConvGlu { batch, cin, cout, len, kernel: k } = c;
            let x = fill(batch * cin * len, 1);
            let s = fill(batch * cin * len, 2);
            let w = fill(cout * cin * k, 3);
            let b = fill(cout, 4);
            let skip = with_skip.then_some(&s[..]);
            let got = conv_glu(&x, skip, &w, &b, c);
            let input = |n: usize, ci: usize, t: isize| -> f64 {
                if t < 0 || t >= len as isize {
                    return 0.0;
                }
                let i = (n * cin + ci) * len + t as usize;
                x[i] as f64 + if with_skip { s[i] as f64 } else { 0.0 }
            };
            let conv = |n: usize, o: usize, t: usize| -> f64 {
                b[o] as f64
                    + (0..cin)
                        .flat_map(|ci| (0..k).map(move |j| (ci, j)))
                        .map(|(ci, j)| {
                            w[(o * cin + ci) * k + j] as f64 * input(n, ci, t as isize + j as isize - (k / 2) as isize)
                        })
                        .sum::<f64>()
            };
            let mut worst = 0f64;
            for n in 0..batch {
                for o in 0..cout / 2 {
                    for t in 0..len {
                        let want = conv(n, o, t) / (1.0 + (-conv(n, o + cout / 2, t)).exp());
                        worst = worst.max((got[(n * cout / 2 + o) * len + t] as f64 - want).abs());
                    }
                }
            }
            assert!(worst < 2e-5, "{c:?}, skip {with_skip}: worst error {worst:e}");
        }
    }

    #[test]
    fn conv_glu_refuses_bad_shapes() {
        let c = ConvGlu { batch: 1, cin: 2, cout: 4, len: 8, kernel: 3 };
        assert_eq!(ConvGlu { cout: 3, ..c }.check(), Err(ShapeError::OddGlu { kernel: K, channels: 3 }));
        assert_eq!(ConvGlu { kernel: 2, ..c }.check(), Err(ShapeError::EvenKernel { kernel: K, size: 2 }));
        assert_eq!(ConvGlu { len: 0, ..c }.check(), Err(ShapeError::Zero { kernel: K, field: "len" }));
        let r = std::panic::catch_unwind(|| conv_glu(&[0.0; 16], None, &[0.0; 24], &[0.0; 3], c));
        let msg = r.expect_err("a short bias").downcast::<String>().expect("a message");
        assert_eq!(*msg, "conv_glu: the bias: 3 values where the shape says 4");
    }
}
