//! The 3×3 convolution (stride 1, no dilation) by Winograd's minimal filtering
//! F(2×2, 3×3): each 2×2 block of outputs costs 16 multiplications per input channel
//! instead of 36, so the channel sums become 16 gemms of 2.25× fewer FLOPs than the 9
//! per-tap gemms of [`conv_axis`](super::conv_axis). It serves the decoders' `[3, 3]`
//! rewrite `nn.Conv2d`, about a fifth of htdemucs's arithmetic.
//!
//! The transforms use only 0, ±1 and ±½ (exact in binary), so the result differs from
//! the direct sum by a few ulp per output, like any other summation order (the unit
//! test and the model's parity suite pin it). The work runs in chunks of tile rows so
//! the transformed input and the gemm results of one chunk stay in cache-sized scratch,
//! kept per thread across calls.

use rayon::prelude::*;

use super::{elements, expect_len, nonzero, or_panic, ShapeError};

const K: &str = "conv3x3";

/// A 3×3 convolution, stride 1, no dilation, over `[N, Cin, H, W]` with `pad_h` / `pad_w`
/// zeros on both ends of `H` / `W`: the decoders' rewrite `nn.Conv2d` (`pad 1`).
#[derive(Debug, Clone, Copy)]
pub struct Conv3x3 {
    /// Batch N.
    pub batch: usize,
    /// Input channels.
    pub cin: usize,
    /// Output channels.
    pub cout: usize,
    /// Height H (the first convolved axis).
    pub height: usize,
    /// Width W (the inner axis).
    pub width: usize,
    /// Zero padding on both ends of `H`.
    pub pad_h: usize,
    /// Zero padding on both ends of `W`.
    pub pad_w: usize,
    /// `nn.GLU(dim=1)` on the result: `Cout / 2` channels out, `a · σ(b)` of the first
    /// and second halves (`Cout` even).
    pub glu: bool,
}

/// The sizes [`conv3x3`] works with, from a [`Conv3x3`] in checked arithmetic.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Output height and width.
    ho: usize,
    wo: usize,
    /// Tile rows and tiles per row (each tile: 2×2 outputs from 4×4 inputs).
    th: usize,
    tw: usize,
    /// Tile rows per chunk.
    rows: usize,
    x: usize,
    u: usize,
    out: usize,
}

/// Tiles per chunk for a tile of `per_tile` scratch floats (transformed input and gemm
/// results): about 2 Mi floats in all, so a chunk's working set stays near the L2/L3
/// boundary, but never fewer than 1024 tiles (gemm columns), which the gemm needs to run
/// at speed (256 made the deepest decoder's convolution 1.2× slower; 4 Mi floats the
/// shallowest one 1.4× slower; `examples/kernels.rs`). Whole tile rows, at least one.
fn chunk_tiles(per_tile: usize) -> usize {
    ((2 << 20) / per_tile).max(1024)
}

impl Conv3x3 {
    /// Checks the shape (every size at least 1, the padded input at least 3×3, no
    /// buffer too large) and returns the output `[H', W']`.
    pub fn check(&self) -> Result<[usize; 2], ShapeError> {
        self.plan(chunk_tiles).map(|p| [p.ho, p.wo])
    }

    /// Output `[H', W']`.
    ///
    /// # Panics
    ///
    /// When [`Conv3x3::check`] refuses the shape.
    pub fn out_dims(&self) -> [usize; 2] {
        or_panic(self.check())
    }

