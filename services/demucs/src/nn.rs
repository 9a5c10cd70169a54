//! The PyTorch primitives HTDemucs is built from, as small Burn blocks whose weights
//! come from a [`StateDict`] under PyTorch's own names: `nn.Conv1d`, `nn.Conv2d`,
//! `nn.ConvTranspose1d`, `nn.ConvTranspose2d`, `nn.GroupNorm`, `nn.LayerNorm`,
//! `nn.Linear` and demucs's `LayerScale`.
//!
//! Each has a `*Config` with `init(&device)` (zero weights of the right shapes) and a
//! `load(self, &mut StateDict)` that moves the checkpoint's weights in, checking shapes.
//! Reductions (norm statistics) are two-pass (mean, then mean of squared deviations) as
//! PyTorch does, with the biased variance of `GroupNorm`/`LayerNorm` and eps 1e-5.
//!
//! Weights are [`Param`]s: kept on the device in `f32`, or in `f16` when the model was
//! loaded with [`WeightPrecision::Half`] (half the memory; the official checkpoints are
//! stored in `f16`, so nothing is lost for them). Every use widens a weight back to
//! `f32`, so the arithmetic is the same either way.

use burn::tensor::backend::Backend;
use burn::tensor::module::{conv1d, conv2d, conv_transpose1d, conv_transpose2d};
use burn::tensor::ops::{ConvOptions, ConvTransposeOptions};
use burn::tensor::{FloatDType, Tensor, TensorData};
use std::sync::{Arc, OnceLock};

use crate::checkpoint::{HostTensor, StateDict};
use crate::error::DemucsError;

/// Moves a host tensor to the device.
pub fn to_device<B: Backend, const D: usize>(t: HostTensor, device: &B::Device) -> Tensor<B, D> {
    let shape: [usize; D] = t.shape.clone().try_into().expect("rank checked by StateDict::take");
    Tensor::from_data(TensorData::new(t.data, shape), device)
}

/// Copies a tensor back to the host.
pub fn to_host<B: Backend, const D: usize>(t: Tensor<B, D>) -> HostTensor {
    let shape = t.dims().to_vec();
    let data = t.into_data().convert::<f32>().into_vec::<f32>().expect("float tensor data");
    HostTensor { shape, data }
}

/// The type a model keeps its weights in on its device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WeightPrecision {
    /// `f32`, as the arithmetic runs.
    #[default]
    Full,
    /// `f16`: half the device memory, widened to `f32` at each use. Lossless for
    /// checkpoints stored in `f16` (the official ones); others are rounded once, at load.
    Half,
}

impl WeightPrecision {
    /// `"f32"` or `"f16"`.
    pub fn as_str(self) -> &'static str {
        match self {
            WeightPrecision::Full => "f32",
            WeightPrecision::Half => "f16",
        }
    }
}

impl std::str::FromStr for WeightPrecision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "full" => Ok(WeightPrecision::Full),
            "f16" | "half" => Ok(WeightPrecision::Half),
            _ => Err(format!("`{s}` is not a weight precision (f32 or f16)")),
        }
    }
}

/// A weight as the device keeps it ([`WeightPrecision`]); [`Param::val`] gives it in
/// `f32` for the arithmetic.
#[derive(Debug, Clone)]
pub struct Param<B: Backend, const D: usize> {
    tensor: Tensor<B, D>,
}

impl<B: Backend, const D: usize> Param<B, D> {
    /// Keeps a tensor as it is (`f32`).
    pub fn new(tensor: Tensor<B, D>) -> Self {
        Param { tensor }
    }
    /// Keeps a tensor in `precision`.
    pub fn with_precision(tensor: Tensor<B, D>, precision: WeightPrecision) -> Self {
        match precision {
            WeightPrecision::Full => Param { tensor },
            WeightPrecision::Half => Param { tensor: tensor.cast(FloatDType::F16) },
        }
    }
    /// The weight in `f32` (a no-op for a weight kept in `f32`).
    pub fn val(&self) -> Tensor<B, D> {
        self.tensor.clone().cast(FloatDType::F32)
    }
    /// Its shape.
    pub fn dims(&self) -> [usize; D] {
        self.tensor.dims()
    }
    /// Its device.
    pub fn device(&self) -> B::Device {
        self.tensor.device()
    }
    /// Bytes it takes on the device.
    pub fn bytes(&self) -> u64 {
        (self.tensor.shape().num_elements() * self.tensor.dtype().size()) as u64
    }
    /// Its values on the host, in `f32` (for the CPU's host kernels).
    pub fn host(&self) -> Vec<f32> {
        crate::cpu::host_vec(self.val())
    }
}

impl<B: Backend, const D: usize> From<Tensor<B, D>> for Param<B, D> {
    fn from(tensor: Tensor<B, D>) -> Self {
        Param::new(tensor)
    }
}

