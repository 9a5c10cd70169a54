//! Port of the waveform Demucs (`demucs.demucs.Demucs`, demucs 4.1.0): the time-domain
//! members of the `mdx` and `repro_mdx_a*` bags.
//!
//! `forward` on `[B, C, L]`: normalise by the mono mix's mean and (unbiased) std, pad with
//! zeros to [`valid_length`], resample ×2 ([`resample_up2`], julius), then `depth`
//! encoders — `Conv1d(k, s)` (no padding) → GroupNorm (from `norm_starts`) → GELU →
//! [`DConv`] → `Conv1d(1)` rewrite → GroupNorm → GLU — and the decoders, deepest first,
//! each on `x + center_trim(skip)`: rewrite `Conv1d(2·context + 1)` → GroupNorm → GLU →
//! (DConv) → `ConvTranspose1d(k, s)` → GroupNorm → GELU (the last layer: the transposed
//! convolution alone); resample ÷2, de-normalise, centre-trim to `L`: `[B, S, C, L]`.
//! Without `rewrite` (the `mdx` members) the rewrite convolutions are absent; without
//! `glu`/`gelu` ReLU replaces them. The resampling and the statistics run on the host in
//! `f64`, like the STFT of the hybrid models.
//!
//! PyTorch's `nn.Sequential` indices are kept when loading: the norm slots exist (as
//! `Identity`) below `norm_starts`, so later indices do not move.

use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::checkpoint::{HostTensor, StateDict};
use crate::config::HTDemucsConfig;
use crate::cpu;
use crate::dconv::{DConv, DConvConfig};
use crate::error::DemucsError;
use crate::nn::{to_host, Conv1d, Conv1dConfig, ConvTranspose1d, ConvTranspose1dConfig, GroupNorm, GroupNormConfig};

/// One encoder layer.
#[derive(Debug, Clone)]
struct Encoder<B: Backend> {
    conv: Conv1d<B>,
    norm1: Option<GroupNorm<B>>,
    dconv: Option<DConv<B>>,
    rewrite: Option<Conv1d<B>>,
    norm2: Option<GroupNorm<B>>,
}

/// One decoder layer.
#[derive(Debug, Clone)]
struct Decoder<B: Backend> {
    rewrite: Option<Conv1d<B>>,
    norm1: Option<GroupNorm<B>>,
    dconv: Option<DConv<B>>,
    conv_tr: ConvTranspose1d<B>,
    /// `None` for the last layer (index 0): no norm, no activation.
    norm2: Option<Option<GroupNorm<B>>>,
}

/// The layers of a waveform Demucs.
#[derive(Debug, Clone)]
pub struct WaveNet<B: Backend> {
    encoders: Vec<Encoder<B>>,
    /// Deepest first, as PyTorch stores them.
    decoders: Vec<Decoder<B>>,
    glu: bool,
    gelu: bool,
}

fn norm3<B: Backend>(n: &Option<GroupNorm<B>>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    match n {
        Some(n) => n.forward3(x),
        None => x,
    }
}

impl HTDemucsConfig {
    /// A zero-initialised waveform Demucs with the layout of `Demucs.__init__`.
    pub(crate) fn init_wave<B: Backend>(&self, device: &B::Device) -> Result<WaveNet<B>, DemucsError> {
        let c = self;
        if c.lstm_layers > 0 {
            return Err(DemucsError::Unsupported("lstm_layers > 0 (a BLSTM at the bottom)".into()));
        }
        let scale = if c.glu { 2 } else { 1 };
        let (mut chin, mut ch) = (c.audio_channels, c.channels);
        let (mut encoders, mut decoders) = (Vec::new(), Vec::new());
        for index in 0..c.depth {
            let norm = |d: usize| {
                (index >= c.norm_starts).then(|| GroupNormConfig { groups: c.norm_groups, channels: d }.init(device))
            };
            let dconv = |on: bool| {
                on.then(|| {
                    DConvConfig {
                        channels: ch,
                        compress: c.dconv_comp,
                        depth: c.dconv_depth,
                        lstm: index >= c.dconv_lstm,
                        attn: index >= c.dconv_attn,
                    }
                    .init(device)
                })
            };
            encoders.push(Encoder {
                conv: Conv1dConfig::new(chin, ch, c.kernel_size).with_stride(c.stride).init(device),
                norm1: norm(ch),
                dconv: dconv(c.dconv_mode & 1 != 0),
                rewrite: c.rewrite.then(|| Conv1dConfig::new(ch, scale * ch, 1).init(device)),
                norm2: if c.rewrite { norm(scale * ch) } else { None },
            });
            let out = if index > 0 { chin } else { c.sources.len() * c.audio_channels };
            let ctx = c.context;
            decoders.insert(
                0,
                Decoder {
                    rewrite: c
                        .rewrite
                        .then(|| Conv1dConfig::new(ch, scale * ch, 2 * ctx + 1).with_padding(ctx).init(device)),
                    norm1: if c.rewrite { norm(scale * ch) } else { None },
                    dconv: dconv(c.dconv_mode & 2 != 0),
                    conv_tr: ConvTranspose1dConfig { chin: ch, chout: out, kernel: c.kernel_size, stride: c.stride }
                        .init(device),
                    norm2: (index > 0).then(|| norm(out)),
                },
            );
            chin = ch;
            ch = (c.growth * ch as f64) as usize;
        }
        Ok(WaveNet { encoders, decoders, glu: c.glu, gelu: c.gelu })
    }
}

