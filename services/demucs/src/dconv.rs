//! Port of `demucs.demucs.DConv`: the residual branch of dilated convolutions inside
//! every encoder and decoder layer.
//!
//! Each of the `depth` layers is PyTorch's `nn.Sequential` with parameters at indices
//! `.0 .1 .3 .4 .6` (2 = GELU and 5 = GLU have none):
//! `Conv1d(C → C/comp, k3, dilation 2^d, pad 2^d)` → `GroupNorm(1)` → GELU →
//! `Conv1d(C/comp → 2C, 1)` → `GroupNorm(1)` → GLU → `LayerScale(C)`; `x = x + layer(x)`.
//! Hybrid Demucs (v3) inserts a [`BLstm`] and a [`LocalState`] after the GELU in its
//! deepest layers, which shifts the later indices (`.0 .1 .3 .4 .5 .6 .8` with both).
//! Input and output `[N, C, T]` (the frequency branch folds its frequencies into N).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::checkpoint::StateDict;
use crate::cpu;
use crate::error::DemucsError;
use crate::nn::{Conv1d, Conv1dConfig, GroupNorm, GroupNormConfig, LayerScale};
use crate::recurrent::{BLstm, LocalState};

/// Shape of a [`DConv`].
#[derive(Debug, Clone)]
pub struct DConvConfig {
    /// Channels C.
    pub channels: usize,
    /// Compression (hidden = int(C / compress)).
    pub compress: f64,
    /// Layers; negative disables dilation.
    pub depth: i64,
    /// A BLSTM after the GELU (v3's deepest layers).
    pub lstm: bool,
    /// A LocalState attention after the GELU (and the BLSTM).
    pub attn: bool,
}

/// One residual layer of [`DConv`].
#[derive(Debug, Clone)]
pub struct DConvLayer<B: Backend> {
    conv1: Conv1d<B>,
    norm1: GroupNorm<B>,
    conv2: Conv1d<B>,
    norm2: GroupNorm<B>,
    scale: LayerScale<B>,
    lstm: Option<BLstm<B>>,
    attn: Option<LocalState<B>>,
    /// The first convolution's dilation (and padding).
    dilation: usize,
}

/// `DConv`: `[N, C, T]` → `[N, C, T]`.
#[derive(Debug, Clone)]
pub struct DConv<B: Backend> {
    layers: Vec<DConvLayer<B>>,
    /// Channels of the hidden layer, and whether the layers hold a BLSTM / LocalState
    /// (built at load: their weights decide their shapes).
    hidden: usize,
    lstm: bool,
    attn: bool,
}

impl DConvConfig {
    /// Zero-initialised branch.
    pub fn init<B: Backend>(&self, device: &B::Device) -> DConv<B> {
        let c = self.channels;
        let hidden = (c as f64 / self.compress) as usize;
        let dilate = self.depth > 0;
        let layers = (0..self.depth.unsigned_abs() as u32)
            .map(|d| {
                let dilation = if dilate { 1usize << d } else { 1 };
                DConvLayer {
                    conv1: Conv1dConfig::new(c, hidden, 3).with_dilation(dilation).with_padding(dilation).init(device),
                    norm1: GroupNormConfig { groups: 1, channels: hidden }.init(device),
                    conv2: Conv1dConfig::new(hidden, 2 * c, 1).init(device),
                    norm2: GroupNormConfig { groups: 1, channels: 2 * c }.init(device),
                    scale: LayerScale::init(c, device),
                    lstm: None,
                    attn: None,
                    dilation,
                }
            })
            .collect();
        DConv { layers, hidden, lstm: self.lstm, attn: self.attn }
    }
}

impl<B: Backend> DConv<B> {
    /// Takes `{prefix}.layers.{d}.{0,1,3,4,6}.*` (with the BLSTM and LocalState in
    /// between when the layers have them).
    pub fn load(self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        let mut layers = Vec::new();
        let (hidden, with_lstm, with_attn) = (self.hidden, self.lstm, self.attn);
        for (d, l) in self.layers.into_iter().enumerate() {
            let p = |i: usize| format!("{prefix}.layers.{d}.{i}");
            let device = l.scale.scale.device();
            // Sequential indices: conv 0, norm 1, GELU 2, [BLSTM], [LocalState], conv,
            // norm, GLU, LayerScale.
            let mut i = 3;
            let lstm = if with_lstm {
                i += 1;
                Some(BLstm::load(state, &p(i - 1), hidden, 2, &device)?)
            } else {
                None
            };
            let attn = if with_attn {
                i += 1;
                Some(LocalState::load(state, &p(i - 1), hidden, &device)?)
            } else {
                None
            };
            layers.push(DConvLayer {
                conv1: l.conv1.load(state, &p(0))?,
                norm1: l.norm1.load(state, &p(1))?,
                conv2: l.conv2.load(state, &p(i))?,
                norm2: l.norm2.load(state, &p(i + 1))?,
                scale: l.scale.load(state, &p(i + 3))?,
                lstm,
                attn,
                dilation: l.dilation,
            });
        }
        Ok(DConv { layers, hidden, lstm: with_lstm, attn: with_attn })
    }

