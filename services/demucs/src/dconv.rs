//! Port of `demucs.demucs.DConv`: the residual branch of dilated convolutions inside
//! every encoder and decoder layer.
//!
//! Each of the `depth` layers is PyTorch's `nn.Sequential` with parameters at indices
//! `.0 .1 .3 .4 .6` (2 = GELU and 5 = GLU have none):
//! `Conv1d(C → C/comp, k3, dilation 2^d, pad 2^d)` → `GroupNorm(1)` → GELU →
//! `Conv1d(C/comp → 2C, 1)` → `GroupNorm(1)` → GLU → `LayerScale(C)`; `x = x + layer(x)`.
//! Input and output `[N, C, T]` (the frequency branch folds its frequencies into N).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::checkpoint::StateDict;
use crate::cpu;
use crate::error::DemucsError;
use crate::nn::{Conv1d, Conv1dConfig, GroupNorm, GroupNormConfig, LayerScale};

/// Shape of a [`DConv`].
#[derive(Debug, Clone)]
pub struct DConvConfig {
    /// Channels C.
    pub channels: usize,
    /// Compression (hidden = int(C / compress)).
    pub compress: f64,
    /// Layers; negative disables dilation.
    pub depth: i64,
}

/// One residual layer of [`DConv`].
#[derive(Debug, Clone)]
pub struct DConvLayer<B: Backend> {
    conv1: Conv1d<B>,
    norm1: GroupNorm<B>,
    conv2: Conv1d<B>,
    norm2: GroupNorm<B>,
    scale: LayerScale<B>,
}

/// `DConv`: `[N, C, T]` → `[N, C, T]`.
#[derive(Debug, Clone)]
pub struct DConv<B: Backend> {
    layers: Vec<DConvLayer<B>>,
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
                }
            })
            .collect();
        DConv { layers }
    }
}

impl<B: Backend> DConv<B> {
    /// Takes `{prefix}.layers.{d}.{0,1,3,4,6}.*`.
    pub fn load(self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        let mut layers = Vec::new();
        for (d, l) in self.layers.into_iter().enumerate() {
            let p = |i: usize| format!("{prefix}.layers.{d}.{i}");
            layers.push(DConvLayer {
                conv1: l.conv1.load(state, &p(0))?,
                norm1: l.norm1.load(state, &p(1))?,
                conv2: l.conv2.load(state, &p(3))?,
                norm2: l.norm2.load(state, &p(4))?,
                scale: l.scale.load(state, &p(6))?,
            });
        }
        Ok(DConv { layers })
    }

    /// The branch on every frequency row of `[B, C, F, T]` (PyTorch folds F into the
    /// batch: `[B·F, C, T]`); computed in place with `[1, k]` convolutions.
    pub fn forward_rows(&self, mut x: Tensor<B, 4>) -> Tensor<B, 4> {
        for l in &self.layers {
            let y = l.conv1.forward_rows(x.clone());
            let y = cpu::gelu(l.norm1.forward_rows(y));
            let y = l.conv2.forward_rows(y);
            x = cpu::glu_scale_add(x, l.norm2.forward_rows(y), l.scale.scale.clone());
        }
        x
    }

    /// `[N, C, T]` → `[N, C, T]`.
    pub fn forward(&self, mut x: Tensor<B, 3>) -> Tensor<B, 3> {
        for l in &self.layers {
            let y = l.conv1.forward(x.clone());
            let y = cpu::gelu(l.norm1.forward3(y));
            let y = l.conv2.forward(y);
            x = cpu::glu_scale_add(x, l.norm2.forward3(y), l.scale.scale.clone());
        }
        x
    }
}
