//! Convolution along one axis on host memory, without im2col: the padded input is laid
//! out once in polyphase order, then each kernel tap is one large `gemm`. Serves
//! `nn.Conv1d`, DConv's per-row Conv1d, the encoders' `[k, 1]` `nn.Conv2d`, and (with a
//! kernel along the inner columns too) the decoders' `[3, 3]` rewrite `nn.Conv2d`.

use rayon::prelude::*;

use super::{elements, expect_conv_lens, nonzero, or_panic, ShapeError};

/// One convolution along one axis of `x` laid out `[N, Cin, R, L, I]`: the kernel
/// runs over `L`, every one of the `R` rows and `I` inner columns shares it (so
/// `Conv1d` is `R = I = 1`, DConv on frequency rows is `R = F`, and the encoders'
/// `[k, 1]` Conv2d over frequency is `L = F, I = T`). A kernel of `inner_kernel` taps
/// may also run over `I` (stride 1, no dilation, `inner_pad` zeros on both ends): a
/// `[kh, kw]` Conv2d over `[N, C, H, W]` is `L = H, I = W`. Every size is at least 1, the
/// stride or the dilation is 1, and the kernel's span fits the padded length
/// ([`ConvAxis::check`]).
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
    /// Kernel size along the inner columns `I` (1: the kernel runs along `L` only).
    pub inner_kernel: usize,
    /// Zero padding on both ends of `I`.
    pub inner_pad: usize,
}

/// The sizes [`conv_axis`] works with, derived from a [`ConvAxis`] in checked
/// arithmetic: every buffer length here fits in memory, so the products of their
/// factors (all at least 1) that index into them cannot overflow either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    /// Output length along `L`.
    lout: usize,
    /// Taps after the polyphase split, `⌈kernel / stride⌉`.
    taps: usize,
    /// Column step between taps in the polyphase layout (the dilation, or 1).
    step: usize,
    /// Polyphase row length, `lout + (taps - 1) · step`.
    lq: usize,
    /// Padded inner width, `inner + 2 · inner_pad`.
    ip: usize,
    /// Output inner width, `ip − inner_kernel + 1`.
    iout: usize,
    /// Polyphase channels, `cin · stride`.
    cq: usize,
    /// Gemm columns, `rows · lq · ip`.
    ncols: usize,
    /// Length of the input.
    x: usize,
    /// Length of the weights.
    w: usize,
    /// Length of the output.
    out: usize,
    /// Length allocated for it: one row (`R = 1`) is computed straight into the output,
    /// `ip` columns wide, then compacted to `iout` in place, which needs
    /// `cout · lout · (ip − iout)` values past the end for the last batch item.
    out_alloc: usize,
    /// Length of the per-tap weights.
    wt: usize,
    /// Length of the polyphase input, with its zero tail.
    xq: usize,
    /// Length of the separate gemm result (0 for one row, computed in place).
    y: usize,
}

impl ConvAxis {
    /// Output length along `L`.
    ///
    /// # Panics
    ///
    /// When [`ConvAxis::check`] refuses the shape.
    pub fn out_len(&self) -> usize {
        or_panic(self.plan()).lout
    }

    /// Output width along `I`.
    ///
    /// # Panics
    ///
    /// When [`ConvAxis::check`] refuses the shape.
    pub fn out_inner(&self) -> usize {
        or_panic(self.plan()).iout
    }

    /// Checks the shape alone (every size at least 1, stride or dilation 1, the kernel
    /// within the padded input, no buffer too large) and returns the output length.
    pub fn check(&self) -> Result<usize, ShapeError> {
        self.plan().map(|p| p.lout)
    }

