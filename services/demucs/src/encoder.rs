//! Port of `demucs.hdemucs.HEncLayer` (no `MultiWrap`), as HTDemucs and Hybrid Demucs
//! build it. Hybrid Demucs adds `empty` layers (the convolution alone: the last time
//! layer before the branches merge) and `inject` (that layer's output added to the
//! frequency layer's convolution, broadcast over its single frequency row), and
//! `MultiWrap` (`bands`): the layer copied once per frequency band (split at the given
//! ratios of the bins, each copy unpadded, zero rows added at the outer edges), the
//! copies' outputs concatenated.
//!
//! Frequency layer: `Conv2d(chin → chout, [k, 1], [s, 1], [k/4, 0])` on
//! `[B, chin, F, T]` → `[B, chout, F/s, T]` → (GroupNorm) → GELU → [`DConv`] over
//! `B·F` rows of `[chout, T]` → `Conv2d(chout → 2·chout, 1 + 2·context)` → (GroupNorm)
//! → GLU over channels.
//!
//! Time layer: right-pad `[B, chin, L]` with zeros to a multiple of s, then the same
//! chain with `Conv1d(k, s, k/4)`: → `[B, chout, ceil(L/s)]`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::checkpoint::StateDict;
use crate::cpu;
use crate::dconv::{DConv, DConvConfig};
use crate::error::DemucsError;
use crate::nn::{Conv1d, Conv1dConfig, Conv2d, Conv2dConfig, GroupNorm, GroupNormConfig};

/// Shape of an [`HEncLayer`].
#[derive(Debug, Clone)]
pub struct HEncLayerConfig {
    /// Input channels.
    pub chin: usize,
    /// Output channels.
    pub chout: usize,
    /// Kernel size (along frequency or time).
    pub kernel_size: usize,
    /// Stride.
    pub stride: usize,
    /// GroupNorm groups (when `norm`).
    pub norm_groups: usize,
    /// Frequency (Conv2d) or time (Conv1d) layer.
    pub freq: bool,
    /// DConv branch, with its settings.
    pub dconv: Option<DConvConfig>,
    /// GroupNorm after the convolutions.
    pub norm: bool,
    /// Context of the rewrite convolution.
    pub context: usize,
    /// Pad by kernel/4.
    pub pad: bool,
    /// 1x1 rewrite + GLU.
    pub rewrite: bool,
    /// The convolution alone (no norm, GELU, DConv or rewrite).
    pub empty: bool,
    /// `MultiWrap`: split the frequency axis at these ratios of the bins, one copy of the
    /// layer per band.
    pub bands: Option<Vec<f64>>,
}

#[derive(Debug, Clone)]
enum Conv<B: Backend> {
    Freq(Conv2d<B>),
    Time(Conv1d<B>),
}

/// `HEncLayer`.
#[derive(Debug, Clone)]
pub struct HEncLayer<B: Backend> {
    conv: Conv<B>,
    norm1: Option<GroupNorm<B>>,
    rewrite: Option<Conv<B>>,
    norm2: Option<GroupNorm<B>>,
    dconv: Option<DConv<B>>,
    stride: usize,
    kernel: usize,
    empty: bool,
    /// `MultiWrap`: the split ratios and one layer per band (the fields above unused).
    ratios: Vec<f64>,
    bands: Vec<HEncLayer<B>>,
}

impl HEncLayerConfig {
    /// Zero-initialised layer.
    pub fn init<B: Backend>(&self, device: &B::Device) -> HEncLayer<B> {
        let pad = if self.pad { self.kernel_size / 4 } else { 0 };
        // `main`: the strided [k, 1] convolution; otherwise the square rewrite kernel.
        let conv = |chin, chout, k: usize, s, p: usize, main: bool| {
            if self.freq {
                let (kw, pw) = if main { (1, 0) } else { (k, p) };
                Conv::Freq(Conv2dConfig { chin, chout, kernel: [k, kw], stride: [s, 1], padding: [p, pw] }.init(device))
            } else {
                Conv::Time(Conv1dConfig::new(chin, chout, k).with_stride(s).with_padding(p).init(device))
            }
        };
        let norm = |c| self.norm.then(|| GroupNormConfig { groups: self.norm_groups, channels: c }.init(device));
        let ctx = self.context;
        let full = !self.empty;
        let ratios = self.bands.clone().unwrap_or_default();
        let bands = match &self.bands {
            Some(r) => (0..=r.len())
                .map(|_| HEncLayerConfig { pad: false, bands: None, ..self.clone() }.init(device))
                .collect(),
            None => Vec::new(),
        };
        HEncLayer {
            conv: conv(self.chin, self.chout, self.kernel_size, self.stride, pad, true),
            norm1: norm(self.chout).filter(|_| full),
            rewrite: (full && self.rewrite).then(|| conv(self.chout, 2 * self.chout, 1 + 2 * ctx, 1, ctx, false)),
            norm2: if full && self.rewrite { norm(2 * self.chout) } else { None },
            dconv: self.dconv.as_ref().filter(|_| full).map(|d| d.init(device)),
            stride: self.stride,
            kernel: self.kernel_size,
            empty: self.empty,
            ratios,
            bands,
        }
    }
}