    /// The plan, with chunks of about `chunk` tiles (see [`chunk_tiles`]).
    fn plan(&self, chunk: fn(usize) -> usize) -> Result<Plan, ShapeError> {
        let Conv3x3 { batch, cin, cout, height, width, pad_h, pad_w, glu } = *self;
        nonzero(K, &[("batch", batch), ("cin", cin), ("cout", cout), ("height", height), ("width", width)])?;
        if glu && cout % 2 != 0 {
            return Err(ShapeError::OddGlu { kernel: K, channels: cout });
        }
        let overflow = |what| ShapeError::Overflow { kernel: K, what };
        let padded = |len: usize, pad: usize| pad.checked_mul(2).and_then(|p| p.checked_add(len));
        let hp = padded(height, pad_h).ok_or(overflow("the padded input"))?;
        let wp = padded(width, pad_w).ok_or(overflow("the padded input"))?;
        for padded in [hp, wp] {
            if padded < 3 {
                return Err(ShapeError::KernelTooLong { kernel: K, span: 3, padded });
            }
        }
        let (ho, wo) = (hp - 2, wp - 2);
        let (th, tw) = (ho.div_ceil(2), wo.div_ceil(2));
        // Padded rows of the transforms: 2·tw + 2 columns.
        elements(K, "the padded input", &[tw + 1, 2])?;
        let per_tile = elements(K, "the chunk", &[16, cin.checked_add(cout).ok_or(overflow("the chunk"))?])?;
        let rows = (chunk(per_tile) / tw).clamp(1, th);
        elements(K, "the chunk", &[per_tile, rows, tw])?;
        Ok(Plan {
            ho,
            wo,
            th,
            tw,
            rows,
            x: elements(K, "the input", &[batch, cin, height, width])?,
            u: elements(K, "the transformed weights", &[16, cout, cin])?,
            out: elements(K, "the output", &[batch, if glu { cout / 2 } else { cout }, ho, wo])?,
        })
    }
}

/// The transformed weights `G g Gᵀ` of `w` `[Cout, Cin, 3, 3]`: `[16, Cout, Cin]`, one
/// `Cout × Cin` matrix per position of the 4×4 transformed tile. Computed once per
/// weight (the model caches them), read by every [`conv3x3`] call.
///
/// # Panics
///
/// When `w` does not hold `cout · cin · 9` values.
pub fn conv3x3_weights(w: &[f32], cout: usize, cin: usize) -> Vec<f32> {
    let n = or_panic(elements(K, "the weights", &[cout, cin, 9]));
    or_panic(expect_len(K, "the weights", w.len(), n));
    let mut u = vec![0f32; 16 * cout * cin];
    // G g for one 3-vector: [g0, (g0+g1+g2)/2, (g0−g1+g2)/2, g2].
    let g4 = |g: [f32; 3]| [g[0], 0.5 * (g[0] + g[1] + g[2]), 0.5 * (g[0] - g[1] + g[2]), g[2]];
    for co in 0..cout {
        for ci in 0..cin {
            let g = &w[(co * cin + ci) * 9..][..9];
            // Along H first (each of the 3 columns), then along W (each of the 4 rows).
            let cols: [[f32; 4]; 3] = std::array::from_fn(|l| g4([g[l], g[3 + l], g[6 + l]]));
            for i in 0..4 {
                let row = g4([cols[0][i], cols[1][i], cols[2][i]]);
                for (j, v) in row.into_iter().enumerate() {
                    u[((i * 4 + j) * cout + co) * cin + ci] = v;
                }
            }
        }
    }
    u
}