/// `t` transposed, laid out row-major: a weight kept in f32 then has the layout of one
/// widened from f16 at each use, so both give the same sums bit for bit.
pub fn transposed<B: Backend>(t: Tensor<B, 2>) -> Tensor<B, 2> {
    let device = t.device();
    Tensor::from_data(t.transpose().into_data(), &device)
}

fn load_param<B: Backend, const D: usize>(
    state: &mut StateDict,
    name: &str,
    target: &Param<B, D>,
) -> Result<Param<B, D>, DemucsError> {
    let t = state.take(name, &target.dims())?;
    Ok(state.param(to_device(t, &target.device())))
}

/// `x + skip`, or `x` alone (a decoder layer without a skip).
pub fn add_skip<B: Backend, const D: usize>(x: Tensor<B, D>, skip: Option<Tensor<B, D>>) -> Tensor<B, D> {
    match skip {
        Some(s) => x + s,
        None => x,
    }
}

/// `nn.Conv1d`: weight `[out, in, k]`, bias `[out]`; input `[B, in, L]` →
/// `[B, out, (L + 2p − d(k − 1) − 1) / s + 1]`.
#[derive(Debug, Clone)]
pub struct Conv1d<B: Backend> {
    /// `[out, in, k]`.
    pub weight: Param<B, 3>,
    /// `[out]`.
    pub bias: Param<B, 1>,
    options: ConvOptions<1>,
}

/// Shape of a [`Conv1d`].
#[derive(Debug, Clone)]
pub struct Conv1dConfig {
    /// Input channels.
    pub chin: usize,
    /// Output channels.
    pub chout: usize,
    /// Kernel size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Zero padding on both sides.
    pub padding: usize,
    /// Dilation.
    pub dilation: usize,
}

impl Conv1dConfig {
    /// A stride-1, unpadded convolution.
    pub fn new(chin: usize, chout: usize, kernel: usize) -> Self {
        Conv1dConfig { chin, chout, kernel, stride: 1, padding: 0, dilation: 1 }
    }
    /// Sets the stride.
    pub fn with_stride(mut self, s: usize) -> Self {
        self.stride = s;
        self
    }
    /// Sets the padding.
    pub fn with_padding(mut self, p: usize) -> Self {
        self.padding = p;
        self
    }
    /// Sets the dilation.
    pub fn with_dilation(mut self, d: usize) -> Self {
        self.dilation = d;
        self
    }
    /// Zero weights.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Conv1d<B> {
        Conv1d {
            weight: Tensor::zeros([self.chout, self.chin, self.kernel], device).into(),
            bias: Tensor::zeros([self.chout], device).into(),
            options: ConvOptions::new([self.stride], [self.padding], [self.dilation], 1),
        }
    }
}

impl<B: Backend> Conv1d<B> {
    /// Takes `weight` and `bias`.
    pub fn load(mut self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        self.weight = load_param(state, &format!("{prefix}.weight"), &self.weight)?;
        self.bias = load_param(state, &format!("{prefix}.bias"), &self.bias)?;
        Ok(self)
    }
    /// `[B, in, L]` → `[B, out, L']`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [n, cin, len] = x.dims();
        if let Some(c) = self.host_conv(n, cin, 1, len, 1) {
            return host_conv(x, &self.weight.val(), &self.bias.val(), [n, c.cout, c.out_len()], |x, w, b| {
                crate::cpu::conv_axis(x, w, b, c)
            });
        }
        conv1d(x, self.weight.val(), Some(self.bias.val()), self.options.clone())
    }

    /// `glu(conv(x + skip))` (`nn.GLU(dim=1)`): the rewrites of the time layers. On the
    /// CPU, for a stride-1 kernel of odd size that keeps the length, one chunked pass
    /// ([`crate::cpu::conv_glu()`]); three steps elsewhere.
    pub fn forward_sum_glu(&self, x: Tensor<B, 3>, skip: Option<Tensor<B, 3>>) -> Tensor<B, 3> {
        let [cout, _, kernel] = self.weight.dims();
        let o = &self.options;
        let plain = o.stride[0] == 1 && o.dilation[0] == 1 && kernel % 2 == 1 && o.padding[0] == kernel / 2;
        if crate::cpu::is_cpu::<B>() && plain {
            if let Some(y) = host_conv_glu(&x, skip.as_ref(), &self.weight.val(), &self.bias.val(), cout) {
                return y;
            }
        }
        crate::cpu::glu(self.forward(add_skip(x, skip)))
    }

    /// The host kernel's shape, on the CPU backend and for kernels wider than 1 (Flex
    /// already runs 1×1 convolutions as one gemm).
    fn host_conv(
        &self,
        batch: usize,
        cin: usize,
        rows: usize,
        len: usize,
        inner: usize,
    ) -> Option<crate::cpu::ConvAxis> {
        let [cout, _, kernel] = self.weight.dims();
        let o = &self.options;
        let ok = crate::cpu::is_cpu::<B>() && kernel > 1 && (o.stride[0] == 1 || o.dilation[0] == 1);
        ok.then_some(crate::cpu::ConvAxis {
            batch,
            cin,
            cout,
            rows,
            len,
            inner,
            kernel,
            stride: o.stride[0],
            pad: o.padding[0],
            dilation: o.dilation[0],
            inner_kernel: 1,
            inner_pad: 0,
        })
    }

    /// The same convolution along the last axis of every row `f` of `[B, in, F, L]`
    /// (a `[1, k]` Conv2d), equal to running it on `[B·F, in, L]` without permuting.
    pub fn forward_rows(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [n, cin, f, len] = x.dims();
        if let Some(c) = self.host_conv(n, cin, f, len, 1) {
            return host_conv(x, &self.weight.val(), &self.bias.val(), [n, c.cout, f, c.out_len()], |x, w, b| {
                crate::cpu::conv_axis(x, w, b, c)
            });
        }
        let o = &self.options;
        let w: Tensor<B, 4> = self.weight.val().unsqueeze_dim(2);
        conv2d(
            x,
            w,
            Some(self.bias.val()),
            ConvOptions::new([1, o.stride[0]], [0, o.padding[0]], [1, o.dilation[0]], 1),
        )
    }
}

