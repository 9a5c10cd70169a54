//! Port of `demucs.htdemucs.HTDemucs` (inference): construction from a
//! [`HTDemucsConfig`] exactly as `HTDemucs.__init__` lays its layers out, loading from a
//! [`StateDict`] under PyTorch's names, and `forward` on a batch of segments.
//!
//! `forward`: mix `[B, C, L]` (host) → sources `[B, S, C, L]` (host).
//! 1. Pad to the training length when shorter (`use_train_segment`).
//! 2. Frequency branch input: `_spec` per channel → complex-as-channels
//!    `[B, 2C, F, T]` (`[L.re, L.im, R.re, R.im]`), normalised by its mean and unbiased
//!    std over `(C, F, T)` (host, f64). Time branch: the mix normalised over `(C, L)`.
//! 3. Encoders (freq `[B, 48, 512, T]` … and time `[B, 48, L/4]` … for htdemucs), the
//!    frequency embedding after layer 0, 1×1 up-projections to `bottom_channels`, the
//!    [`CrossTransformerEncoder`], down-projections, decoders with skips.
//! 4. De-normalise, `_ispec` each source/channel, add the time branch.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::checkpoint::{Checkpoint, HostTensor, StateDict};
use crate::config::HTDemucsConfig;
use crate::dconv::DConvConfig;
use crate::decoder::{HDecLayer, HDecLayerConfig};
use crate::encoder::{HEncLayer, HEncLayerConfig};
use crate::error::DemucsError;
use crate::nn::{to_device, to_host, Conv1d, Conv1dConfig};
use crate::stft::{Spectrogram, Stft};
use crate::transformer::{CrossTransformerEncoder, CrossTransformerEncoderConfig};

use realfft::num_complex::Complex;

/// The 1×1 projections around the transformer when `bottom_channels > 0`.
#[derive(Debug, Clone)]
struct Bottleneck<B: Backend> {
    up: Conv1d<B>,
    down: Conv1d<B>,
    up_t: Conv1d<B>,
    down_t: Conv1d<B>,
}

/// An HTDemucs model on a Burn device.
#[derive(Debug)]
pub struct HTDemucs<B: Backend> {
    config: HTDemucsConfig,
    encoder: Vec<HEncLayer<B>>,
    tencoder: Vec<HEncLayer<B>>,
    decoder: Vec<HDecLayer<B>>,
    tdecoder: Vec<HDecLayer<B>>,
    /// `freq_emb.embedding.weight` `[F0, C0]`, pre-multiplied by `emb_scale · freq_emb`.
    freq_emb: Option<Tensor<B, 2>>,
    bottleneck: Option<Bottleneck<B>>,
    crosstransformer: Option<CrossTransformerEncoder<B>>,
    stft: Stft,
    device: B::Device,
}

fn mean_std(values: impl Iterator<Item = f64> + Clone, n: usize) -> (f64, f64) {
    let mean = values.clone().sum::<f64>() / n as f64;
    let var = values.map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n as f64 - 1.0);
    (mean, var.sqrt())
}

