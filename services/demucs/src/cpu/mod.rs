//! Host kernels for the CPU backend, where Burn's generic CPU ops leave most of the time
//! on the table: multi-head attention (Flex runs one head at a time with a scalar
//! softmax and libm `expf`), the exact GELU (scalar libm `erff`), GLU, GroupNorm and the
//! strided/dilated convolutions. All work on plain `f32` slices; [`is_cpu`] tells the
//! model code when a backend's tensors can take this path (on CUDA the backend's own
//! fused kernels run instead).
//!
//! One module per kernel family:
//!
//! | module | owns |
//! |---|---|
//! | [`attention`](mod@attention) | `softmax(q kᵀ / √d) v` per head, on two gemm calls per query block |
//! | [`conv`] | the convolution along one axis ([`ConvAxis`]), polyphase + one gemm per tap |
//! | [`conv_glu`](mod@conv_glu) | `glu(conv(x + skip))` for the rewrites (`1×1`, time `k = 3`) in chunks: the `2C` result stays in cache |
//! | [`conv_transpose`] | the transposed convolution along one axis, one gemm per tap and output phase |
//! | [`dconv`] | one DConv layer in cache-sized chunks: convolutions, both GroupNorms, GELU, GLU, LayerScale and the residual |
//! | [`winograd`] | the 3×3 convolution by Winograd's F(2×2, 3×3): 16 gemms of 2.25× fewer FLOPs |
//! | [`norm`] | GroupNorm and LayerNorm with f64 statistics |
//! | [`activation`] | GELU, GLU and DConv's fused GLU · LayerScale + residual |
//! | [`math`] | the vectorisable `exp` and `erf` the kernels share |
//! | `simd` | run-time dispatch to AVX-512 / AVX2 builds of the hot loops (x86-64) |
//! | [`alloc`] | glibc allocator tuning for a process that runs the model |
//!
//! The results are as close to PyTorch's as Flex's were: `exp` is a Cephes-style
//! polynomial within 2 ulp of the correctly rounded value, `erf` a fitted polynomial
//! within 2e-7 absolute, and the attention sums run in the same order as the gemm calls
//! they replace (the parity tests pin all of it, block by block).
//!
//! The kernels that hand raw pointers to `gemm` ([`attention()`], [`conv_axis`]) check
//! their shapes with checked arithmetic first and panic with a [`ShapeError`] message
//! before touching memory; `*::check` returns the same error to callers that would
//! rather handle it.

use std::any::TypeId;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

#[macro_use]
mod simd;
pub mod activation;
pub mod alloc;
pub mod attention;
pub mod conv;
pub mod conv_glu;
pub mod conv_transpose;
pub mod dconv;
pub mod math;
pub mod norm;
pub mod winograd;

pub use activation::{gelu, gelu_in_place, gelu_narrow, glu, glu_scale_add, glu_scale_add_in_place};
pub use alloc::tune_allocator;
pub use attention::{attention, AttentionShape};
pub use conv::{conv_axis, ConvAxis};
pub use conv_glu::{conv_glu, ConvGlu};
pub use conv_transpose::{conv_transpose_axis, conv_transpose_axis_crop, ConvTransposeAxis};
pub use dconv::{dconv_layer_in_place, DConvShape, DConvWeights};
pub use math::{erf, exp};
pub use norm::{group_norm_channels_last_in_place, group_norm_in_place, layer_norm_in_place};
pub use winograd::{conv3x3, conv3x3_weights, Conv3x3};

/// Whether `B` is the CPU backend whose tensors are host memory ([`crate::CpuBackend`]).
/// `STEMQ_DEMUCS_GENERIC_OPS=1` turns the host kernels off (Burn's own ops everywhere),
/// to compare backends on equal terms.
pub fn is_cpu<B: Backend>() -> bool {
    static GENERIC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let generic = *GENERIC.get_or_init(|| std::env::var_os("STEMQ_DEMUCS_GENERIC_OPS").is_some_and(|v| v == "1"));
    !generic && TypeId::of::<B>() == TypeId::of::<crate::CpuBackend>()
}

/// A CPU tensor's values, row-major (a copy only where the tensor was a strided view).
pub fn host_vec<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().into_vec::<f32>().expect("the model runs in f32")
}

/// `f` on a tensor's values, row-major: borrowed in place where it is a contiguous
/// `f32` CPU tensor (a weight shared with the model, which [`host_vec`] would copy on
/// every forward pass), else copied.
pub fn with_host<B: Backend, const D: usize, R>(t: &Tensor<B, D>, f: impl FnOnce(&[f32]) -> R) -> R {
    let primitive = t.clone().into_primitive().tensor();
    let any: &dyn std::any::Any = &primitive;
    if let Some(values) = any.downcast_ref::<burn_flex::FlexTensor>().and_then(|t| t.as_slice::<f32>()) {
        return f(values);
    }
    f(&host_vec(t.clone()))
}