/// Runs one of the host convolution kernels (`conv_axis`, `conv_transpose_axis`) on CPU
/// tensors: input, weights and bias read in place, the result shaped `out`.
fn host_conv<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: &Tensor<B, 3>,
    bias: &Tensor<B, 1>,
    out: [usize; D],
    kernel: impl FnOnce(&[f32], &[f32], &[f32]) -> Vec<f32>,
) -> Tensor<B, D> {
    use crate::cpu::with_host;
    let device = x.device();
    let y = with_host(&x, |x| with_host(weight, |w| with_host(bias, |b| kernel(x, w, b))));
    Tensor::from_data(TensorData::new(y, out), &device)
}

/// [`crate::cpu::conv_glu()`] on CPU tensors `x` (and `skip`, the same shape) `[B, in, L]`
/// with `weight` `[cout, in, k]`: `[B, cout / 2, L]`, or `None` where the kernel refuses
/// the shapes (an odd `cout`, a skip of another shape).
fn host_conv_glu<B: Backend>(
    x: &Tensor<B, 3>,
    skip: Option<&Tensor<B, 3>>,
    weight: &Tensor<B, 3>,
    bias: &Tensor<B, 1>,
    cout: usize,
) -> Option<Tensor<B, 3>> {
    use crate::cpu::with_host;
    let [n, cin, len] = x.dims();
    let [_, wcin, kernel] = weight.dims();
    let c = crate::cpu::ConvGlu { batch: n, cin, cout, len, kernel };
    if wcin != cin || c.check().is_err() || skip.is_some_and(|s| s.dims() != x.dims()) {
        return None;
    }
    let y = with_host(x, |x| {
        with_host(weight, |w| {
            with_host(bias, |b| match skip {
                Some(s) => with_host(s, |s| crate::cpu::conv_glu(x, Some(s), w, b, c)),
                None => crate::cpu::conv_glu(x, None, w, b, c),
            })
        })
    });
    Some(Tensor::from_data(TensorData::new(y, [n, cout / 2, len]), &x.device()))
}

/// `nn.Conv2d`: weight `[out, in, kh, kw]`; input `[B, in, H, W]`.
#[derive(Debug, Clone)]
pub struct Conv2d<B: Backend> {
    /// `[out, in, kh, kw]`.
    pub weight: Param<B, 4>,
    /// `[out]`.
    pub bias: Param<B, 1>,
    options: ConvOptions<2>,
    /// The Winograd transform of `weight` (3×3 kernels on the CPU), made by the first
    /// forward pass after [`Conv2d::load`] and shared by clones made after it.
    winograd: OnceLock<Arc<[f32]>>,
}

/// Shape of a [`Conv2d`].
#[derive(Debug, Clone)]
pub struct Conv2dConfig {
    /// Input channels.
    pub chin: usize,
    /// Output channels.
    pub chout: usize,
    /// Kernel `[kh, kw]`.
    pub kernel: [usize; 2],
    /// Stride.
    pub stride: [usize; 2],
    /// Padding.
    pub padding: [usize; 2],
}

impl Conv2dConfig {
    /// Zero weights.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Conv2d<B> {
        Conv2d {
            weight: Tensor::zeros([self.chout, self.chin, self.kernel[0], self.kernel[1]], device).into(),
            bias: Tensor::zeros([self.chout], device).into(),
            options: ConvOptions::new(self.stride, self.padding, [1, 1], 1),
            winograd: OnceLock::new(),
        }
    }
}

