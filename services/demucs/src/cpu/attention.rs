//! Multi-head attention on host memory: `softmax(q kᵀ / √d) v` per head, as
//! `nn.MultiheadAttention` computes it after its input projections, on two `gemm` calls
//! per (batch, head, query block) and a vectorised softmax between them.

use rayon::prelude::*;

use super::math::exp;
use super::simd::LANES;
use super::{elements, expect_len, nonzero, or_panic, ShapeError};

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
    /// Key (and value) tokens; at least 1 (a softmax over no keys has no value).
    pub tk: usize,
    /// Heads, at least 1; the model width is `heads * head_dim`.
    pub heads: usize,
    /// Width of one head, at least 1.
    pub head_dim: usize,
}

impl AttentionShape {
    /// Checks the shape against the lengths of `q`, `k` and `v`, with every size
    /// computed in checked arithmetic: `Ok` means every pointer [`attention`] derives
    /// stays inside its slice.
    pub fn check(&self, q: usize, k: usize, v: usize) -> Result<(), ShapeError> {
        const K: &str = "attention";
        let AttentionShape { batch, tq, tk, heads, head_dim } = *self;
        nonzero(K, &[("tk", tk), ("heads", heads), ("head_dim", head_dim)])?;
        expect_len(K, "the query", q, elements(K, "the query", &[batch, tq, heads, head_dim])?)?;
        expect_len(K, "the key", k, elements(K, "the key", &[batch, tk, heads, head_dim])?)?;
        expect_len(K, "the value", v, elements(K, "the value", &[batch, tk, heads, head_dim])?)?;
        elements(K, "the score block", &[QUERY_BLOCK, tk])?;
        Ok(())
    }
}

/// `softmax(q kᵀ / √d) v` per head. `q` `[B, Tq, C]`, `k`, `v` `[B, Tk, C]` (heads are
/// the `C / H` column groups, read in place: no head transposes) → `[B, Tq, C]`.
///
/// # Panics
///
/// When [`AttentionShape::check`] refuses the shape, with its message, before any
/// memory is read.
pub fn attention(q: &[f32], k: &[f32], v: &[f32], s: AttentionShape) -> Vec<f32> {
    or_panic(s.check(q.len(), k.len(), v.len()));
    let AttentionShape { batch, tq, tk, heads, head_dim } = s;
    // No product below overflows: `check` bounded each full product, and every factor
    // of those is at least 1 or the product is 0 (no tasks at all).
    let c = heads * head_dim;
    let mut out = vec![0f32; batch * tq * c];
    let scale = 1.0 / (head_dim as f32).sqrt();
    let blocks = tq.div_ceil(QUERY_BLOCK);
    // Each head's keys transposed once, `[B, H, d, Tk]`: gemm then reads Kᵀ with unit
    // stride along the keys and packs it as a plain copy, instead of gathering every
    // key's `d` values a row apart once per query block.
    let kt = transpose_heads(k, batch, tk, heads, head_dim);
    // Tasks: (batch, head, query block). Each writes its own rows x columns of `out`,
    // disjoint from every other task's.
    let out_ptr = SendPtr(out.as_mut_ptr());
    (0..batch * heads * blocks).into_par_iter().for_each(|task| {
        SCORES.with_borrow_mut(|scores| {
            // Every value read below is first written by the score gemm: the block is
            // scratch, kept per thread across calls rather than allocated (and its pages
            // cleared by the kernel) per task.
            if scores.len() < QUERY_BLOCK * tk {
                scores.resize(QUERY_BLOCK * tk, 0.0);
            }
            let (bh, blk) = (task / blocks, task % blocks);
            let (b, h) = (bh / heads, bh % heads);
            let q0 = blk * QUERY_BLOCK;
            let m = QUERY_BLOCK.min(tq - q0);
            // Safe slicing: these panic rather than leave the slices.
            let qp = q[(b * tq + q0) * c + h * head_dim..].as_ptr();
            let kp = kt[(b * heads + h) * head_dim * tk..].as_ptr();
            let vp = v[b * tk * c + h * head_dim..].as_ptr();
            let scores = &mut scores[..m * tk];
            // SAFETY: gemm reads lhs Q as m x head_dim with row stride c from `qp`: the
            // last element is (b·tq + q0 + m-1)·c + h·d + d-1 < batch·tq·c = q.len(),
            // as q0 + m <= tq and (h+1)·d <= c. It reads rhs Kᵀ as head_dim x tk with
            // row stride tk and unit column stride from `kp` in `kt`: the last element
            // is (b·H + h)·d·tk + (d-1)·tk + tk-1 < batch·H·d·tk = kt.len(). It writes
            // dst m x tk with row stride tk into `scores`, which holds at least m·tk
            // values and is this thread's alone (its thread-local, borrowed mutably for
            // this task). No argument aliases another (q, kt are shared reads).
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
                    1,
                    tk as isize,
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
            let first = (b * tq + q0) * c + h * head_dim;
            // SAFETY: `first` < batch·tq·c = out.len() (q0 < tq, h·d < c), so the offset
            // pointer stays inside `out`'s allocation, which outlives the parallel loop.
            let op = unsafe { out_ptr.get().add(first) };
            // SAFETY: gemm writes dst m x head_dim with row stride c from `op`: rows
            // q0..q0+m, columns h·d..(h+1)·d of batch b of `out`, the last element at
            // first + (m-1)·c + d-1 < out.len(). Those elements belong to this task alone
            // (tasks differ in b, h or the query block), so no other thread reads or
            // writes them meanwhile, and nothing else borrows `out` during the loop.
            // Lhs is `scores` (m x tk, ours) and rhs V is tk x head_dim with row stride c
            // from `vp`: last element (b·tk + tk-1)·c + h·d + d-1 < v.len().
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
            }
            for (i, inv) in inv.iter().take(m).enumerate() {
                // SAFETY: row i of this task's block, `head_dim` values at first + i·c,
                // in bounds and owned by this task as argued above; the gemm that wrote
                // it has returned, and this is the only live reference to it.
                let row = unsafe { std::slice::from_raw_parts_mut(op.add(i * c), head_dim) };
                row.iter_mut().for_each(|x| *x *= inv);
            }
        })
    });
    out
}