fn load_conv<B: Backend>(c: Conv<B>, state: &mut StateDict, prefix: &str) -> Result<Conv<B>, DemucsError> {
    Ok(match c {
        Conv::Freq(c) => Conv::Freq(c.load(state, prefix)?),
        Conv::Time(c) => Conv::Time(c.load(state, prefix)?),
    })
}

fn norm4<B: Backend>(n: &Option<GroupNorm<B>>, x: Tensor<B, 4>) -> Tensor<B, 4> {
    match n {
        Some(n) => n.forward4(x),
        None => x,
    }
}

fn norm3<B: Backend>(n: &Option<GroupNorm<B>>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    match n {
        Some(n) => n.forward3(x),
        None => x,
    }
}

/// Runs a DConv over the frequency rows of `[B, C, F, T]`.
pub(crate) fn dconv_freq<B: Backend>(d: &DConv<B>, y: Tensor<B, 4>) -> Tensor<B, 4> {
    d.forward_rows(y)
}

impl<B: Backend> HEncLayer<B> {
    /// Takes `{prefix}.conv`, `.norm1`, `.rewrite`, `.norm2`, `.dconv`.
    pub fn load(self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        if !self.bands.is_empty() {
            let bands = crate::encoder::load_bands(self.bands, state, prefix, Self::load)?;
            return Ok(HEncLayer { bands, ..self });
        }
        let load_norm = |n: Option<GroupNorm<B>>, state: &mut StateDict, name: &str| {
            n.map(|n| n.load(state, &format!("{prefix}.{name}"))).transpose()
        };
        Ok(HEncLayer {
            conv: load_conv(self.conv, state, &format!("{prefix}.conv"))?,
            norm1: load_norm(self.norm1, state, "norm1")?,
            rewrite: self.rewrite.map(|r| load_conv(r, state, &format!("{prefix}.rewrite"))).transpose()?,
            norm2: load_norm(self.norm2, state, "norm2")?,
            dconv: self.dconv.map(|d| d.load(state, &format!("{prefix}.dconv"))).transpose()?,
            stride: self.stride,
            kernel: self.kernel,
            empty: self.empty,
            ratios: self.ratios,
            bands: self.bands,
        })
    }

    /// Whether the layer runs along frequency (`Conv2d`) rather than time.
    pub fn is_freq(&self) -> bool {
        matches!(self.conv, Conv::Freq(_))
    }

    /// The DConv branch, for block tests.
    pub fn dconv(&self) -> Option<&DConv<B>> {
        self.dconv.as_ref()
    }

    /// Whether the layer is the convolution alone.
    pub fn is_empty(&self) -> bool {
        self.empty
    }

    /// Frequency layer: `[B, chin, F, T]` → `[B, chout, F/s, T]`.
    pub fn forward_freq(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.forward_freq_inject(x, None)
    }