impl<B: Backend> Conv2d<B> {
    /// Takes `weight` and `bias`.
    pub fn load(mut self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        self.weight = load_param(state, &format!("{prefix}.weight"), &self.weight)?;
        self.bias = load_param(state, &format!("{prefix}.bias"), &self.bias)?;
        self.winograd = OnceLock::new();
        Ok(self)
    }
    /// `[B, in, H, W]` → `[B, out, H', W']`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [cout, _, kh, kw] = self.weight.dims();
        let o = &self.options;
        // On the CPU, the host kernels: Winograd for the decoders' [3, 3] rewrite, the
        // axis kernel for the encoders' [k, 1] kernels over frequency and other shapes
        // (stride 1 along time, no dilation).
        let plain = o.dilation == [1, 1] && o.groups == 1;
        if let Some(y) = self.winograd(&x, None, false) {
            return y;
        }
        if crate::cpu::is_cpu::<B>() && plain && (kh > 1 || kw > 1) && o.stride[1] == 1 {
            let [n, cin, h, w] = x.dims();
            let c = crate::cpu::ConvAxis {
                batch: n,
                cin,
                cout,
                rows: 1,
                len: h,
                inner: w,
                kernel: kh,
                stride: o.stride[0],
                pad: o.padding[0],
                dilation: 1,
                inner_kernel: kw,
                inner_pad: o.padding[1],
            };
            let weight = self.weight.val().reshape([cout, cin, kh * kw]);
            return host_conv(x, &weight, &self.bias.val(), [n, cout, c.out_len(), c.out_inner()], |x, w, b| {
                crate::cpu::conv_axis(x, w, b, c)
            });
        }
        conv2d(x, self.weight.val(), Some(self.bias.val()), self.options.clone())
    }

    /// `glu(conv(x + skip))` (`nn.GLU(dim=1)`): the rewrites of the frequency layers. On
    /// the CPU, one pass of the Winograd kernel for a 3×3 kernel (the decoders), of
    /// [`crate::cpu::conv_glu()`] for a 1×1 one (the encoders); three steps elsewhere.
    pub fn forward_sum_glu(&self, x: Tensor<B, 4>, skip: Option<Tensor<B, 4>>) -> Tensor<B, 4> {
        if let Some(y) = self.winograd(&x, skip.as_ref(), true) {
            return y;
        }
        // A plain 1×1 kernel (the encoders' rewrite) is a length-1 kernel over H·W.
        let [cout, cin, kh, kw] = self.weight.dims();
        let o = &self.options;
        let plain = o.stride == [1, 1] && o.padding == [0, 0] && o.groups == 1 && [kh, kw] == [1, 1];
        if crate::cpu::is_cpu::<B>() && plain {
            let [n, c, h, w] = x.dims();
            let flat = |t: Tensor<B, 4>| t.reshape([n, c, h * w]);
            let weight = self.weight.val().reshape([cout, cin, 1]);
            let skip3 = skip.clone().map(flat);
            if let Some(y) = host_conv_glu(&flat(x.clone()), skip3.as_ref(), &weight, &self.bias.val(), cout) {
                return y.reshape([n, cout / 2, h, w]);
            }
        }
        crate::cpu::glu(self.forward(add_skip(x, skip)))
    }

    /// The Winograd kernel's result, on the CPU backend for a plain 3×3 kernel of stride
    /// 1; `None` for any other convolution or backend.
    fn winograd(&self, x: &Tensor<B, 4>, skip: Option<&Tensor<B, 4>>, glu: bool) -> Option<Tensor<B, 4>> {
        let [cout, wcin, kh, kw] = self.weight.dims();
        let o = &self.options;
        let plain = o.dilation == [1, 1] && o.groups == 1 && o.stride == [1, 1] && [kh, kw] == [3, 3];
        if !(crate::cpu::is_cpu::<B>() && plain) || skip.is_some_and(|s| s.dims() != x.dims()) {
            return None;
        }
        let [n, cin, h, w] = x.dims();
        let c = crate::cpu::Conv3x3 {
            batch: n,
            cin,
            cout,
            height: h,
            width: w,
            pad_h: o.padding[0],
            pad_w: o.padding[1],
            glu,
        };
        let u = self.winograd.get_or_init(|| {
            crate::cpu::with_host(&self.weight.val(), |w| crate::cpu::conv3x3_weights(w, cout, wcin).into())
        });
        let [ho, wo] = c.out_dims();
        use crate::cpu::with_host;
        let y = with_host(x, |x| {
            with_host(&self.bias.val(), |b| match skip {
                Some(s) => with_host(s, |s| crate::cpu::conv3x3(x, Some(s), u, b, c)),
                None => crate::cpu::conv3x3(x, None, u, b, c),
            })
        });
        let planes = if glu { cout / 2 } else { cout };
        Some(Tensor::from_data(TensorData::new(y, [n, planes, ho, wo]), &x.device()))
    }
}

/// `nn.ConvTranspose1d` (no padding): weight `[in, out, k]`; `[B, in, L]` →
/// `[B, out, (L − 1)s + k]`.
#[derive(Debug, Clone)]
pub struct ConvTranspose1d<B: Backend> {
    /// `[in, out, k]`.
    pub weight: Param<B, 3>,
    /// `[out]`.
    pub bias: Param<B, 1>,
    stride: usize,
}