thread_local! {
    /// Each thread's score block, `[QUERY_BLOCK, tk]` for the largest `tk` it has seen.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `k` `[B, Tk, H·d]` → `[B, H, d, Tk]`.
fn transpose_heads(k: &[f32], batch: usize, tk: usize, heads: usize, head_dim: usize) -> Vec<f32> {
    let c = heads * head_dim;
    let mut kt = vec![0f32; k.len()];
    // Tiles of 16 keys keep both the reads (16 rows of c) and the writes (c rows of 16)
    // in cache lines.
    const TILE: usize = 16;
    for b in 0..batch {
        let src = &k[b * tk * c..(b + 1) * tk * c];
        let dst = &mut kt[b * tk * c..(b + 1) * tk * c];
        for t0 in (0..tk).step_by(TILE) {
            let t1 = (t0 + TILE).min(tk);
            for j in 0..c {
                let row = &mut dst[j * tk + t0..j * tk + t1];
                for (t, x) in (t0..t1).zip(row.iter_mut()) {
                    *x = src[t * c + j];
                }
            }
        }
    }
    kt
}

/// The output pointer, shared by the attention tasks.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

// SAFETY: the pointer is only dereferenced by `attention`'s tasks, each within its own
// disjoint block of the buffer, while the buffer is alive and not otherwise borrowed;
// moving the pointer value to another thread does not by itself access anything.
unsafe impl Send for SendPtr {}
// SAFETY: sharing `&SendPtr` only lets threads copy the address out (`get`); every
// access through it is to a block owned by one task (see `attention`), so no two
// threads touch the same element.
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

#[inline(always)]
pub(super) fn softmax_numerators_impl(row: &mut [f32]) -> f32 {
    let mut mx = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for ch in &mut chunks {
        for (m, &x) in mx.iter_mut().zip(ch) {
            // A plain compare (one `vmaxps`), not `f32::max`'s NaN rule, which costs
            // three more instructions a vector: a NaN score makes the row NaN either
            // way, through its own `exp`.
            *m = if x > *m { x } else { *m };
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn check_refuses_what_would_leave_the_slices() {
        let s = AttentionShape { batch: 1, tq: 2, tk: 3, heads: 2, head_dim: 4 };
        assert_eq!(s.check(16, 24, 24), Ok(()));
        assert!(matches!(s.check(15, 24, 24), Err(ShapeError::Len { what: "the query", got: 15, want: 16, .. })));
        assert!(matches!(s.check(16, 24, 23), Err(ShapeError::Len { what: "the value", .. })));
        let zero = AttentionShape { head_dim: 0, ..s };
        assert!(matches!(zero.check(0, 0, 0), Err(ShapeError::Zero { field: "head_dim", .. })));
        let no_keys = AttentionShape { tk: 0, ..s };
        assert!(matches!(no_keys.check(16, 0, 0), Err(ShapeError::Zero { field: "tk", .. })));
        // A product that wraps to a small number must not be taken for that number.
        let huge = AttentionShape { batch: 1 << 62, tq: 4, tk: 3, heads: 1, head_dim: 1 };
        assert!(matches!(huge.check(0, 0, 0), Err(ShapeError::Overflow { what: "the query", .. })));
    }

    #[test]
    #[should_panic(expected = "attention: the key: 5 values where the shape says 24")]
    fn attention_panics_before_reading_a_short_key() {
        let s = AttentionShape { batch: 1, tq: 2, tk: 3, heads: 2, head_dim: 4 };
        attention(&[0.0; 16], &[0.0; 5], &[0.0; 24], s);
    }
}