impl HTDemucsConfig {
    /// A zero-initialised model with the layer layout of `HTDemucs.__init__`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Result<HTDemucs<B>, DemucsError> {
        let c = self;
        let nsrc = c.sources.len();
        let mut chin = c.audio_channels;
        let mut chin_z = chin * 2;
        let mut chout = c.channels_time.unwrap_or(c.channels);
        let mut chout_z = c.channels;
        let mut freqs = c.nfft / 2;
        let dconv = |on: bool, ch: usize| {
            on.then_some(DConvConfig { channels: ch, compress: c.dconv_comp, depth: c.dconv_depth })
        };
        let mut encoder = Vec::new();
        let mut tencoder = Vec::new();
        let mut decoder = Vec::new();
        let mut tdecoder = Vec::new();
        let mut freq_emb_shape = None;
        for index in 0..c.depth {
            let norm = index >= c.norm_starts;
            if freqs <= 1 || freqs <= c.kernel_size {
                return Err(DemucsError::Unsupported(
                    "layers where the frequency axis collapses (branch merge) are not ported".into(),
                ));
            }
            encoder.push(
                HEncLayerConfig {
                    chin: chin_z,
                    chout: chout_z,
                    kernel_size: c.kernel_size,
                    stride: c.stride,
                    norm_groups: c.norm_groups,
                    freq: true,
                    dconv: dconv(c.dconv_mode & 1 != 0, chout_z),
                    norm,
                    context: c.context_enc,
                    pad: true,
                    rewrite: c.rewrite,
                }
                .init(device),
            );
            tencoder.push(
                HEncLayerConfig {
                    chin,
                    chout,
                    kernel_size: c.kernel_size,
                    stride: c.stride,
                    norm_groups: c.norm_groups,
                    freq: false,
                    dconv: dconv(c.dconv_mode & 1 != 0, chout),
                    norm,
                    context: c.context_enc,
                    pad: true,
                    rewrite: c.rewrite,
                }
                .init(device),
            );
            if index == 0 {
                chin = c.audio_channels * nsrc;
                chin_z = chin * 2;
            }
            let dec = |chin: usize, chout: usize, freq: bool| {
                HDecLayerConfig {
                    chin,
                    chout,
                    last: index == 0,
                    kernel_size: c.kernel_size,
                    stride: c.stride,
                    norm_groups: c.norm_groups,
                    freq,
                    dconv: dconv(c.dconv_mode & 2 != 0, chin),
                    norm,
                    context: c.context,
                    pad: true,
                    rewrite: c.rewrite,
                }
                .init(device)
            };
            decoder.insert(0, dec(chout_z, chin_z, true));
            tdecoder.insert(0, dec(chout, chin, false));
            chin = chout;
            chin_z = chout_z;
            chout = (c.growth * chout as f64) as usize;
            chout_z = (c.growth * chout_z as f64) as usize;
            freqs /= c.stride;
            if index == 0 && c.freq_emb != 0.0 {
                freq_emb_shape = Some([freqs, chin_z]);
            }
        }
        let mut tch = c.channels * (c.growth.powi(c.depth as i32 - 1) as usize);
        let bottleneck = (c.bottom_channels > 0).then(|| {
            let b = c.bottom_channels;
            Bottleneck {
                up: Conv1dConfig::new(tch, b, 1).init(device),
                down: Conv1dConfig::new(b, tch, 1).init(device),
                up_t: Conv1dConfig::new(tch, b, 1).init(device),
                down_t: Conv1dConfig::new(b, tch, 1).init(device),
            }
        });
        if c.bottom_channels > 0 {
            tch = c.bottom_channels;
        }
        let crosstransformer = (c.t_layers > 0).then(|| {
            CrossTransformerEncoderConfig {
                dim: tch,
                hidden_scale: c.t_hidden_scale,
                num_heads: c.t_heads,
                num_layers: c.t_layers,
                cross_first: c.t_cross_first,
                norm_in: c.t_norm_in,
                norm_out: c.t_norm_out,
                max_period: c.t_max_period,
                layer_scale: c.t_layer_scale,
                gelu: c.t_gelu,
                weight_pos_embed: c.t_weight_pos_embed,
            }
            .init(device)
        });
        Ok(HTDemucs {
            config: c.clone(),
            encoder,
            tencoder,
            decoder,
            tdecoder,
            freq_emb: freq_emb_shape.map(|s| Tensor::zeros(s, device)),
            bottleneck,
            crosstransformer,
            stft: Stft::new(c.nfft),
            device: device.clone(),
        })
    }
}

impl<B: Backend> HTDemucs<B> {
    /// Builds the model of a checkpoint and loads its weights (strict: every tensor of
    /// the state dict must be used).
    pub fn from_checkpoint(ckpt: Checkpoint, device: &B::Device) -> Result<Self, DemucsError> {
        if let Some(name) = ckpt.class_name() {
            if name != "demucs.htdemucs.HTDemucs" {
                return Err(DemucsError::Unsupported(format!("model class {name} (only HTDemucs)")));
            }
        }
        let config = HTDemucsConfig::from_args_kwargs(&ckpt.args, &ckpt.kwargs)?;
        let model = config.init(device)?;
        let mut state = ckpt.state;
        let model = model.load(&mut state)?;
        state.finish()?;
        Ok(model)
    }