/// Shape of a [`ConvTranspose1d`].
#[derive(Debug, Clone)]
pub struct ConvTranspose1dConfig {
    /// Input channels.
    pub chin: usize,
    /// Output channels.
    pub chout: usize,
    /// Kernel size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
}

impl ConvTranspose1dConfig {
    /// Zero weights.
    pub fn init<B: Backend>(&self, device: &B::Device) -> ConvTranspose1d<B> {
        ConvTranspose1d {
            weight: Tensor::zeros([self.chin, self.chout, self.kernel], device).into(),
            bias: Tensor::zeros([self.chout], device).into(),
            stride: self.stride,
        }
    }
}

impl<B: Backend> ConvTranspose1d<B> {
    /// Takes `weight` and `bias`.
    pub fn load(mut self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        self.weight = load_param(state, &format!("{prefix}.weight"), &self.weight)?;
        self.bias = load_param(state, &format!("{prefix}.bias"), &self.bias)?;
        Ok(self)
    }
    /// `[B, in, L]` → `[B, out, (L − 1)s + k]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let Some(c) = self.host_axis(&x) else { return self.generic(x) };
        host_conv(x, &self.weight.val(), &self.bias.val(), [c.batch, c.cout, c.out_len()], |x, w, b| {
            crate::cpu::conv_transpose_axis(x, w, b, c)
        })
    }

    /// `forward(x)` cropped to `keep` = (start, len) samples, through GELU with `gelu`:
    /// the time decoders' last steps, fused into the kernel on the CPU
    /// ([`crate::cpu::conv_transpose_axis_crop`]).
    pub fn forward_crop(&self, x: Tensor<B, 3>, keep: (usize, usize), gelu: bool) -> Tensor<B, 3> {
        let Some(c) = self.host_axis(&x) else { return crop_gelu(self.generic(x), 2, keep, gelu) };
        host_conv(x, &self.weight.val(), &self.bias.val(), [c.batch, c.cout, keep.1], |x, w, b| {
            crate::cpu::conv_transpose_axis_crop(x, w, b, c, keep, gelu)
        })
    }

    /// The host kernel's shape for `x`, on the CPU backend.
    fn host_axis(&self, x: &Tensor<B, 3>) -> Option<crate::cpu::ConvTransposeAxis> {
        let [n, cin, len] = x.dims();
        let [_, cout, kernel] = self.weight.dims();
        crate::cpu::is_cpu::<B>().then_some(crate::cpu::ConvTransposeAxis {
            batch: n,
            cin,
            cout,
            len,
            inner: 1,
            kernel,
            stride: self.stride,
        })
    }

    /// Burn's own op.
    fn generic(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        conv_transpose1d(
            x,
            self.weight.val(),
            Some(self.bias.val()),
            ConvTransposeOptions::new([self.stride], [0], [0], [1], 1),
        )
    }
}

/// `gelu(z.narrow(dim, start, len))`, or the narrowed view alone: a decoder's crop and
/// activation of its transposed convolution's output, where the fused host kernel does
/// not run (another backend, or a GroupNorm in between).
pub fn crop_gelu<B: Backend, const D: usize>(
    z: Tensor<B, D>,
    dim: usize,
    (start, len): (usize, usize),
    gelu: bool,
) -> Tensor<B, D> {
    if gelu {
        crate::cpu::gelu_narrow(z, dim, start, len)
    } else {
        z.narrow(dim, start, len)
    }
}

/// `nn.ConvTranspose2d` (no padding): weight `[in, out, kh, kw]`.
#[derive(Debug, Clone)]
pub struct ConvTranspose2d<B: Backend> {
    /// `[in, out, kh, kw]`.
    pub weight: Param<B, 4>,
    /// `[out]`.
    pub bias: Param<B, 1>,
    stride: [usize; 2],
}

/// Shape of a [`ConvTranspose2d`].
#[derive(Debug, Clone)]
pub struct ConvTranspose2dConfig {
    /// Input channels.
    pub chin: usize,
    /// Output channels.
    pub chout: usize,
    /// Kernel.
    pub kernel: [usize; 2],
    /// Stride.
    pub stride: [usize; 2],
}

impl ConvTranspose2dConfig {
    /// Zero weights.
    pub fn init<B: Backend>(&self, device: &B::Device) -> ConvTranspose2d<B> {
        ConvTranspose2d {
            weight: Tensor::zeros([self.chin, self.chout, self.kernel[0], self.kernel[1]], device).into(),
            bias: Tensor::zeros([self.chout], device).into(),
            stride: self.stride,
        }
    }
}