    fn plan(&self) -> Result<Plan, ShapeError> {
        const K: &str = "conv_axis";
        let ConvAxis { batch, cin, cout, rows, len, inner, kernel, stride, pad, dilation, inner_kernel, inner_pad } =
            *self;
        nonzero(
            K,
            &[
                ("batch", batch),
                ("cin", cin),
                ("cout", cout),
                ("rows", rows),
                ("len", len),
                ("inner", inner),
                ("kernel", kernel),
                ("stride", stride),
                ("dilation", dilation),
                ("inner_kernel", inner_kernel),
            ],
        )?;
        if stride != 1 && dilation != 1 {
            return Err(ShapeError::StrideAndDilation { kernel: K, stride, dilation });
        }
        let overflow = |what| ShapeError::Overflow { kernel: K, what };
        let padded = pad.checked_mul(2).and_then(|p| p.checked_add(len)).ok_or(overflow("the padded input"))?;
        let span =
            dilation.checked_mul(kernel - 1).and_then(|s| s.checked_add(1)).ok_or(overflow("the kernel span"))?;
        if span > padded {
            return Err(ShapeError::KernelTooLong { kernel: K, span, padded });
        }
        let lout = (padded - span) / stride + 1;
        let ip = inner_pad.checked_mul(2).and_then(|p| p.checked_add(inner)).ok_or(overflow("the padded columns"))?;
        if inner_kernel > ip {
            return Err(ShapeError::KernelTooLong { kernel: K, span: inner_kernel, padded: ip });
        }
        let iout = ip - inner_kernel + 1;
        let taps = kernel.div_ceil(stride);
        let step = if stride == 1 { dilation } else { 1 };
        let tail = (taps - 1).checked_mul(step).ok_or(overflow("the polyphase row"))?;
        let lq = lout.checked_add(tail).ok_or(overflow("the polyphase row"))?;
        let cq = cin.checked_mul(stride).ok_or(overflow("the polyphase input"))?;
        let ncols = elements(K, "the polyphase input", &[rows, lq, ip])?;
        let body = elements(K, "the polyphase input", &[cq, ncols])?;
        let xq = elements(K, "the polyphase input", &[tail, ip])?
            .checked_add(inner_kernel - 1)
            .and_then(|t| t.checked_add(body))
            .ok_or(overflow("the polyphase input"))?;
        elements(K, "the polyphase input", &[xq])?;
        // Reading the polyphase input sample j·stride + phase for j < lq.
        elements(K, "the polyphase input", &[lq, stride])?;
        Ok(Plan {
            lout,
            taps,
            step,
            lq,
            ip,
            iout,
            cq,
            ncols,
            x: elements(K, "the input", &[batch, cin, rows, len, inner])?,
            w: elements(K, "the weights", &[cout, cin, kernel, inner_kernel])?,
            out: elements(K, "the output", &[batch, cout, rows, lout, iout])?,
            out_alloc: elements(K, "the output", &[batch, cout, rows, lout, iout])?
                .checked_add(elements(K, "the output", &[cout, lout, ip - iout])?)
                .ok_or(overflow("the output"))?,
            wt: elements(K, "the per-tap weights", &[taps, inner_kernel, cout, cq])?,
            xq,
            y: if rows == 1 { 0 } else { elements(K, "the gemm result", &[cout, ncols])? },
        })
    }
}