    /// Layer `d`'s BLSTM, for block tests.
    pub fn lstm(&self, d: usize) -> Option<&BLstm<B>> {
        self.layers.get(d).and_then(|l| l.lstm.as_ref())
    }

    /// Layer `d`'s LocalState, for block tests.
    pub fn attn(&self, d: usize) -> Option<&LocalState<B>> {
        self.layers.get(d).and_then(|l| l.attn.as_ref())
    }

    /// The branch on every frequency row of `[B, C, F, T]` (PyTorch folds F into the
    /// batch: `[B·F, C, T]`); computed in place with `[1, k]` convolutions.
    pub fn forward_rows(&self, mut x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, c, f, t] = x.dims();
        if let Some(shape) = self.host_shape(b, c, f, t) {
            return self.host(x, shape);
        }
        if self.lstm || self.attn {
            // Sequence blocks read whole rows: fold the rows into the batch.
            let rows = x.swap_dims(1, 2).reshape([b * f, c, t]);
            return self.forward(rows).reshape([b, f, c, t]).swap_dims(1, 2);
        }
        for l in &self.layers {
            let y = l.conv1.forward_rows(x.clone());
            let y = cpu::gelu(l.norm1.forward_rows(y));
            let y = l.conv2.forward_rows(y);
            x = cpu::glu_scale_add(x, l.norm2.forward_rows(y), l.scale.scale.val());
        }
        x
    }

    /// `[N, C, T]` → `[N, C, T]`.
    pub fn forward(&self, mut x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [n, c, t] = x.dims();
        if let Some(shape) = self.host_shape(n, c, 1, t) {
            return self.host(x, shape);
        }
        for l in &self.layers {
            let y = l.conv1.forward(x.clone());
            let mut y = cpu::gelu(l.norm1.forward3(y));
            if let Some(lstm) = &l.lstm {
                y = lstm.forward(y);
            }
            if let Some(attn) = &l.attn {
                y = attn.forward(y);
            }
            let y = l.conv2.forward(y);
            x = cpu::glu_scale_add(x, l.norm2.forward3(y), l.scale.scale.val());
        }
        x
    }

    /// The host kernel's shape for `[N, C, R, T]`: on the CPU backend, for layers
    /// without a BLSTM or LocalState.
    fn host_shape(&self, batch: usize, channels: usize, rows: usize, len: usize) -> Option<cpu::DConvShape> {
        let shape = |dilation| cpu::DConvShape { batch, channels, hidden: self.hidden, rows, len, dilation };
        let ok = cpu::is_cpu::<B>()
            && !self.lstm
            && !self.attn
            && self.layers.iter().all(|l| shape(l.dilation).check().is_ok());
        ok.then(|| shape(1))
    }

    /// Every layer by [`cpu::dconv_layer_in_place`], on the values of `x` `[N, C, R, T]`.
    fn host<const D: usize>(&self, x: Tensor<B, D>, shape: cpu::DConvShape) -> Tensor<B, D> {
        let (dims, device) = (x.dims(), x.device());
        let mut data = cpu::host_vec(x);
        for l in &self.layers {
            let (w1, b1) = (l.conv1.weight.host(), l.conv1.bias.host());
            let (g1, n1) = (l.norm1.weight.host(), l.norm1.bias.host());
            let (w2, b2) = (l.conv2.weight.host(), l.conv2.bias.host());
            let (g2, n2) = (l.norm2.weight.host(), l.norm2.bias.host());
            let scale = l.scale.scale.host();
            let w = cpu::DConvWeights {
                conv1: &w1,
                conv1_bias: &b1,
                norm1: (&g1, &n1),
                conv2: &w2,
                conv2_bias: &b2,
                norm2: (&g2, &n2),
                scale: &scale,
            };
            cpu::dconv_layer_in_place(&mut data, &w, cpu::DConvShape { dilation: l.dilation, ..shape });
        }
        Tensor::from_data(burn::tensor::TensorData::new(data, dims), &device)
    }
}