impl<B: Backend> ConvTranspose2d<B> {
    /// Takes `weight` and `bias`.
    pub fn load(mut self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        self.weight = load_param(state, &format!("{prefix}.weight"), &self.weight)?;
        self.bias = load_param(state, &format!("{prefix}.bias"), &self.bias)?;
        Ok(self)
    }
    /// `[B, in, H, W]` → `[B, out, (H − 1)s + kh, (W − 1)s + kw]`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let Some(c) = self.host_axis(&x) else { return self.generic(x) };
        host_conv(x, &self.host_weight(), &self.bias.val(), [c.batch, c.cout, c.out_len(), c.inner], |x, w, b| {
            crate::cpu::conv_transpose_axis(x, w, b, c)
        })
    }

    /// Output rows along H for `h` input rows: `(h − 1)·s + kh`.
    pub fn out_rows(&self, h: usize) -> usize {
        (h - 1) * self.stride[0] + self.weight.dims()[2]
    }

    /// `forward(x)` cropped to `keep` = (start, len) rows along H, through GELU with
    /// `gelu`: the frequency decoders' last steps, fused into the kernel on the CPU for
    /// their `[k, 1]` kernels ([`crate::cpu::conv_transpose_axis_crop`]).
    pub fn forward_crop(&self, x: Tensor<B, 4>, keep: (usize, usize), gelu: bool) -> Tensor<B, 4> {
        let Some(c) = self.host_axis(&x) else { return crop_gelu(self.generic(x), 2, keep, gelu) };
        host_conv(x, &self.host_weight(), &self.bias.val(), [c.batch, c.cout, keep.1, c.inner], |x, w, b| {
            crate::cpu::conv_transpose_axis_crop(x, w, b, c, keep, gelu)
        })
    }

    /// The host kernel's shape for `x`: on the CPU backend, for the decoders' `[k, 1]`
    /// kernels over frequency (stride 1 along time).
    fn host_axis(&self, x: &Tensor<B, 4>) -> Option<crate::cpu::ConvTransposeAxis> {
        let [_, cout, kh, kw] = self.weight.dims();
        let [n, cin, h, w] = x.dims();
        (crate::cpu::is_cpu::<B>() && kw == 1 && self.stride[1] == 1).then_some(crate::cpu::ConvTransposeAxis {
            batch: n,
            cin,
            cout,
            len: h,
            inner: w,
            kernel: kh,
            stride: self.stride[0],
        })
    }

    /// The `[in, out, kh, 1]` weight as the axis kernel reads it, `[in, out, kh]`.
    fn host_weight(&self) -> Tensor<B, 3> {
        let [cin, cout, kh, _] = self.weight.dims();
        self.weight.val().reshape([cin, cout, kh])
    }

    /// Burn's own op.
    fn generic(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        conv_transpose2d(
            x,
            self.weight.val(),
            Some(self.bias.val()),
            ConvTransposeOptions::new(self.stride, [0, 0], [0, 0], [1, 1], 1),
        )
    }
}

/// Mean over the last axis of `[B, G, N]` → `[B, G, 1]`, summed in blocks of
/// [`BLOCK`] then across blocks, so long rows (GroupNorm over 500k+ values in the time
/// branch, `norm_out` over all tokens) keep f32 accuracy like PyTorch's cascade sums.
pub fn mean_last<B: Backend>(x: Tensor<B, 3>) -> Tensor<B, 3> {
    let [b, g, n] = x.dims();
    if n <= 2 * BLOCK {
        return x.mean_dim(2);
    }
    let blocks = n.div_ceil(BLOCK);
    let x = if blocks * BLOCK != n {
        let device = x.device();
        Tensor::cat(vec![x, Tensor::zeros([b, g, blocks * BLOCK - n], &device)], 2)
    } else {
        x
    };
    x.reshape([b, g, blocks, BLOCK]).sum_dim(3).sum_dim(2).reshape([b, g, 1]).div_scalar(n as f32)
}

/// Block length of [`mean_last`].
pub const BLOCK: usize = 1024;

/// `nn.GroupNorm(groups, C, eps=1e-5)` on `[B, C, ...]` (flattened to `[B, C, N]`).
#[derive(Debug, Clone)]
pub struct GroupNorm<B: Backend> {
    /// `[C]`.
    pub weight: Param<B, 1>,
    /// `[C]`.
    pub bias: Param<B, 1>,
    groups: usize,
}

/// Shape of a [`GroupNorm`].
#[derive(Debug, Clone)]
pub struct GroupNormConfig {
    /// Groups.
    pub groups: usize,
    /// Channels.
    pub channels: usize,
}

impl GroupNormConfig {
    /// Identity affine parameters.
    pub fn init<B: Backend>(&self, device: &B::Device) -> GroupNorm<B> {
        GroupNorm {
            weight: Tensor::ones([self.channels], device).into(),
            bias: Tensor::zeros([self.channels], device).into(),
            groups: self.groups,
        }
    }
}