    /// Reads a `.th` file and builds the model.
    pub fn load_file(path: &std::path::Path, device: &B::Device) -> Result<Self, DemucsError> {
        Self::from_checkpoint(Checkpoint::load(path)?, device)
    }

    /// Moves the checkpoint's weights in.
    pub fn load(self, state: &mut StateDict) -> Result<Self, DemucsError> {
        let load_list = |ls: Vec<HEncLayer<B>>, name: &str, state: &mut StateDict| {
            ls.into_iter()
                .enumerate()
                .map(|(i, l)| l.load(state, &format!("{name}.{i}")))
                .collect::<Result<Vec<_>, _>>()
        };
        let load_dec = |ls: Vec<HDecLayer<B>>, name: &str, state: &mut StateDict| {
            ls.into_iter()
                .enumerate()
                .map(|(i, l)| l.load(state, &format!("{name}.{i}")))
                .collect::<Result<Vec<_>, _>>()
        };
        let c = &self.config;
        let freq_emb = match self.freq_emb {
            Some(t) => {
                let w = state.take("freq_emb.embedding.weight", &t.dims())?;
                // PyTorch: x + freq_emb_scale * (weight * scale); the product is formed
                // in that order below (weight · emb_scale, then · freq_emb).
                let t: Tensor<B, 2> = to_device(w, &self.device);
                Some(t.mul_scalar(c.emb_scale as f32).mul_scalar(c.freq_emb as f32))
            }
            None => None,
        };
        let bottleneck = match self.bottleneck {
            Some(b) => Some(Bottleneck {
                up: b.up.load(state, "channel_upsampler")?,
                down: b.down.load(state, "channel_downsampler")?,
                up_t: b.up_t.load(state, "channel_upsampler_t")?,
                down_t: b.down_t.load(state, "channel_downsampler_t")?,
            }),
            None => None,
        };
        Ok(HTDemucs {
            encoder: load_list(self.encoder, "encoder", state)?,
            tencoder: load_list(self.tencoder, "tencoder", state)?,
            decoder: load_dec(self.decoder, "decoder", state)?,
            tdecoder: load_dec(self.tdecoder, "tdecoder", state)?,
            freq_emb,
            bottleneck,
            crosstransformer: self.crosstransformer.map(|t| t.load(state, "crosstransformer")).transpose()?,
            config: self.config,
            stft: self.stft,
            device: self.device,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &HTDemucsConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Frequency encoder `i`, for block tests.
    pub fn encoder(&self, i: usize) -> &HEncLayer<B> {
        &self.encoder[i]
    }
    /// Time encoder `i`.
    pub fn tencoder(&self, i: usize) -> &HEncLayer<B> {
        &self.tencoder[i]
    }
    /// Frequency decoder `i` (0 = deepest).
    pub fn decoder(&self, i: usize) -> &HDecLayer<B> {
        &self.decoder[i]
    }
    /// Time decoder `i` (0 = deepest).
    pub fn tdecoder(&self, i: usize) -> &HDecLayer<B> {
        &self.tdecoder[i]
    }
    /// The transformer.
    pub fn crosstransformer(&self) -> Option<&CrossTransformerEncoder<B>> {
        self.crosstransformer.as_ref()
    }
    /// The STFT used by `_spec` / `_ispec`.
    pub fn stft(&self) -> &Stft {
        &self.stft
    }

    /// `forward` with the model's own training length.
    pub fn forward(&self, mix: &HostTensor) -> Result<HostTensor, DemucsError> {
        self.forward_with_training_length(mix, self.config.training_length())
    }

    /// Several independent forward passes, each on its own thread (scoped): the CPU
    /// backend's kernels alone use barely more than one core.
    pub fn forward_parallel(
        &self,
        inputs: Vec<HostTensor>,
        training_length: usize,
    ) -> Result<Vec<HostTensor>, DemucsError> {
        if inputs.len() == 1 {
            return Ok(vec![self.forward_with_training_length(&inputs[0], training_length)?]);
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = inputs
                .iter()
                .map(|input| scope.spawn(move || self.forward_with_training_length(input, training_length)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect()
        })
    }

    /// `HTDemucs.forward` where `int(self.segment * samplerate)` is `training_length`
    /// (a bag may override the segment): `[B, C, L]` → `[B, S, C, L]`.
    pub fn forward_with_training_length(
        &self,
        mix: &HostTensor,
        training_length: usize,
    ) -> Result<HostTensor, DemucsError> {
        let c = &self.config;
        let [b, ch, length] = <[usize; 3]>::try_from(mix.shape.as_slice())
            .map_err(|_| DemucsError::InvalidArgument(format!("mix shape {:?}, expected [B, C, L]", mix.shape)))?;
        if ch != c.audio_channels {
            return Err(DemucsError::InvalidArgument(format!(
                "mix has {ch} channels, the model takes {}",
                c.audio_channels
            )));
        }
        // 1. pad to the training length.
        let (mix, le) = if c.use_train_segment && length < training_length {
            let mut data = vec![0f32; b * ch * training_length];
            for row in 0..b * ch {
                data[row * training_length..row * training_length + length]
                    .copy_from_slice(&mix.data[row * length..(row + 1) * length]);
            }
            (HostTensor { shape: vec![b, ch, training_length], data }, training_length)
        } else {
            (mix.clone(), length)
        };

        // 2. spectrogram, complex as channels, normalisation.
        let mut specs = Vec::with_capacity(b * ch);
        for row in 0..b * ch {
            specs.push(self.stft.spec(&mix.data[row * le..(row + 1) * le])?);
        }
        let (fq, t) = (specs[0].freqs, specs[0].frames);
        let per_b = ch * 2 * fq * t;
        let mut mag = vec![0f32; b * per_b];
        let mut stats = Vec::with_capacity(b);
        for bi in 0..b {
            let ss = &specs[bi * ch..(bi + 1) * ch];
            let vals = ss.iter().flat_map(|s| s.data.iter().flat_map(|z| [z.re, z.im]));
            let (m, s) = mean_std(vals, per_b);
            stats.push((m, s));
            for (ci, s_) in ss.iter().enumerate() {
                for k in 0..fq {
                    for ti in 0..t {
                        let z = s_.data[k * t + ti];
                        let base = bi * per_b + (ci * 2) * fq * t + k * t + ti;
                        mag[base] = ((z.re - m) / (1e-5 + s)) as f32;
                        mag[base + fq * t] = ((z.im - m) / (1e-5 + s)) as f32;
                    }
                }
            }
        }
        let mut stats_t = Vec::with_capacity(b);
        let mut xt_host = vec![0f32; b * ch * le];
        for bi in 0..b {
            let seg = &mix.data[bi * ch * le..(bi + 1) * ch * le];
            let (m, s) = mean_std(seg.iter().map(|v| *v as f64), ch * le);
            stats_t.push((m, s));
            for (o, v) in xt_host[bi * ch * le..(bi + 1) * ch * le].iter_mut().zip(seg) {
                *o = ((*v as f64 - m) / (1e-5 + s)) as f32;
            }
        }
        let x: Tensor<B, 4> = Tensor::from_data(TensorData::new(mag, [b, ch * 2, fq, t]), &self.device);
        let xt: Tensor<B, 3> = Tensor::from_data(TensorData::new(xt_host, [b, ch, le]), &self.device);

        // 3. the network.
        let (x, xt) = self.forward_normalised(x, xt);

        // 4. de-normalise, iSTFT, sum the branches.
        let nsrc = c.sources.len();
        let x = to_host(x);
        let xt = to_host(xt);
        let out_len = if c.use_train_segment { training_length.max(length) } else { length };
        debug_assert_eq!(xt.shape, vec![b, nsrc * ch, out_len]);
        let mut out = vec![0f32; b * nsrc * ch * out_len];
        for bi in 0..b {
            let (m, s) = stats[bi];
            let (mt, st) = stats_t[bi];
            for si in 0..nsrc {
                for ci in 0..ch {
                    let base = ((bi * nsrc + si) * ch * 2 + ci * 2) * fq * t;
                    let data = (0..fq * t)
                        .map(|i| {
                            let re = x.data[base + i] as f64 * s + m;
                            let im = x.data[base + fq * t + i] as f64 * s + m;
                            Complex::new(re, im)
                        })
                        .collect();
                    let wav = self.stft.ispec(&Spectrogram { freqs: fq, frames: t, data }, out_len);
                    let row = (bi * nsrc + si) * ch + ci;
                    let trow = &xt.data[row * out_len..(row + 1) * out_len];
                    for (i, o) in out[row * out_len..(row + 1) * out_len].iter_mut().enumerate() {
                        *o = (trow[i] as f64 * st + mt + wav[i] as f64) as f32;
                    }
                }
            }
        }
        // crop the training-length padding.
        if out_len != length {
            let mut cropped = vec![0f32; b * nsrc * ch * length];
            for row in 0..b * nsrc * ch {
                cropped[row * length..(row + 1) * length].copy_from_slice(&out[row * out_len..row * out_len + length]);
            }
            out = cropped;
        }
        Ok(HostTensor { shape: vec![b, nsrc, ch, length], data: out })
    }

    /// Encoders, transformer and decoders on normalised inputs: `x` `[B, 2C, F, T]`,
    /// `xt` `[B, C, L]` → `[B, S·2C, F, T]`, `[B, S·C, L]`.
    pub fn forward_normalised(&self, x: Tensor<B, 4>, xt: Tensor<B, 3>) -> (Tensor<B, 4>, Tensor<B, 3>) {
        let mut x = x;
        let mut xt = xt;
        let mut saved = Vec::new();
        let mut saved_t = Vec::new();
        let mut lengths_t = Vec::new();
        for (idx, (enc, tenc)) in self.encoder.iter().zip(&self.tencoder).enumerate() {
            lengths_t.push(xt.dims()[2]);
            xt = tenc.forward_time(xt);
            saved_t.push(xt.clone());
            x = enc.forward_freq(x);
            if idx == 0 {
                if let Some(emb) = &self.freq_emb {
                    let [fr, c] = emb.dims();
                    x = x + emb.clone().transpose().reshape([1, c, fr, 1]);
                }
            }
            saved.push(x.clone());
        }
        if let Some(tr) = &self.crosstransformer {
            if let Some(bn) = &self.bottleneck {
                let [b, c, f, t] = x.dims();
                let y = bn.up.forward(x.reshape([b, c, f * t]));
                let c2 = y.dims()[1];
                x = y.reshape([b, c2, f, t]);
                xt = bn.up_t.forward(xt);
            }
            let (x2, xt2) = tr.forward(x, xt);
            x = x2;
            xt = xt2;
            if let Some(bn) = &self.bottleneck {
                let [b, c, f, t] = x.dims();
                let y = bn.down.forward(x.reshape([b, c, f * t]));
                let c2 = y.dims()[1];
                x = y.reshape([b, c2, f, t]);
                xt = bn.down_t.forward(xt);
            }
        }
        for (dec, tdec) in self.decoder.iter().zip(&self.tdecoder) {
            let skip = saved.pop().expect("one skip per layer");
            let (x2, _pre) = dec.forward_freq(x, skip);
            x = x2;
            let length_t = lengths_t.pop().expect("one length per layer");
            let skip_t = saved_t.pop().expect("one skip per layer");
            let (xt2, _) = tdec.forward_time(xt, skip_t, length_t);
            xt = xt2;
        }
        (x, xt)
    }
}