impl<B: Backend> WaveNet<B> {
    /// Takes `encoder.{i}.{k}` and `decoder.{i}.{k}` at their `nn.Sequential` indices.
    pub(crate) fn load(self, state: &mut StateDict) -> Result<Self, DemucsError> {
        let load_norm =
            |n: Option<GroupNorm<B>>, state: &mut StateDict, p: String| n.map(|n| n.load(state, &p)).transpose();
        let mut encoders = Vec::new();
        for (i, e) in self.encoders.into_iter().enumerate() {
            let p = |k: usize| format!("encoder.{i}.{k}");
            // conv 0, norm 1, activation 2, [DConv], [rewrite, norm, activation].
            let mut k = 3;
            let dconv = match e.dconv {
                Some(d) => {
                    k += 1;
                    Some(d.load(state, &p(k - 1))?)
                }
                None => None,
            };
            encoders.push(Encoder {
                conv: e.conv.load(state, &p(0))?,
                norm1: load_norm(e.norm1, state, p(1))?,
                dconv,
                rewrite: e.rewrite.map(|r| r.load(state, &p(k))).transpose()?,
                norm2: load_norm(e.norm2, state, p(k + 1))?,
            });
        }
        let mut decoders = Vec::new();
        for (i, d) in self.decoders.into_iter().enumerate() {
            let p = |k: usize| format!("decoder.{i}.{k}");
            // [rewrite 0, norm 1, activation 2], [DConv], conv_tr, [norm, activation].
            let mut k = 0;
            let (rewrite, norm1) = match d.rewrite {
                Some(r) => {
                    k = 3;
                    (Some(r.load(state, &p(0))?), load_norm(d.norm1, state, p(1))?)
                }
                None => (None, None),
            };
            let dconv = match d.dconv {
                Some(dc) => {
                    k += 1;
                    Some(dc.load(state, &p(k - 1))?)
                }
                None => None,
            };
            let conv_tr = d.conv_tr.load(state, &p(k))?;
            let norm2 = match d.norm2 {
                Some(n) => Some(load_norm(n, state, p(k + 1))?),
                None => None,
            };
            decoders.push(Decoder { rewrite, norm1, dconv, conv_tr, norm2 });
        }
        Ok(WaveNet { encoders, decoders, glu: self.glu, gelu: self.gelu })
    }

    fn act(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        if self.gelu {
            cpu::gelu(x)
        } else {
            relu(x)
        }
    }

    fn gate(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        if self.glu {
            cpu::glu(x)
        } else {
            relu(x)
        }
    }

    /// The network on the resampled, normalised input: `[B, C, 2L']` → `[B, S·C, 2L']`.
    fn network(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let mut x = x;
        let mut saved = Vec::with_capacity(self.encoders.len());
        for e in &self.encoders {
            x = self.act(norm3(&e.norm1, e.conv.forward(x)));
            if let Some(d) = &e.dconv {
                x = d.forward(x);
            }
            if let Some(r) = &e.rewrite {
                x = self.gate(norm3(&e.norm2, r.forward(x)));
            }
            saved.push(x.clone());
        }
        for d in &self.decoders {
            let skip = saved.pop().expect("one skip per layer");
            let len = x.dims()[2];
            x = x + center_trim(skip, len);
            if let Some(r) = &d.rewrite {
                x = self.gate(norm3(&d.norm1, r.forward(x)));
            }
            if let Some(dc) = &d.dconv {
                x = dc.forward(x);
            }
            x = d.conv_tr.forward(x);
            if let Some(n) = &d.norm2 {
                x = self.act(norm3(n, x));
            }
        }
        x
    }
}

/// `center_trim` along the last axis: drop `(n − len)/2` samples at the start and the
/// rest at the end.
fn center_trim<B: Backend>(x: Tensor<B, 3>, len: usize) -> Tensor<B, 3> {
    let n = x.dims()[2];
    x.narrow(2, (n - len) / 2, len)
}

/// `Demucs.valid_length`: the input length the layers map back onto itself exactly.
pub fn valid_length(c: &HTDemucsConfig, length: usize) -> usize {
    let (k, s) = (c.kernel_size as i64, c.stride as i64);
    let mut len = length as i64;
    if c.resample {
        len *= 2;
    }
    for _ in 0..c.depth {
        len = ((len - k) as f64 / s as f64).ceil() as i64 + 1;
        len = len.max(1);
    }
    for _ in 0..c.depth {
        len = (len - 1) * s + k;
    }
    if c.resample {
        len = (len + 1) / 2;
    }
    len as usize
}