impl<B: Backend> GroupNorm<B> {
    /// Takes `weight` and `bias`.
    pub fn load(mut self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        self.weight = load_param(state, &format!("{prefix}.weight"), &self.weight)?;
        self.bias = load_param(state, &format!("{prefix}.bias"), &self.bias)?;
        Ok(self)
    }
    /// `[B, C, N]` → `[B, C, N]`.
    pub fn forward3(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, c, n] = x.dims();
        if crate::cpu::is_cpu::<B>() {
            return self.host(x, [b, c, 1, n]);
        }
        let g = self.groups;
        let xg = x.reshape([b, g, (c / g) * n]);
        let mean = mean_last(xg.clone());
        let xc = xg - mean;
        let var = mean_last(xc.clone().powi_scalar(2));
        let y = (xc / (var + 1e-5).sqrt()).reshape([b, c, n]);
        y * self.weight.val().reshape([1, c, 1]) + self.bias.val().reshape([1, c, 1])
    }
    /// `GroupNorm(1, C)` of `[B, T, C]` as if it were `[B, C, T]` (the transformer's
    /// `norm_out`, `MyGroupNorm`): the host kernel normalises it in place, channels
    /// last, without the two transposes.
    pub fn forward_channels_last(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        assert_eq!(self.groups, 1, "channels-last norm is for GroupNorm(1, C)");
        if !crate::cpu::is_cpu::<B>() {
            return self.forward3(x.swap_dims(1, 2)).swap_dims(1, 2);
        }
        let (dims, device) = (x.dims(), x.device());
        let mut data = crate::cpu::host_vec(x);
        let (w, b) = (self.weight.host(), self.bias.host());
        crate::cpu::group_norm_channels_last_in_place(&mut data, &w, &b, dims[0], dims[2]);
        Tensor::from_data(TensorData::new(data, dims), &device)
    }
    /// One-group norm of each row `f` of `[B, C, F, T]` over its `(C, T)` values (what
    /// `GroupNorm(1, C)` does on `[B·F, C, T]`).
    pub fn forward_rows(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        assert_eq!(self.groups, 1, "row norm is for GroupNorm(1, C)");
        let [b, c, f, t] = x.dims();
        if crate::cpu::is_cpu::<B>() {
            return self.host(x, [b, c, f, t]);
        }
        // Statistics per (b, f), materialised as contiguous [B, C, F, 1] so every
        // full-size op is a per-row-scalar broadcast (the backend's fast path).
        let mean = x.clone().mean_dim(3).mean_dim(1).repeat_dim(1, c);
        let xc = x - mean;
        let var = xc.clone().powi_scalar(2).mean_dim(3).mean_dim(1);
        let inv = (var + 1e-5).sqrt().recip(); // [B, 1, F, 1]
        let w = self.weight.val().reshape([1, c, 1, 1]);
        let a = (inv * w).reshape([b, c, f, 1]); // w[c] / std[b, f]
        let bias = self.bias.val().reshape([1, c, 1, 1]).repeat_dim(0, b).repeat_dim(2, f);
        xc * a + bias
    }

    /// The CPU backend's kernel ([`crate::cpu::group_norm_in_place`]).
    fn host<const D: usize>(&self, x: Tensor<B, D>, shape: [usize; 4]) -> Tensor<B, D> {
        let (dims, device) = (x.dims(), x.device());
        let mut data = crate::cpu::host_vec(x);
        let (w, b) = (self.weight.host(), self.bias.host());
        crate::cpu::group_norm_in_place(&mut data, &w, &b, shape, self.groups);
        Tensor::from_data(TensorData::new(data, dims), &device)
    }

    /// `[B, C, H, W]` → `[B, C, H, W]`.
    pub fn forward4(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, c, h, w] = x.dims();
        self.forward3(x.reshape([b, c, h * w])).reshape([b, c, h, w])
    }
}

/// `nn.LayerNorm(C, eps=1e-5)` over the last dimension of `[B, T, C]`.
#[derive(Debug, Clone)]
pub struct LayerNorm<B: Backend> {
    /// `[C]`.
    pub weight: Param<B, 1>,
    /// `[C]`.
    pub bias: Param<B, 1>,
}

/// Shape of a [`LayerNorm`].
#[derive(Debug, Clone)]
pub struct LayerNormConfig {
    /// Channels.
    pub channels: usize,
}

impl LayerNormConfig {
    /// Identity affine parameters.
    pub fn init<B: Backend>(&self, device: &B::Device) -> LayerNorm<B> {
        LayerNorm {
            weight: Tensor::ones([self.channels], device).into(),
            bias: Tensor::zeros([self.channels], device).into(),
        }
    }
}