/// The convolution of [`ConvAxis`] without im2col: the padded input is laid out once in
/// polyphase order (`[Cin·s, R, Lq, I]`, phase `p` of channel `c` holding samples
/// `j·s + p`), which turns a stride-`s` kernel of `k` taps into a stride-1 kernel of
/// `⌈k/s⌉` taps over `Cin·s` channels; each tap is then one large gemm over every row
/// and column at once, accumulated in place. With a kernel along `I`, the columns are
/// padded in the layout too and each (tap, inner tap) pair is one gemm reading the
/// layout shifted by that many columns; the columns past the output width are computed
/// and dropped. `w` `[Cout, Cin, K, Ki]`, `bias` `[Cout]` → `[N, Cout, R, Lout, Iout]`.
///
/// # Panics
///
/// When [`ConvAxis::check`] refuses the shape or a slice's length does not match it,
/// with a [`ShapeError`] message, before any memory is read.
pub fn conv_axis(x: &[f32], w: &[f32], bias: &[f32], c: ConvAxis) -> Vec<f32> {
    let lens = |p: &Plan| expect_conv_lens("conv_axis", (x, w, bias), [p.x, p.w, c.cout]);
    let p = or_panic(c.plan().and_then(|p| lens(&p).map(|()| p)));
    let ConvAxis { batch, cin, cout, rows, len, inner, kernel, stride: s, pad, inner_kernel: ki, inner_pad, .. } = c;
    let Plan { lout, taps, step, lq, ip, iout, cq, ncols, .. } = p;
    // Per-(tap, inner tap) weights [Cout, Cin·s].
    let mut wt = vec![0f32; p.wt];
    for tap in 0..taps {
        for ti in 0..ki {
            for co in 0..cout {
                for ci in 0..cin {
                    for ph in 0..s {
                        let k = tap * s + ph;
                        if k < kernel {
                            wt[((tap * ki + ti) * cout + co) * cq + ci * s + ph] =
                                w[((co * cin + ci) * kernel + k) * ki + ti];
                        }
                    }
                }
            }
        }
    }
    let mut out = vec![0f32; if rows == 1 { p.out_alloc } else { p.out }];
    // The last taps read up to (taps-1)·step columns past a row: zeros at the very end.
    let mut xq = vec![0f32; p.xq];
    let mut y = vec![0f32; p.y];
    for n in 0..batch {
        xq[..cq * ncols].par_chunks_mut(ncols).enumerate().for_each(|(q, dst)| {
            let (ci, ph) = (q / s, q % s);
            for r in 0..rows {
                let src = &x[((n * cin + ci) * rows + r) * len * inner..][..len * inner];
                let dst = &mut dst[r * lq * ip..][..lq * ip];
                if s == 1 && ip == inner {
                    // Unstrided, no column padding: the row shifted by `pad`, one copy.
                    let (lo, hi) = (pad.min(lq), (pad + len).min(lq));
                    dst[..lo * ip].fill(0.0);
                    dst[hi * ip..].fill(0.0);
                    if hi > lo {
                        dst[lo * ip..hi * ip].copy_from_slice(&src[(lo - pad) * inner..(hi - pad) * inner]);
                    }
                    continue;
                }
                if inner == 1 && ip == 1 {
                    // Strided single samples: a gather, not a copy call per sample.
                    for (j, d) in dst.iter_mut().enumerate() {
                        *d = (j * s + ph).checked_sub(pad).filter(|l| *l < len).map_or(0.0, |l| src[l]);
                    }
                    continue;
                }
                for j in 0..lq {
                    let at = j * s + ph;
                    let d = &mut dst[j * ip..][..ip];
                    match at.checked_sub(pad).filter(|l| *l < len) {
                        Some(l) => {
                            d[..inner_pad].fill(0.0);
                            d[inner_pad..][..inner].copy_from_slice(&src[l * inner..][..inner]);
                            d[inner_pad + inner..].fill(0.0);
                        }
                        None => d.fill(0.0),
                    }
                }
            }
        });
        // One row: the gemm writes this item's output itself, `lout · ip` columns per
        // channel (the rows past `lout` are not computed); several rows: all of `y`.
        let (dst, cols) = if rows == 1 {
            (&mut out[n * cout * lout * iout..][..cout * lout * ip], lout * ip)
        } else {
            (&mut y[..], ncols)
        };
        for (tap, ti) in (0..taps).flat_map(|tap| (0..ki).map(move |ti| (tap, ti))) {
            // Safe slicing first: these panic rather than hand gemm a pointer outside.
            let lhs = &wt[(tap * ki + ti) * cout * cq..][..cout * cq];
            let rhs = &xq[tap * step * ip + ti..];
            // SAFETY: gemm writes `dst` as cout x cols, row stride cols: exactly
            // dst.len() = cout·cols values, borrowed mutably here and nowhere else. It
            // reads lhs as cout x cq, row stride cq: exactly `lhs`. It reads rhs as
            // cq x cols, row stride ncols (cols <= ncols), from tap·step·ip + ti: the last
            // element is at most tap·step·ip + ti + (cq-1)·ncols + ncols - 1
            // <= (taps-1)·step·ip + (ki-1) + cq·ncols - 1 < xq.len() (the zero tail), so
            // within `rhs`. `plan` checked that every one of these sizes fits in memory,
            // so none of the products wrapped, and the strides fit in isize. Neither
            // input overlaps `dst`.
            unsafe {
                super::gemm_rows(
                    gemm::Parallelism::Rayon(0),
                    cout,
                    cols,
                    cq,
                    dst.as_mut_ptr(),
                    cols,
                    tap > 0 || ti > 0,
                    lhs.as_ptr(),
                    cq,
                    rhs.as_ptr(),
                    ncols,
                );
            }
        }
        if rows == 1 {
            add_bias_compacting(&mut out[n * cout * lout * iout..][..cout * lout * ip], bias, lout, ip, iout);
            continue;
        }
        out[n * cout * rows * lout * iout..][..cout * rows * lout * iout]
            .par_chunks_mut(rows * lout * iout)
            .enumerate()
            .for_each(|(co, dst)| {
                let b = bias[co];
                for r in 0..rows {
                    let d = &mut dst[r * lout * iout..][..lout * iout];
                    if iout == ip {
                        let src = &y[co * ncols + r * lq * ip..][..lout * ip];
                        d.iter_mut().zip(src).for_each(|(o, v)| *o = v + b);
                    } else {
                        for (j, d) in d.chunks_exact_mut(iout).enumerate() {
                            let src = &y[co * ncols + (r * lq + j) * ip..][..iout];
                            d.iter_mut().zip(src).for_each(|(o, v)| *o = v + b);
                        }
                    }
                }
            });
    }
    out.truncate(p.out);
    out
}

