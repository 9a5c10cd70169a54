//! Port of `demucs.hdemucs.HDecLayer` (`context_freq`, no `MultiWrap`), as HTDemucs and
//! Hybrid Demucs build it. Hybrid Demucs adds `empty` layers (no skip, no rewrite: the
//! transposed convolution, its norm, the crop and the GELU, fed the `pre` of the last
//! frequency layer) and a last frequency layer without padding (nothing cropped).
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
    Conv1d, Conv1dConfig, Conv2d, Conv2dConfig, ConvTranspose1d, ConvTranspose1dConfig, ConvTranspose2d,
    ConvTranspose2dConfig, GroupNorm, GroupNormConfig,
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
}

impl HDecLayerConfig {
    /// Zero-initialised layer.
    pub fn init<B: Backend>(&self, device: &B::Device) -> HDecLayer<B> {
        let (chin, chout, k, s, ctx) = (self.chin, self.chout, self.kernel_size, self.stride, self.context);
        let rewrite = self.rewrite && !self.empty;
        let layers = if self.freq {
            Layers::Freq {
                rewrite: rewrite.then(|| {
                    Conv2dConfig {
                        chin,
                        chout: 2 * chin,
                        kernel: [1 + 2 * ctx, 1 + 2 * ctx],
                        stride: [1, 1],
                        padding: [ctx, ctx],
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
        }
    }
}

impl<B: Backend> HDecLayer<B> {
    /// Takes `{prefix}.rewrite`, `.norm1`, `.dconv`, `.conv_tr`, `.norm2`.
    pub fn load(self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
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
        })
    }

    /// Frequency layer: `x`, `skip` `[B, chin, F, T]` → (`[B, chout, F·s, T]`, pre).
    pub fn forward_freq(&self, x: Tensor<B, 4>, skip: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let Layers::Freq { rewrite, conv_tr } = &self.layers else { panic!("forward_freq on a time layer") };
        let x = if self.empty { x } else { x + skip };
        let y = match rewrite {
            Some(r) => {
                let z = r.forward(x);
                cpu::glu(match &self.norm1 {
                    Some(n) => n.forward4(z),
                    None => z,
                })
            }
            None => x,
        };
        let y = match &self.dconv {
            Some(d) => dconv_freq(d, y),
            None => y,
        };
        let z = conv_tr.forward(y.clone());
        let z = match &self.norm2 {
            Some(n) => n.forward4(z),
            None => z,
        };
        let z = if self.pad > 0 {
            let f = z.dims()[2];
            z.narrow(2, self.pad, f - 2 * self.pad)
        } else {
            z
        };
        (if self.last { z } else { cpu::gelu(z) }, y)
    }

    /// Time layer: `x`, `skip` `[B, chin, T]` → (`[B, chout, length]`, pre).
    pub fn forward_time(&self, x: Tensor<B, 3>, skip: Tensor<B, 3>, length: usize) -> (Tensor<B, 3>, Tensor<B, 3>) {
        self.forward_time_skip(x, Some(skip), length)
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
        let x = match skip {
            Some(s) if !self.empty => x + s,
            _ => x,
        };
        let y = match rewrite {
            Some(r) => {
                let z = r.forward(x);
                cpu::glu(match &self.norm1 {
                    Some(n) => n.forward3(z),
                    None => z,
                })
            }
            None => x,
        };
        let y = match &self.dconv {
            Some(d) => d.forward(y),
            None => y,
        };
        let z = conv_tr.forward(y.clone());
        let z = match &self.norm2 {
            Some(n) => n.forward3(z),
            None => z,
        };
        let z = z.narrow(2, self.pad, length);
        (if self.last { z } else { cpu::gelu(z) }, y)
    }
}