    /// [`HEncLayer::forward_freq`] with the time branch's `[B, chout, T]` added after the
    /// convolution (over every frequency row).
    pub fn forward_freq_inject(&self, x: Tensor<B, 4>, inject: Option<Tensor<B, 3>>) -> Tensor<B, 4> {
        if !self.bands.is_empty() {
            return self.forward_bands(x);
        }
        let Conv::Freq(conv) = &self.conv else { panic!("forward_freq on a time layer") };
        let y = conv.forward(x);
        if self.empty {
            return y;
        }
        let y = match inject {
            Some(i) => {
                let [b, c, t] = i.dims();
                y + i.reshape([b, c, 1, t])
            }
            None => y,
        };
        let y = cpu::gelu(norm4(&self.norm1, y));
        let y = match &self.dconv {
            Some(d) => dconv_freq(d, y),
            None => y,
        };
        match (&self.rewrite, &self.norm2) {
            (Some(Conv::Freq(r)), None) => r.forward_sum_glu(y, None),
            (Some(Conv::Freq(r)), n) => cpu::glu(norm4(n, r.forward(y))),
            _ => y,
        }
    }

    /// `MultiWrap.forward` of an encoder: each band cut so that it holds a whole number
    /// of convolution windows (its limit snapped down from `round(F·ratio)`, the next
    /// band starting where the next window would), `k/4` zero rows before the first and
    /// after the last, each through its own copy, concatenated.
    fn forward_bands(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, c, fr, t] = x.dims();
        let (k, s) = (self.kernel as i64, self.stride as i64);
        let pad = self.kernel / 4;
        let device = x.device();
        let ratios = self.ratios.iter().copied().chain([1.0]);
        let mut start = 0i64;
        let mut outs = Vec::with_capacity(self.bands.len());
        for (ratio, layer) in ratios.zip(&self.bands) {
            let limit = if ratio == 1.0 {
                fr as i64
            } else {
                let rough = round_half_even(fr as f64 * ratio) as i64;
                let le = rough - start + if start == 0 { pad as i64 } else { 0 };
                let frames = round_half_even((le - k) as f64 / s as f64 + 1.0) as i64;
                start + (frames - 1) * s + k - if start == 0 { pad as i64 } else { 0 }
            };
            let mut y = x.clone().narrow(2, start as usize, (limit - start) as usize);
            if start == 0 {
                y = Tensor::cat(vec![Tensor::zeros([b, c, pad, t], &device), y], 2);
            }
            if ratio == 1.0 {
                y = Tensor::cat(vec![y, Tensor::zeros([b, c, pad, t], &device)], 2);
            }
            outs.push(layer.forward_freq_inject(y, None));
            start = limit - k + s;
        }
        Tensor::cat(outs, 2)
    }

    /// Time layer: `[B, chin, L]` → `[B, chout, ceil(L/s)]`.
    pub fn forward_time(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let Conv::Time(conv) = &self.conv else { panic!("forward_time on a frequency layer") };
        let [b, c, le] = x.dims();
        let x = if le % self.stride != 0 {
            let extra = self.stride - le % self.stride;
            Tensor::cat(vec![x.clone(), Tensor::zeros([b, c, extra], &x.device())], 2)
        } else {
            x
        };
        let y = conv.forward(x);
        if self.empty {
            return y;
        }
        let y = cpu::gelu(norm3(&self.norm1, y));
        let y = match &self.dconv {
            Some(d) => d.forward(y),
            None => y,
        };
        match (&self.rewrite, &self.norm2) {
            (Some(Conv::Time(r)), None) => r.forward_sum_glu(y, None),
            (Some(Conv::Time(r)), n) => cpu::glu(norm3(n, r.forward(y))),
            _ => y,
        }
    }
}

/// MultiWrap's copies of a layer, each loaded from `{prefix}.layers.{k}` by `load`
/// (encoder and decoder layers alike).
pub(crate) fn load_bands<L>(
    bands: Vec<L>,
    state: &mut StateDict,
    prefix: &str,
    load: impl Fn(L, &mut StateDict, &str) -> Result<L, DemucsError>,
) -> Result<Vec<L>, DemucsError> {
    bands.into_iter().enumerate().map(|(k, l)| load(l, state, &format!("{prefix}.layers.{k}"))).collect()
}

/// Python's `round`: halves go to the even neighbour.
pub(crate) fn round_half_even(v: f64) -> f64 {
    let r = v.round();
    if (v - v.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - v.signum()
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::round_half_even;

    #[test]
    fn rounds_like_python() {
        for (v, want) in [(2.5, 2.0), (3.5, 4.0), (-2.5, -2.0), (51.2, 51.0), (153.6, 154.0), (0.5, 0.0), (1.5, 2.0)] {
            assert_eq!(round_half_even(v), want, "{v}");
        }
    }
}