/// `buf` holds `[Cout, lout, ip]` gemm results; adds the bias and leaves `[Cout, lout,
/// iout]` (the first `iout` columns of each row) at its start, moving values only
/// towards the front, so it runs in place.
fn add_bias_compacting(buf: &mut [f32], bias: &[f32], lout: usize, ip: usize, iout: usize) {
    if iout == ip {
        buf.par_chunks_mut(lout * ip).zip(bias).for_each(|(row, &b)| row.iter_mut().for_each(|v| *v += b));
        return;
    }
    for (co, &b) in bias.iter().enumerate() {
        for j in 0..lout {
            let (from, to) = ((co * lout + j) * ip, (co * lout + j) * iout);
            buf.copy_within(from..from + iout, to);
            buf[to..to + iout].iter_mut().for_each(|v| *v += b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_axis_matches_the_definition() {
        // (kernel, stride, pad, dilation, rows, inner, inner kernel, inner pad)
        for (kernel, stride, pad, dil, rows, inner, ki, ipad) in [
            (3, 1, 1, 1, 3, 1, 1, 0),
            (3, 1, 2, 2, 2, 1, 1, 0),
            (8, 4, 2, 1, 1, 1, 1, 0),
            (8, 4, 2, 1, 1, 5, 1, 0),
            (3, 1, 1, 1, 1, 1, 1, 0),
            // The decoders' [3, 3] rewrite, a [1, 3] one, and uneven padding of I.
            (3, 1, 1, 1, 1, 6, 3, 1),
            (1, 1, 0, 1, 2, 5, 3, 1),
            (3, 1, 1, 1, 1, 7, 2, 0),
            (4, 2, 1, 1, 1, 4, 3, 2),
        ] {
            let c = ConvAxis {
                batch: 2,
                cin: 3,
                cout: 4,
                rows,
                len: 37,
                inner,
                kernel,
                stride,
                pad,
                dilation: dil,
                inner_kernel: ki,
                inner_pad: ipad,
            };
            let x: Vec<f32> =
                (0..c.batch * c.cin * rows * c.len * inner).map(|i| ((i * 7919 % 997) as f32) / 500.0 - 1.0).collect();
            let w: Vec<f32> =
                (0..c.cout * c.cin * kernel * ki).map(|i| ((i * 104729 % 611) as f32) / 300.0 - 1.0).collect();
            let b: Vec<f32> = (0..c.cout).map(|i| i as f32 * 0.25).collect();
            let got = conv_axis(&x, &w, &b, c);
            let (lout, iout) = (c.out_len(), c.out_inner());
            assert_eq!(iout, inner + 2 * ipad + 1 - ki);
            assert_eq!(got.len(), c.batch * c.cout * rows * lout * iout);
            let mut worst = 0f64;
            for n in 0..c.batch {
                for co in 0..c.cout {
                    for r in 0..rows {
                        for t in 0..lout {
                            for i in 0..iout {
                                let mut want = b[co] as f64;
                                for ci in 0..c.cin {
                                    for k in 0..kernel {
                                        for ti in 0..ki {
                                            let at = (t * stride + k * dil) as isize - pad as isize;
                                            let col = (i + ti) as isize - ipad as isize;
                                            if at >= 0 && (at as usize) < c.len && col >= 0 && (col as usize) < inner {
                                                let xv = x[(((n * c.cin + ci) * rows + r) * c.len + at as usize)
                                                    * inner
                                                    + col as usize];
                                                let wv = w[((co * c.cin + ci) * kernel + k) * ki + ti];
                                                want += wv as f64 * xv as f64;
                                            }
                                        }
                                    }
                                }
                                let have = got[(((n * c.cout + co) * rows + r) * lout + t) * iout + i] as f64;
                                worst = worst.max((have - want).abs());
                            }
                        }
                    }
                }
            }
            assert!(worst < 1e-5, "{c:?}: worst error {worst:e}");
        }
    }

    fn shape() -> ConvAxis {
        ConvAxis {
            batch: 1,
            cin: 2,
            cout: 3,
            rows: 1,
            len: 10,
            inner: 1,
            kernel: 3,
            stride: 1,
            pad: 1,
            dilation: 1,
            inner_kernel: 1,
            inner_pad: 0,
        }
    }

    #[test]
    fn check_refuses_bad_shapes_before_any_arithmetic_wraps() {
        assert_eq!(shape().check(), Ok(10));
        assert_eq!(ConvAxis { stride: 4, kernel: 8, pad: 2, len: 37, ..shape() }.check(), Ok(9));
        for (field, c) in [
            ("kernel", ConvAxis { kernel: 0, ..shape() }),
            ("stride", ConvAxis { stride: 0, ..shape() }),
            ("dilation", ConvAxis { dilation: 0, ..shape() }),
            ("batch", ConvAxis { batch: 0, ..shape() }),
            ("inner", ConvAxis { inner: 0, ..shape() }),
            ("inner_kernel", ConvAxis { inner_kernel: 0, ..shape() }),
        ] {
            assert_eq!(c.check(), Err(ShapeError::Zero { kernel: "conv_axis", field }), "{c:?}");
        }
        assert!(matches!(
            ConvAxis { stride: 2, dilation: 2, ..shape() }.check(),
            Err(ShapeError::StrideAndDilation { .. })
        ));
        // Span 2·(3-1)+1 = 5 > 2 + 2·1 = 4: `out_len` would have underflowed.
        assert_eq!(
            ConvAxis { len: 2, dilation: 2, ..shape() }.check(),
            Err(ShapeError::KernelTooLong { kernel: "conv_axis", span: 5, padded: 4 })
        );
        assert!(matches!(ConvAxis { pad: usize::MAX / 2 + 1, ..shape() }.check(), Err(ShapeError::Overflow { .. })));
        // An inner kernel wider than the padded columns.
        assert_eq!(
            ConvAxis { inner: 2, inner_kernel: 5, inner_pad: 1, ..shape() }.check(),
            Err(ShapeError::KernelTooLong { kernel: "conv_axis", span: 5, padded: 4 })
        );
        assert!(matches!(
            ConvAxis { inner_pad: usize::MAX / 2 + 1, ..shape() }.check(),
            Err(ShapeError::Overflow { what: "the padded columns", .. })
        ));
        assert!(matches!(
            ConvAxis { dilation: usize::MAX / 2 + 1, ..shape() }.check(),
            Err(ShapeError::Overflow { what: "the kernel span", .. })
        ));
        // Sizes whose product wraps around to something small are refused.
        let wraps = ConvAxis { batch: 1 << 32, rows: 1 << 32, ..shape() };
        assert!(matches!(wraps.check(), Err(ShapeError::Overflow { .. })), "{:?}", wraps.check());
    }

    #[test]
    #[should_panic(expected = "conv_axis: the weights: 5 values where the shape says 18")]
    fn conv_axis_panics_before_reading_short_weights() {
        conv_axis(&[0.0; 20], &[0.0; 5], &[0.0; 3], shape());
    }

    #[test]
    #[should_panic(expected = "conv_axis: `stride` must be at least 1")]
    fn out_len_panics_on_a_zero_stride() {
        ConvAxis { stride: 0, ..shape() }.out_len();
    }
}
