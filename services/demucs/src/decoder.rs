//! Port of `demucs.hdemucs.HDecLayer`, as HTDemucs and Hybrid Demucs build it. Hybrid
//! Demucs adds `empty` layers (no skip, no rewrite: the transposed convolution, its norm,
//! the crop and the GELU, fed the `pre` of the last frequency layer), a last frequency
//! layer without padding (nothing cropped), and `MultiWrap` (`bands`): one copy per
//! frequency band (rewrite kernel `[1, 3]`, no crop, no GELU), their outputs
//! overlap-added by `stride` rows (one bias taken out), the outer half-strides dropped,
//! the GELU after.
//!
//! Frequency layer: `x + skip` (`[B, chin, F, T]`) → `Conv2d(chin → 2·chin, 3×3, pad 1)`
//! → (GroupNorm) → GLU → [`DConv`] over frequency rows → `ConvTranspose2d(chin → chout,
//! [k, 1], [s, 1])` → (GroupNorm) → crop `k/4` bins each side → GELU unless last:
//! `[B, chout, F·s, T]`.
//!
//! Time layer: the same with `Conv1d(k3)` and `ConvTranspose1d(k, s)`, cropped to
//! `[pad, pad + length)`: `[B, chin, T]` → `[B, chout, length]`.
//!
//! `forward_*` also returns the input of the transposed convolution (`pre` in PyTorch).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::checkpoint::StateDict;
use crate::cpu;
use crate::dconv::{DConv, DConvConfig};
use crate::encoder::dconv_freq;
use crate::error::DemucsError;
use crate::nn::{
    add_skip, crop_gelu, Conv1d, Conv1dConfig, Conv2d, Conv2dConfig, ConvTranspose1d, ConvTranspose1dConfig,
    ConvTranspose2d, ConvTranspose2dConfig, GroupNorm, GroupNormConfig,
};

/// Shape of an [`HDecLayer`].
#[derive(Debug, Clone)]
pub struct HDecLayerConfig {
    /// Input channels.
    pub chin: usize,
    /// Output channels.
    pub chout: usize,
    /// Last layer (no GELU).
    pub last: bool,
    /// Kernel size of the transposed convolution.
    pub kernel_size: usize,
    /// Stride.
    pub stride: usize,
    /// GroupNorm groups (when `norm`).
    pub norm_groups: usize,
    /// Frequency (2-D) or time (1-D) layer.
    pub freq: bool,
    /// DConv branch, with its settings.
    pub dconv: Option<DConvConfig>,
    /// GroupNorm after the convolutions.
    pub norm: bool,
    /// Context of the rewrite convolution.
    pub context: usize,
    /// Crop kernel/4 on each side.
    pub pad: bool,
    /// Rewrite convolution + GLU.
    pub rewrite: bool,
    /// No skip, rewrite or DConv: the transposed convolution alone (with its norm).
    pub empty: bool,
    /// The rewrite convolution spans frequency too (`3×3`); else `[1, 3]`.
    pub context_freq: bool,
    /// `MultiWrap`: split the frequency axis at these ratios of the bins.
    pub bands: Option<Vec<f64>>,
}

#[derive(Debug, Clone)]
enum Layers<B: Backend> {
    Freq { rewrite: Option<Conv2d<B>>, conv_tr: ConvTranspose2d<B> },
    Time { rewrite: Option<Conv1d<B>>, conv_tr: ConvTranspose1d<B> },
}

/// `HDecLayer`.
#[derive(Debug, Clone)]
pub struct HDecLayer<B: Backend> {
    layers: Layers<B>,
    norm1: Option<GroupNorm<B>>,
    norm2: Option<GroupNorm<B>>,
    dconv: Option<DConv<B>>,
    pad: usize,
    last: bool,
    empty: bool,
    stride: usize,
    /// `MultiWrap`: the split ratios and one layer per band (the fields above unused).
    ratios: Vec<f64>,
    bands: Vec<HDecLayer<B>>,
}