impl<B: Backend> LayerNorm<B> {
    /// Takes `weight` and `bias`.
    pub fn load(mut self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        self.weight = load_param(state, &format!("{prefix}.weight"), &self.weight)?;
        self.bias = load_param(state, &format!("{prefix}.bias"), &self.bias)?;
        Ok(self)
    }
    /// `[B, T, C]` → `[B, T, C]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let c = x.dims()[2];
        if crate::cpu::is_cpu::<B>() {
            let (dims, device) = (x.dims(), x.device());
            let mut data = crate::cpu::host_vec(x);
            crate::cpu::layer_norm_in_place(&mut data, &self.weight.host(), &self.bias.host(), c);
            return Tensor::from_data(TensorData::new(data, dims), &device);
        }
        let mean = x.clone().mean_dim(2);
        let xc = x - mean;
        let var = xc.clone().powi_scalar(2).mean_dim(2);
        let y = xc / (var + 1e-5).sqrt();
        y * self.weight.val().reshape([1, 1, c]) + self.bias.val().reshape([1, 1, c])
    }
}

/// `nn.Linear`: weight `[out, in]`, bias `[out]`; `[B, T, in]` → `[B, T, out]`.
#[derive(Debug, Clone)]
pub struct Linear<B: Backend> {
    /// `[in, out]` (transposed once at load).
    pub weight_t: Param<B, 2>,
    /// `[out]`.
    pub bias: Param<B, 1>,
}

/// Shape of a [`Linear`].
#[derive(Debug, Clone)]
pub struct LinearConfig {
    /// Input features.
    pub din: usize,
    /// Output features.
    pub dout: usize,
}

impl LinearConfig {
    /// Zero weights.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Linear<B> {
        Linear {
            weight_t: Tensor::zeros([self.din, self.dout], device).into(),
            bias: Tensor::zeros([self.dout], device).into(),
        }
    }
}

impl<B: Backend> Linear<B> {
    /// Takes `weight` (`[out, in]`) and `bias`.
    pub fn load(self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        let [din, dout] = self.weight_t.dims();
        let device = self.weight_t.device();
        let w = state.take(&format!("{prefix}.weight"), &[dout, din])?;
        let b = state.take(&format!("{prefix}.bias"), &[dout])?;
        Ok(Self::from_host(w, b, state, &device))
    }
    /// From a PyTorch `[out, in]` weight and `[out]` bias, kept in `state`'s precision.
    pub fn from_host(w: HostTensor, b: HostTensor, state: &mut StateDict, device: &B::Device) -> Self {
        let w: Tensor<B, 2> = to_device(w, device);
        Linear { weight_t: state.param(transposed(w)), bias: state.param(to_device(b, device)) }
    }
    /// `[B, T, in]` → `[B, T, out]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, din] = x.dims();
        let dout = self.weight_t.dims()[1];
        if crate::cpu::is_cpu::<B>() {
            use crate::cpu::with_host;
            let device = x.device();
            let y = with_host(&x, |x| {
                with_host(&self.weight_t.val(), |w| {
                    with_host(&self.bias.val(), |bias| crate::cpu::linear(x, w, bias, b * t, din, dout))
                })
            });
            return Tensor::from_data(TensorData::new(y, [b, t, dout]), &device);
        }
        let y = x.reshape([b * t, din]).matmul(self.weight_t.val());
        (y + self.bias.val().reshape([1, dout])).reshape([b, t, dout])
    }
}

/// demucs `LayerScale`: a per-channel `scale` `[C]`.
#[derive(Debug, Clone)]
pub struct LayerScale<B: Backend> {
    /// `[C]`.
    pub scale: Param<B, 1>,
}

impl<B: Backend> LayerScale<B> {
    /// Zero scale.
    pub fn init(channels: usize, device: &B::Device) -> Self {
        LayerScale { scale: Tensor::zeros([channels], device).into() }
    }
    /// Takes `scale`.
    pub fn load(mut self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        self.scale = load_param(state, &format!("{prefix}.scale"), &self.scale)?;
        Ok(self)
    }
    /// Channels first: `[B, C, T]`.
    pub fn forward_cf(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let c = self.scale.dims()[0];
        x * self.scale.val().reshape([1, c, 1])
    }
    /// Channels last: `[B, T, C]`.
    pub fn forward_cl(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let c = self.scale.dims()[0];
        x * self.scale.val().reshape([1, 1, c])
    }
    /// The residual step `x + scale · y`, channels last (`[B, T, C]`): on the CPU one
    /// pass over the values, written into `y`'s buffer, instead of a broadcast multiply
    /// and an add.
    pub fn residual_cl(&self, x: Tensor<B, 3>, y: Tensor<B, 3>) -> Tensor<B, 3> {
        if !crate::cpu::is_cpu::<B>() {
            return x + self.forward_cl(y);
        }
        assert_eq!(x.dims(), y.dims(), "residual: shapes");
        let (dims, device) = (y.dims(), y.device());
        let mut out = crate::cpu::host_vec(y);
        let scale = self.scale.host();
        crate::cpu::with_host(&x, |x| {
            for (o, xs) in out.chunks_exact_mut(dims[2]).zip(x.chunks_exact(dims[2])) {
                for ((o, &xv), &s) in o.iter_mut().zip(xs).zip(scale.iter()) {
                    *o = xv + s * *o;
                }
            }
        });
        Tensor::from_data(TensorData::new(out, dims), &device)
    }
}