thread_local! {
    /// Each calling thread's chunk scratch: the transformed input, then the gemm results.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The 3×3 convolution of [`Conv3x3`] on `x` `[N, Cin, H, W]` (plus `skip`, the same
/// shape, added as the input is read: the decoders' `x + skip`), with the weights
/// transformed by [`conv3x3_weights`] (`u`, `[16, Cout, Cin]`) and `bias` `[Cout]` →
/// `[N, Cout, H', W']` (`Cout / 2` channels with [`Conv3x3::glu`]). Per chunk of tile
/// rows: the input transform `Bᵀ d B` of every tile into `[Cin, 16, tiles]`, 16 gemms
/// (`U[ξ] · V[ξ]`) into `[Cout, 16, tiles]`, and the output transform `Aᵀ m A` plus the
/// bias (then the GLU) into the output rows.
///
/// # Panics
///
/// When [`Conv3x3::check`] refuses the shape or a slice's length does not match it,
/// with a [`ShapeError`] message, before any memory is read.
pub fn conv3x3(x: &[f32], skip: Option<&[f32]>, u: &[f32], bias: &[f32], c: Conv3x3) -> Vec<f32> {
    conv3x3_chunked((x, skip), u, bias, c, chunk_tiles)
}

/// [`conv3x3`] with chunks of `chunk(per_tile)` tiles.
fn conv3x3_chunked(
    (x, skip): (&[f32], Option<&[f32]>),
    u: &[f32],
    bias: &[f32],
    c: Conv3x3,
    chunk: fn(usize) -> usize,
) -> Vec<f32> {
    let p = or_panic(c.plan(chunk).and_then(|p| {
        expect_len(K, "the input", x.len(), p.x)?;
        if let Some(skip) = skip {
            expect_len(K, "the skip input", skip.len(), p.x)?;
        }
        expect_len(K, "the transformed weights", u.len(), p.u)?;
        expect_len(K, "the bias", bias.len(), c.cout)?;
        Ok(p)
    }));
    let Conv3x3 { batch, cin, cout, height: h, width: w, pad_h, pad_w, glu } = c;
    let Plan { ho, wo, th, tw, rows, .. } = p;
    let planes = if glu { cout / 2 } else { cout };
    let mut out = vec![0f32; p.out];
    // Taken out of the thread's slot rather than borrowed: a thread waiting in a rayon
    // call below may run another pass's convolution, which then makes its own.
    let mut scratch = SCRATCH.take();
    let (v_len, m_len) = (cin * 16 * rows * tw, cout * 16 * rows * tw);
    if scratch.len() < v_len + m_len {
        scratch.resize(v_len + m_len, 0.0);
    }
    let (v, m) = scratch.split_at_mut(v_len);
    let m = &mut m[..m_len];
    for n in 0..batch {
        let x = &x[n * cin * h * w..][..cin * h * w];
        let skip = skip.map(|s| &s[n * cin * h * w..][..cin * h * w]);
        let out = &mut out[n * planes * ho * wo..][..planes * ho * wo];
        for a0 in (0..th).step_by(rows) {
            let ra = rows.min(th - a0);
            let nt = ra * tw;
            // Input transform: channel ci's tiles into v[ci] = [16, nt].
            v[..cin * 16 * nt].par_chunks_mut(16 * nt).enumerate().for_each(|(ci, dst)| {
                let at = ci * h * w..(ci + 1) * h * w;
                input_transform((&x[at.clone()], skip.map(|s| &s[at])), dst, (h, w, pad_h, pad_w), a0, ra, tw);
            });
            for xi in 0..16 {
                let lhs = &u[xi * cout * cin..][..cout * cin];
                let rhs = &v[xi * nt..];
                let dst = &mut m[xi * nt..];
                // SAFETY: gemm writes dst as cout × nt with row stride 16·nt: the last
                // element is at xi·nt + (cout−1)·16·nt + nt − 1 < cout·16·nt = m_len,
                // within `dst` (which starts at xi·nt). It reads lhs as cout × cin, row
                // stride cin: exactly `lhs`; rhs as cin × nt, row stride 16·nt: the last
                // element is at xi·nt + (cin−1)·16·nt + nt − 1 < cin·16·nt ≤ v.len(),
                // within `rhs`. `plan` checked that the chunk's size fits in memory, so
                // none of these products wrapped and the strides fit in isize; v, m and u
                // are distinct buffers.
                unsafe {
                    super::gemm_rows(
                        gemm::Parallelism::Rayon(0),
                        cout,
                        nt,
                        cin,
                        dst.as_mut_ptr(),
                        16 * nt,
                        false,
                        lhs.as_ptr(),
                        cin,
                        rhs.as_ptr(),
                        16 * nt,
                    );
                }
            }
            // Output transform: channel co's rows 2·a0 .. of the output; with the GLU,
            // channels co and co + Cout/2 into scratch rows, then a · σ(b) into the output.
            let (r0, r1) = (2 * a0, (2 * (a0 + ra)).min(ho));
            let m = &m[..];
            let tile = |co: usize| &m[co * 16 * nt..][..16 * nt];
            out.par_chunks_mut(ho * wo).enumerate().for_each(|(co, plane)| {
                let dst = &mut plane[r0 * wo..r1 * wo];
                if !glu {
                    output_transform(tile(co), dst, (wo, bias[co]), ra, tw);
                    return;
                }
                let mut ab = vec![0f32; 2 * dst.len()];
                let (a, b) = ab.split_at_mut(dst.len());
                output_transform(tile(co), a, (wo, bias[co]), ra, tw);
                output_transform(tile(co + planes), b, (wo, bias[co + planes]), ra, tw);
                super::glu_scale_add_in_place(dst, &ab, &[1.0], 1, dst.len());
            });
        }
    }
    SCRATCH.set(scratch);
    out
}

/// `Bᵀ d B` of the tiles of tile rows `a0 .. a0 + ra` of one channel `x` `[H, W]` (plus
/// `skip`'s) into `dst` `[16, ra · tw]`.
fn input_transform(
    (x, skip): (&[f32], Option<&[f32]>),
    dst: &mut [f32],
    (h, w, pad_h, pad_w): (usize, usize, usize, usize),
    a0: usize,
    ra: usize,
    tw: usize,
) {
    let nt = ra * tw;
    // One input row with its zero padding (2·tw + 2 columns: the margins stay zero),
    // split into even and odd columns (tw + 1 each); then its four row-transformed
    // vectors t[j] (tw each), kept in one of four slots: the two lower input rows of a
    // tile row are the two upper ones of the next.
    let mut padded = vec![0f32; 2 * tw + 2];
    let (mut even, mut odd) = (vec![0f32; tw + 1], vec![0f32; tw + 1]);
    let mut t = vec![0f32; 16 * tw];
    let slot = |a: usize, i: usize| (2 * a + i) % 4;
    for a in 0..ra {
        for i in if a == 0 { 0 } else { 2 }..4 {
            let r = (2 * (a0 + a) + i).checked_sub(pad_h).filter(|r| *r < h);
            let ti = &mut t[slot(a, i) * 4 * tw..][..4 * tw];
            let Some(r) = r else {
                ti.fill(0.0);
                continue;
            };
            let (row, inner) = (&x[r * w..][..w], &mut padded[pad_w..pad_w + w]);
            match skip {
                Some(skip) => {
                    inner.iter_mut().zip(row.iter().zip(&skip[r * w..][..w])).for_each(|(p, (a, b))| *p = a + b)
                }
                None => inner.copy_from_slice(row),
            }
            for ((e, o), pair) in even.iter_mut().zip(odd.iter_mut()).zip(padded.chunks_exact(2)) {
                (*e, *o) = (pair[0], pair[1]);
            }
            let (t0, rest) = ti.split_at_mut(tw);
            let (t1, rest) = rest.split_at_mut(tw);
            let (t2, t3) = rest.split_at_mut(tw);
            for b in 0..tw {
                let (d0, d1, d2, d3) = (even[b], odd[b], even[b + 1], odd[b + 1]);
                t0[b] = d0 - d2;
                t1[b] = d1 + d2;
                t2[b] = d2 - d1;
                t3[b] = d1 - d3;
            }
        }
        // Along H: v[i][j] = (Bᵀ t[·][j])[i], rows [t0 − t2, t1 + t2, t2 − t1, t1 − t3].
        for j in 0..4 {
            let row = |i: usize| &t[(slot(a, i) * 4 + j) * tw..][..tw];
            let (s0, s1, s2, s3) = (row(0), row(1), row(2), row(3));
            for (i, (p, q, sign)) in
                [(s0, s2, -1.0f32), (s1, s2, 1.0), (s2, s1, -1.0), (s1, s3, -1.0)].into_iter().enumerate()
            {
                let d = &mut dst[(i * 4 + j) * nt + a * tw..][..tw];
                d.iter_mut().zip(p.iter().zip(q)).for_each(|(d, (p, q))| *d = p + sign * q);
            }
        }
    }
}

/// `Aᵀ m A + bias` of one output channel's tiles `m` `[16, ra · tw]` into its rows
/// `plane` (`[≤ 2·ra, wo]`, the last tile row or column cut at the output's edge).
fn output_transform(m: &[f32], plane: &mut [f32], (wo, bias): (usize, f32), ra: usize, tw: usize) {
    let nt = ra * tw;
    let mut s = vec![0f32; 8 * tw];
    for a in 0..ra {
        // Along H: s[y][j] for output row y of the tile.
        for j in 0..4 {
            let row = |i: usize| &m[(i * 4 + j) * nt + a * tw..][..tw];
            let (m0, m1, m2, m3) = (row(0), row(1), row(2), row(3));
            let (s0, s1) = s.split_at_mut(4 * tw);
            let (s0, s1) = (&mut s0[j * tw..][..tw], &mut s1[j * tw..][..tw]);
            for b in 0..tw {
                s0[b] = m0[b] + m1[b] + m2[b];
                s1[b] = m1[b] - m2[b] - m3[b];
            }
        }
        // Along W, into the output rows 2a and 2a + 1 where they exist.
        for y in 0..2 {
            let Some(dst) = plane.get_mut((2 * a + y) * wo..(2 * a + y + 1) * wo) else {
                break;
            };
            let sy = &s[y * 4 * tw..][..4 * tw];
            let (q0, q1, q2, q3) = (&sy[..tw], &sy[tw..2 * tw], &sy[2 * tw..3 * tw], &sy[3 * tw..]);
            let mut pairs = dst.chunks_exact_mut(2);
            for (b, pair) in pairs.by_ref().enumerate() {
                pair[0] = q0[b] + q1[b] + q2[b] + bias;
                pair[1] = q1[b] - q2[b] - q3[b] + bias;
            }
            if let [last] = pairs.into_remainder() {
                let b = tw - 1;
                *last = q0[b] + q1[b] + q2[b] + bias;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn direct(x: &[f32], w: &[f32], b: &[f32], c: Conv3x3) -> Vec<f64> {
        let [ho, wo] = c.out_dims();
        let mut y = vec![0f64; c.batch * c.cout * ho * wo];
        for n in 0..c.batch {
            for co in 0..c.cout {
                for r in 0..ho {
                    for q in 0..wo {
                        let mut acc = b[co] as f64;
                        for ci in 0..c.cin {
                            for kh in 0..3 {
                                for kw in 0..3 {
                                    let (ir, iq) =
                                        ((r + kh) as isize - c.pad_h as isize, (q + kw) as isize - c.pad_w as isize);
                                    if ir >= 0 && iq >= 0 && (ir as usize) < c.height && (iq as usize) < c.width {
                                        let xv = x[((n * c.cin + ci) * c.height + ir as usize) * c.width + iq as usize];
                                        acc += w[((co * c.cin + ci) * 3 + kh) * 3 + kw] as f64 * xv as f64;
                                    }
                                }
                            }
                        }
                        y[((n * c.cout + co) * ho + r) * wo + q] = acc;
                    }
                }
            }
        }
        y
    }

    #[test]
    fn conv3x3_matches_the_definition() {
        // (cin, cout, height, width, pad_h, pad_w): even and odd sizes, no padding, wider
        // padding, one row, and a shape with several chunks.
        for (cin, cout, height, width, pad_h, pad_w) in [
            (3, 4, 8, 10, 1, 1),
            (2, 5, 7, 9, 1, 1),
            (4, 3, 6, 5, 0, 0),
            (1, 2, 1, 1, 1, 1),
            (3, 2, 5, 4, 2, 1),
            (5, 3, 1, 12, 1, 1),
            (2, 3, 40, 3, 1, 1),
        ] {
            let c = Conv3x3 { batch: 2, cin, cout, height, width, pad_h, pad_w, glu: false };
            let x: Vec<f32> = (0..2 * cin * height * width).map(|i| ((i * 7919 % 997) as f32) / 500.0 - 1.0).collect();
            let w: Vec<f32> = (0..cout * cin * 9).map(|i| ((i * 104729 % 611) as f32) / 300.0 - 1.0).collect();
            let b: Vec<f32> = (0..cout).map(|i| i as f32 * 0.25 - 0.5).collect();
            let u = conv3x3_weights(&w, cout, cin);
            let want = direct(&x, &w, &b, c);
            // One chunk, then chunks of one tile row (the last one cut short when the
            // output's height is odd).
            for chunk in [chunk_tiles, |_| 1] {
                let got = conv3x3_chunked((&x, None), &u, &b, c, chunk);
                assert_eq!(got.len(), want.len(), "{c:?}");
                let worst = got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0, f64::max);
                assert!(worst < 1e-5, "{c:?}: worst error {worst:e}");
            }
            // The decoders' form: glu(conv(x + skip)), over 2·cout channels.
            let c = Conv3x3 { cout: 2 * cout, glu: true, ..c };
            let skip: Vec<f32> = x.iter().map(|v| 0.5 - v * v).collect();
            let sum: Vec<f32> = x.iter().zip(&skip).map(|(a, b)| a + b).collect();
            let w: Vec<f32> = (0..2 * cout * cin * 9).map(|i| ((i * 7727 % 613) as f32) / 300.0 - 1.0).collect();
            let b: Vec<f32> = (0..2 * cout).map(|i| 0.5 - i as f32 * 0.125).collect();
            let full = direct(&sum, &w, &b, Conv3x3 { glu: false, ..c });
            let [ho, wo] = c.out_dims();
            let plane = ho * wo;
            let want: Vec<f64> = (0..2 * cout * plane)
                .map(|i| {
                    let (n, rest) = (i / (cout * plane), i % (cout * plane));
                    let at = n * 2 * cout * plane + rest;
                    full[at] / (1.0 + (-full[at + cout * plane]).exp())
                })
                .collect();
            for chunk in [chunk_tiles, |_| 1] {
                let got = conv3x3_chunked((&x, Some(&skip)), &conv3x3_weights(&w, 2 * cout, cin), &b, c, chunk);
                assert_eq!(got.len(), want.len(), "{c:?}");
                let worst = got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0, f64::max);
                assert!(worst < 1e-5, "{c:?} with skip and GLU: worst error {worst:e}");
            }
        }
    }

    #[test]
    fn check_refuses_bad_shapes() {
        let c = Conv3x3 { batch: 1, cin: 2, cout: 3, height: 4, width: 5, pad_h: 1, pad_w: 1, glu: false };
        assert_eq!(c.check(), Ok([4, 5]));
        assert_eq!(Conv3x3 { pad_h: 0, pad_w: 0, ..c }.check(), Ok([2, 3]));
        assert_eq!(Conv3x3 { cin: 0, ..c }.check(), Err(ShapeError::Zero { kernel: K, field: "cin" }));
        assert_eq!(
            Conv3x3 { height: 1, pad_h: 0, ..c }.check(),
            Err(ShapeError::KernelTooLong { kernel: K, span: 3, padded: 1 })
        );
        assert!(matches!(Conv3x3 { pad_w: usize::MAX / 2 + 1, ..c }.check(), Err(ShapeError::Overflow { .. })));
        assert!(matches!(Conv3x3 { batch: 1 << 40, cin: 1 << 40, ..c }.check(), Err(ShapeError::Overflow { .. })));
        assert_eq!(Conv3x3 { glu: true, ..c }.check(), Err(ShapeError::OddGlu { kernel: K, channels: 3 }));
        assert_eq!(Conv3x3 { glu: true, cout: 4, ..c }.check(), Ok([4, 5]));
    }

    #[test]
    #[should_panic(expected = "conv3x3: the skip input: 39 values where the shape says 40")]
    fn conv3x3_panics_before_reading_a_short_skip() {
        let c = Conv3x3 { batch: 1, cin: 2, cout: 3, height: 4, width: 5, pad_h: 1, pad_w: 1, glu: false };
        conv3x3(&[0.0; 40], Some(&[0.0; 39]), &[0.0; 96], &[0.0; 3], c);
    }

    #[test]
    #[should_panic(expected = "conv3x3: the transformed weights: 9 values where the shape says 96")]
    fn conv3x3_panics_before_reading_short_weights() {
        let c = Conv3x3 { batch: 1, cin: 2, cout: 3, height: 4, width: 5, pad_h: 1, pad_w: 1, glu: false };
        conv3x3(&[0.0; 40], None, &[0.0; 9], &[0.0; 3], c);
    }
}