/// `x · w + bias` for `x` `[rows, din]`, `w` `[din, dout]`, `bias` `[dout]` (a Linear
/// layer with its weight stored transposed): the output starts as the bias rows and the
/// gemm accumulates onto them, so the bias costs no pass of its own.
///
/// # Panics
///
/// When a slice's length does not match the shape (checked before any memory is read).
pub fn linear(x: &[f32], w: &[f32], bias: &[f32], rows: usize, din: usize, dout: usize) -> Vec<f32> {
    const K: &str = "linear";
    or_panic(
        nonzero(K, &[("rows", rows), ("din", din), ("dout", dout)])
            .and_then(|()| expect_len(K, "the input", x.len(), elements(K, "the input", &[rows, din])?))
            .and_then(|()| expect_len(K, "the weights", w.len(), elements(K, "the weights", &[din, dout])?))
            .and_then(|()| expect_len(K, "the bias", bias.len(), dout))
            .and_then(|()| elements(K, "the output", &[rows, dout])),
    );
    let mut out = Vec::with_capacity(rows * dout);
    for _ in 0..rows {
        out.extend_from_slice(bias);
    }
    // SAFETY: gemm reads x as rows × din (row stride din: exactly `x`), w as din × dout
    // (row stride dout: exactly `w`), and reads then writes out as rows × dout (row
    // stride dout: exactly `out`, every value initialised above). The lengths were
    // checked above, and their element counts fit in isize bytes; `out` is a distinct
    // buffer.
    unsafe {
        gemm_rows(
            gemm::Parallelism::Rayon(0),
            rows,
            dout,
            din,
            out.as_mut_ptr(),
            dout,
            true,
            x.as_ptr(),
            din,
            w.as_ptr(),
            dout,
        );
    }
    out
}

/// Row-major `dst (m × n) = [dst +] lhs (m × k) · rhs (k × n)`: the one form of
/// `gemm::gemm` the convolution and Linear kernels use (unit column strides; `dst_rs`,
/// `lhs_rs`, `rhs_rs` are the row strides; `accumulate` adds to what `dst` holds instead
/// of overwriting it). `parallelism` is `Rayon(0)` for one large product on the pool,
/// `None` for the small products of a kernel that already runs its chunks on it.
///
/// # Safety
///
/// For each operand, every element `r · rs + c` (`r`, `c` within its rows and columns)
/// must lie within one allocation the pointer may access (`dst` for writing, and for
/// reading when `accumulate`), each of those offsets must fit in `isize` bytes, and
/// `dst` must not overlap `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_rows(
    parallelism: gemm::Parallelism,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const f32,
    lhs_rs: usize,
    rhs: *const f32,
    rhs_rs: usize,
) {
    // SAFETY: the caller's contract is gemm's, for these strides.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs,
            1,
            lhs_rs as isize,
            rhs,
            1,
            rhs_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// A buffer handed to the tasks of a parallel sweep as slices of one row each, where
/// the rows a task owns are not contiguous (every channel's columns of one chunk). Each
/// use says why no two tasks' slices overlap.
#[derive(Clone, Copy)]
pub(super) struct Rows(*mut f32);

// SAFETY: the pointer is only turned into row slices that no task writes while another
// holds them (see the SAFETY notes where they are made), and only while the `&mut` it
// came from is held by the kernel that made it.
unsafe impl Send for Rows {}
// SAFETY: as above.
unsafe impl Sync for Rows {}

impl Rows {
    /// `len` values from `offset`, to read.
    ///
    /// # Safety
    ///
    /// They must lie within the buffer, and no live `&mut` may overlap them.
    pub(super) unsafe fn get(&self, offset: usize, len: usize) -> &[f32] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(self.0.add(offset), len) }
    }

    /// `len` values from `offset`, to write.
    ///
    /// # Safety
    ///
    /// They must lie within the buffer, and no other live reference may overlap them.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn row(&self, offset: usize, len: usize) -> &mut [f32] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(offset), len) }
    }
}

thread_local! {
    /// Each thread's scratch for the chunked kernels ([`dconv`], [`conv_glu`](mod@conv_glu)).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f` on `len` values of this thread's scratch (taken out of its slot for the call, so
/// a nested use makes its own; what it held before is overwritten or ignored).
pub(super) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut z = SCRATCH.take();
    if z.len() < len {
        z.resize(len, 0.0);
    }
    let r = f(&mut z[..len]);
    SCRATCH.set(z);
    r
}

