//! Activations on host memory: the exact GELU, `nn.GLU(dim=1)`, and DConv's last step
//! (GLU, LayerScale and the residual add) fused into one pass. The slice kernels run on
//! any backend's data; the tensor wrappers take the host path on the CPU backend and
//! Burn's own ops elsewhere.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::math::{erf, exp};
use super::{host_vec, is_cpu};

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

/// `gelu(t.narrow(dim, start, len))`: the decoders' crop and GELU. On the CPU backend one
/// pass reads the kept rows of each block in place and writes them activated (no
/// strided copy of the view first); elsewhere Burn's ops.
pub fn gelu_narrow<B: Backend, const D: usize>(t: Tensor<B, D>, dim: usize, start: usize, len: usize) -> Tensor<B, D> {
    let mut dims = t.dims();
    if !is_cpu::<B>() || (start, len) == (0, dims[dim]) || start.checked_add(len).is_none_or(|end| end > dims[dim]) {
        return gelu(t.narrow(dim, start, len));
    }
    let (outer, inner) = (dims[..dim].iter().product::<usize>(), dims[dim + 1..].iter().product::<usize>());
    let axis = dims[dim];
    dims[dim] = len;
    let device = t.device();
    let out = super::with_host(&t, |x| {
        let mut out = vec![0f32; outer * len * inner];
        for (o, dst) in out.chunks_exact_mut(len * inner).enumerate() {
            dst.copy_from_slice(&x[(o * axis + start) * inner..][..len * inner]);
            gelu_in_place(dst);
        }
        out
    });
    Tensor::from_data(TensorData::new(out, dims), &device)
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

#[inline(always)]
pub(super) fn glu_scale_add_impl(x: &mut [f32], y: &[f32], scale: &[f32], r: usize) {
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
pub(super) fn gelu_impl(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::math::tests::libm_erf;

    #[test]
    fn gelu_matches_the_definition() {
        let mut x: Vec<f32> = (-4000..4000).map(|i| i as f32 * 0.002).collect();
        let want: Vec<f64> = x.iter().map(|&v| 0.5 * v as f64 * (1.0 + libm_erf(v as f64 / 2f64.sqrt()))).collect();
        gelu_in_place(&mut x);
        let worst = x.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0f64, f64::max);
        assert!(worst < 1e-6, "worst absolute error {worst:e}");
    }

    #[test]
    fn gelu_narrow_is_gelu_of_the_narrowed_view() {
        let device = Default::default();
        let x: Vec<f32> = (0..2 * 3 * 7 * 5).map(|i| (i as f32 - 100.0) / 25.0).collect();
        let t = Tensor::<crate::CpuBackend, 4>::from_data(TensorData::new(x, [2, 3, 7, 5]), &device);
        for (dim, start, len) in [(2, 2, 3), (1, 1, 2), (3, 0, 5), (0, 1, 1)] {
            let want = host_vec(gelu(t.clone().narrow(dim, start, len)));
            let got = gelu_narrow(t.clone(), dim, start, len);
            assert_eq!(got.dims()[dim], len);
            assert_eq!(host_vec(got), want, "dim {dim}, start {start}, len {len}");
        }
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
}