impl HDecLayerConfig {
    /// Zero-initialised layer.
    pub fn init<B: Backend>(&self, device: &B::Device) -> HDecLayer<B> {
        let (chin, chout, k, s, ctx) = (self.chin, self.chout, self.kernel_size, self.stride, self.context);
        let rewrite = self.rewrite && !self.empty;
        let layers = if self.freq {
            Layers::Freq {
                rewrite: rewrite.then(|| {
                    let (kf, pf) = if self.context_freq { (1 + 2 * ctx, ctx) } else { (1, 0) };
                    Conv2dConfig {
                        chin,
                        chout: 2 * chin,
                        kernel: [kf, 1 + 2 * ctx],
                        stride: [1, 1],
                        padding: [pf, ctx],
                    }
                    .init(device)
                }),
                conv_tr: ConvTranspose2dConfig { chin, chout, kernel: [k, 1], stride: [s, 1] }.init(device),
            }
        } else {
            Layers::Time {
                rewrite: rewrite.then(|| Conv1dConfig::new(chin, 2 * chin, 1 + 2 * ctx).with_padding(ctx).init(device)),
                conv_tr: ConvTranspose1dConfig { chin, chout, kernel: k, stride: s }.init(device),
            }
        };
        let norm = |c| self.norm.then(|| GroupNormConfig { groups: self.norm_groups, channels: c }.init(device));
        HDecLayer {
            layers,
            norm1: if rewrite { norm(2 * chin) } else { None },
            norm2: norm(chout),
            dconv: self.dconv.as_ref().filter(|_| !self.empty).map(|d| d.init(device)),
            pad: if self.pad { k / 4 } else { 0 },
            last: self.last,
            empty: self.empty,
            stride: s,
            ratios: self.bands.clone().unwrap_or_default(),
            bands: match &self.bands {
                Some(r) => (0..=r.len())
                    .map(|_| HDecLayerConfig { pad: false, last: true, bands: None, ..self.clone() }.init(device))
                    .collect(),
                None => Vec::new(),
            },
        }
    }
}

impl<B: Backend> HDecLayer<B> {
    /// Takes `{prefix}.rewrite`, `.norm1`, `.dconv`, `.conv_tr`, `.norm2`.
    pub fn load(self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        if !self.bands.is_empty() {
            let bands = crate::encoder::load_bands(self.bands, state, prefix, Self::load)?;
            return Ok(HDecLayer { bands, ..self });
        }
        let p = |n: &str| format!("{prefix}.{n}");
        let layers = match self.layers {
            Layers::Freq { rewrite, conv_tr } => Layers::Freq {
                rewrite: rewrite.map(|r| r.load(state, &p("rewrite"))).transpose()?,
                conv_tr: conv_tr.load(state, &p("conv_tr"))?,
            },
            Layers::Time { rewrite, conv_tr } => Layers::Time {
                rewrite: rewrite.map(|r| r.load(state, &p("rewrite"))).transpose()?,
                conv_tr: conv_tr.load(state, &p("conv_tr"))?,
            },
        };
        Ok(HDecLayer {
            layers,
            norm1: self.norm1.map(|n| n.load(state, &p("norm1"))).transpose()?,
            norm2: self.norm2.map(|n| n.load(state, &p("norm2"))).transpose()?,
            dconv: self.dconv.map(|d| d.load(state, &p("dconv"))).transpose()?,
            pad: self.pad,
            last: self.last,
            empty: self.empty,
            stride: self.stride,
            ratios: self.ratios,
            bands: self.bands,
        })
    }

    /// Frequency layer: `x`, `skip` `[B, chin, F, T]` → (`[B, chout, F·s, T]`, pre).
    pub fn forward_freq(&self, x: Tensor<B, 4>, skip: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        if !self.bands.is_empty() {
            return self.forward_bands(x, skip);
        }
        let Layers::Freq { rewrite, conv_tr } = &self.layers else { panic!("forward_freq on a time layer") };
        let skip = (!self.empty).then_some(skip);
        let y = match (rewrite, &self.norm1) {
            // No norm between them: the sum, the convolution and the GLU in one kernel.
            (Some(r), None) => r.forward_sum_glu(x, skip),
            (Some(r), Some(n)) => cpu::glu(n.forward4(r.forward(add_skip(x, skip)))),
            (None, _) => add_skip(x, skip),
        };
        let y = match &self.dconv {
            Some(d) => dconv_freq(d, y),
            None => y,
        };
        let z = match &self.norm2 {
            Some(n) => n.forward4(conv_tr.forward(y.clone())),
            // No norm: the crop and the GELU run inside the transposed convolution.
            None => {
                let f = conv_tr.out_rows(y.dims()[2]) - 2 * self.pad;
                return (conv_tr.forward_crop(y.clone(), (self.pad, f), !self.last), y);
            }
        };
        let f = z.dims()[2] - 2 * self.pad;
        (crop_gelu(z, 2, (self.pad, f), !self.last), y)
    }