/// julius's `sinc · Hann` kernel taps at positions `t` (already scaled by the
/// cut-off), normalised to sum 1.
fn kernel(ts: impl Iterator<Item = f64>, zeros: f64) -> Vec<f64> {
    let taps: Vec<f64> = ts
        .map(|t| {
            let t = t.clamp(-zeros, zeros) * std::f64::consts::PI;
            let window = (t / zeros / 2.0).cos().powi(2);
            let sinc = if t == 0.0 { 1.0 } else { t.sin() / t };
            sinc * window
        })
        .collect();
    let sum: f64 = taps.iter().sum();
    taps.into_iter().map(|v| v / sum).collect()
}

const ZEROS: f64 = 24.0;
const ROLLOFF: f64 = 0.945;

/// `julius.resample_frac(x, 1, 2)`: `[L]` → `[2L]` (edge samples replicated outside).
pub fn resample_up2(x: &[f64]) -> Vec<f64> {
    let sr = ROLLOFF; // min(1, 2) · rolloff
    let width = (ZEROS / sr).ceil() as i64;
    let kernels: Vec<Vec<f64>> =
        (0..2).map(|i| kernel((-width..width + 1).map(|j| (-(i as f64) / 2.0 + j as f64) * sr), ZEROS)).collect();
    let n = x.len() as i64;
    let at = |p: i64| x[p.clamp(0, n - 1) as usize];
    let mut y = Vec::with_capacity(2 * x.len());
    for t in 0..n {
        for k in &kernels {
            // Output t of this phase reads padded[t .. t + taps] = x[t − width ..].
            y.push(k.iter().enumerate().map(|(j, w)| w * at(t - width + j as i64)).sum());
        }
    }
    y
}

/// `julius.resample_frac(x, 2, 1)`: `[L]` → `[⌊L/2⌋]`.
pub fn resample_down2(x: &[f64]) -> Vec<f64> {
    let sr = ROLLOFF; // min(2, 1) · rolloff
    let width = (ZEROS * 2.0 / sr).ceil() as i64;
    let k = kernel((-width..width + 2).map(|j| (j as f64 / 2.0) * sr), ZEROS);
    let n = x.len() as i64;
    let at = |p: i64| x[p.clamp(0, n - 1) as usize];
    (0..n / 2).map(|t| k.iter().enumerate().map(|(j, w)| w * at(2 * t - width + j as i64)).sum()).collect()
}

/// `Demucs.forward`: `[B, C, L]` → `[B, S, C, L]`.
pub(crate) fn forward<B: Backend>(
    net: &WaveNet<B>,
    c: &HTDemucsConfig,
    mix: &HostTensor,
    device: &B::Device,
) -> Result<HostTensor, DemucsError> {
    let [b, ch, length] = crate::model::mix_dims(c, mix)?;
    let valid = valid_length(c, length);
    let left = (valid - length) / 2;
    let mut stats = Vec::with_capacity(b);
    let mut rows: Vec<Vec<f64>> = Vec::with_capacity(b * ch);
    for bi in 0..b {
        let item = &mix.data[bi * ch * length..(bi + 1) * ch * length];
        let (mean, std) = if c.normalize {
            let mono: Vec<f64> =
                (0..length).map(|i| (0..ch).map(|k| item[k * length + i] as f64).sum::<f64>() / ch as f64).collect();
            let mean = mono.iter().sum::<f64>() / length as f64;
            let var = mono.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / (length as f64 - 1.0);
            (mean, var.sqrt())
        } else {
            (0.0, 1.0)
        };
        let scale = if c.normalize { 1e-5 + std } else { 1.0 };
        stats.push((mean, std));
        for k in 0..ch {
            let mut row = vec![0f64; left];
            row.extend(item[k * length..(k + 1) * length].iter().map(|v| (*v as f64 - mean) / scale));
            row.resize(valid, 0.0);
            rows.push(if c.resample { resample_up2(&row) } else { row });
        }
    }
    let n = rows[0].len();
    let data: Vec<f32> = rows.iter().flat_map(|r| r.iter().map(|v| *v as f32)).collect();
    let x: Tensor<B, 3> = Tensor::from_data(TensorData::new(data, [b, ch, n]), device);
    let y = to_host(net.network(x));
    let nsrc = c.sources.len();
    let out_n = y.shape[2];
    let mut out = Vec::with_capacity(b * nsrc * ch * length);
    for (bi, &(mean, std)) in stats.iter().enumerate() {
        for r in 0..nsrc * ch {
            let row: Vec<f64> = y.data[(bi * nsrc * ch + r) * out_n..(bi * nsrc * ch + r + 1) * out_n]
                .iter()
                .map(|v| *v as f64)
                .collect();
            let row = if c.resample { resample_down2(&row) } else { row };
            let start = (row.len() - length) / 2;
            out.extend(row[start..start + length].iter().map(|v| (v * std + mean) as f32));
        }
    }
    Ok(HostTensor { shape: vec![b, nsrc, ch, length], data: out })
}