/// Shapes a pointer-based kernel ([`attention()`], [`conv_axis`]) refuses, found before
/// any memory is touched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// A size that must be at least 1 is 0.
    #[error("{kernel}: `{field}` must be at least 1")]
    Zero {
        /// The kernel.
        kernel: &'static str,
        /// The shape field.
        field: &'static str,
    },
    /// A strided convolution that is also dilated (the polyphase layout handles one).
    #[error("{kernel}: stride {stride} and dilation {dilation} together (one of them must be 1)")]
    StrideAndDilation {
        /// The kernel.
        kernel: &'static str,
        /// The stride.
        stride: usize,
        /// The dilation.
        dilation: usize,
    },
    /// The kernel's receptive field is longer than the padded input.
    #[error("{kernel}: the kernel spans {span} samples, longer than the padded input ({padded})")]
    KernelTooLong {
        /// The kernel.
        kernel: &'static str,
        /// `dilation · (kernel - 1) + 1`.
        span: usize,
        /// `len + 2 · pad`.
        padded: usize,
    },
    /// A buffer size or offset does not fit in memory (`usize`, or `isize` bytes).
    #[error("{kernel}: the size of {what} overflows")]
    Overflow {
        /// The kernel.
        kernel: &'static str,
        /// The buffer.
        what: &'static str,
    },
    /// A GLU over an odd number of channels.
    #[error("{kernel}: a GLU needs an even number of channels, not {channels}")]
    OddGlu {
        /// The kernel.
        kernel: &'static str,
        /// The channels it would split in two.
        channels: usize,
    },
    /// Output rows kept past the end of the output.
    #[error("{kernel}: rows {start} .. {start} + {len} run past the output's {out}")]
    Crop {
        /// The kernel.
        kernel: &'static str,
        /// The first row kept.
        start: usize,
        /// Rows kept.
        len: usize,
        /// Output rows.
        out: usize,
    },
    /// An even kernel where the padding must keep the length (`kernel / 2` each side).
    #[error("{kernel}: a kernel of {size} taps has no centre (it must be odd)")]
    EvenKernel {
        /// The kernel.
        kernel: &'static str,
        /// Its taps.
        size: usize,
    },
    /// A slice does not hold the number of values its shape says.
    #[error("{kernel}: {what}: {got} values where the shape says {want}")]
    Len {
        /// The kernel.
        kernel: &'static str,
        /// The argument.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length its shape implies.
        want: usize,
    },
}

/// `a · b · …` with overflow reported for `what`; also refuses element counts whose
/// `f32` buffer would exceed `isize::MAX` bytes (gemm takes strides as `isize`).
fn elements(kernel: &'static str, what: &'static str, factors: &[usize]) -> Result<usize, ShapeError> {
    let n = factors.iter().try_fold(1usize, |acc, &f| acc.checked_mul(f));
    n.filter(|n| n.checked_mul(std::mem::size_of::<f32>()).is_some_and(|b| b <= isize::MAX as usize))
        .ok_or(ShapeError::Overflow { kernel, what })
}

/// `Ok` when `got == want`.
fn expect_len(kernel: &'static str, what: &'static str, got: usize, want: usize) -> Result<(), ShapeError> {
    if got == want {
        Ok(())
    } else {
        Err(ShapeError::Len { kernel, what, got, want })
    }
}

/// The value, or a panic with the [`ShapeError`]'s message: how the pointer-based
/// kernels refuse a shape before touching memory (their `check` returns the same error
/// to callers that would rather handle it).
#[track_caller]
fn or_panic<T>(r: Result<T, ShapeError>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// `Ok` when the input, weights and bias handed to a convolution kernel hold the
/// numbers of values its shape says (`want`: input, weights, output channels).
fn expect_conv_lens(
    kernel: &'static str,
    (x, w, bias): (&[f32], &[f32], &[f32]),
    want: [usize; 3],
) -> Result<(), ShapeError> {
    expect_len(kernel, "the input", x.len(), want[0])?;
    expect_len(kernel, "the weights", w.len(), want[1])?;
    expect_len(kernel, "the bias", bias.len(), want[2])
}

/// `Ok` when every named size is at least 1.
fn nonzero(kernel: &'static str, fields: &[(&'static str, usize)]) -> Result<(), ShapeError> {
    match fields.iter().find(|(_, v)| *v == 0) {
        Some(&(field, _)) => Err(ShapeError::Zero { kernel, field }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_adds_the_bias_to_the_product() {
        let (rows, din, dout) = (5, 7, 3);
        let x: Vec<f32> = (0..rows * din).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..din * dout).map(|i| (i as f32 * 0.11).cos()).collect();
        let b = [0.5, -1.0, 2.0];
        let y = linear(&x, &w, &b, rows, din, dout);
        for r in 0..rows {
            for o in 0..dout {
                let want = b[o] as f64 + (0..din).map(|k| x[r * din + k] as f64 * w[k * dout + o] as f64).sum::<f64>();
                assert!((y[r * dout + o] as f64 - want).abs() < 1e-5, "({r}, {o}): {} vs {want}", y[r * dout + o]);
            }
        }
    }

    #[test]
    #[should_panic(expected = "linear: the bias: 2 values where the shape says 3")]
    fn linear_refuses_a_short_bias() {
        linear(&[0.0; 6], &[0.0; 6], &[0.0; 2], 3, 2, 3);
    }

    #[test]
    fn elements_refuses_overflow_and_oversized_buffers() {
        assert_eq!(elements("k", "x", &[2, 3, 4]), Ok(24));
        assert_eq!(elements("k", "x", &[]), Ok(1));
        assert_eq!(elements("k", "x", &[usize::MAX, 2]), Err(ShapeError::Overflow { kernel: "k", what: "x" }));
        // Fits in usize, but not as f32 bytes in isize.
        assert!(elements("k", "x", &[isize::MAX as usize / 2]).is_err());
    }
}