    /// Time layer: `x`, `skip` `[B, chin, T]` → (`[B, chout, length]`, pre).
    pub fn forward_time(&self, x: Tensor<B, 3>, skip: Tensor<B, 3>, length: usize) -> (Tensor<B, 3>, Tensor<B, 3>) {
        self.forward_time_skip(x, Some(skip), length)
    }

    /// `MultiWrap.forward` of a decoder: the bands at `round(F·ratio)`, each through its
    /// copy (no crop, no GELU); the first `stride` rows of a band are added to the last
    /// `stride` of the previous one (less one transposed-convolution bias) and dropped;
    /// `stride/2` rows go at both outer edges; GELU unless the last layer. The `pre` is
    /// the input (PyTorch returns none; nothing reads it for these layers).
    fn forward_bands(&self, x: Tensor<B, 4>, skip: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let fr = x.dims()[2];
        let s = self.stride;
        let ratios = self.ratios.iter().copied().chain([1.0]);
        let mut start = 0usize;
        let mut outs: Vec<Tensor<B, 4>> = Vec::with_capacity(self.bands.len());
        for (ratio, layer) in ratios.zip(&self.bands) {
            let limit = if ratio == 1.0 { fr } else { crate::encoder::round_half_even(fr as f64 * ratio) as usize };
            let y = x.clone().narrow(2, start, limit - start);
            let sk = skip.clone().narrow(2, start, limit - start);
            let (mut out, _) = layer.forward_freq(y, sk);
            if let Some(prev) = outs.pop() {
                let Layers::Freq { conv_tr, .. } = &layer.layers else { unreachable!("a frequency layer") };
                let c = conv_tr.bias.dims()[0];
                let n = prev.dims()[2];
                let head = out.clone().narrow(2, 0, s) - conv_tr.bias.val().reshape([1, c, 1, 1]);
                let tail = prev.clone().narrow(2, n - s, s) + head;
                outs.push(Tensor::cat(vec![prev.narrow(2, 0, n - s), tail], 2));
                let len = out.dims()[2];
                out = out.narrow(2, s, len - s);
            }
            if ratio == 1.0 {
                let len = out.dims()[2];
                out = out.narrow(2, 0, len - s / 2);
            }
            if start == 0 {
                let len = out.dims()[2];
                out = out.narrow(2, s / 2, len - s / 2);
            }
            outs.push(out);
            start = limit;
        }
        let out = Tensor::cat(outs, 2);
        (if self.last { out } else { cpu::gelu(out) }, x)
    }

    /// Whether the layer runs along frequency (`ConvTranspose2d`) rather than time.
    pub fn is_freq(&self) -> bool {
        matches!(self.layers, Layers::Freq { .. })
    }

    /// Whether the layer takes no skip (`empty`).
    pub fn is_empty(&self) -> bool {
        self.empty
    }

    /// Time layer, `skip` `None` for an `empty` one: `[B, chin, T]` → (`[B, chout,
    /// length]`, pre).
    pub fn forward_time_skip(
        &self,
        x: Tensor<B, 3>,
        skip: Option<Tensor<B, 3>>,
        length: usize,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let Layers::Time { rewrite, conv_tr } = &self.layers else { panic!("forward_time on a frequency layer") };
        let skip = skip.filter(|_| !self.empty);
        let y = match (rewrite, &self.norm1) {
            // No norm between them: the sum, the convolution and the GLU in one kernel.
            (Some(r), None) => r.forward_sum_glu(x, skip),
            (Some(r), Some(n)) => cpu::glu(n.forward3(r.forward(add_skip(x, skip)))),
            (None, _) => add_skip(x, skip),
        };
        let y = match &self.dconv {
            Some(d) => d.forward(y),
            None => y,
        };
        let z = match &self.norm2 {
            Some(n) => n.forward3(conv_tr.forward(y.clone())),
            // No norm: the crop and the GELU run inside the transposed convolution.
            None => return (conv_tr.forward_crop(y.clone(), (self.pad, length), !self.last), y),
        };
        (crop_gelu(z, 2, (self.pad, length), !self.last), y)
    }
}
