//! Port of `demucs.htdemucs.HTDemucs` (inference), and of Hybrid Demucs
//! (`demucs.hdemucs.HDemucs`, v3) whose layers HTDemucs reuses: construction from a
//! [`HTDemucsConfig`] exactly as the class's `__init__` lays its layers out (its
//! [`Arch`]), loading from a [`StateDict`] under PyTorch's names, and `forward` on a
//! batch of segments.
//!
//! Hybrid Demucs differs in the middle and at the ends: its frequency layers run until
//! one frequency row is left (the last with kernel = the remaining rows, no padding, and
//! the time branch's output *injected*: the time layer there is `empty`, the convolution
//! alone), then time layers (`k = 2·time_stride`) carry the merged branches; there is no
//! transformer, and the decoders start from zeros, the deepest frequency decoder's
//! `pre` feeding the time branch's first (`empty`) decoder. Any input length works (no
//! training-length padding). `cac = false` models predict magnitudes, given the
//! mixture's phase; `hybrid_old` ones pad the spectrogram with zeros and come out
//! shifted by `3·hop/2` (the MDX models were trained so).
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
use crate::config::{Arch, HTDemucsConfig};
use crate::dconv::DConvConfig;
use crate::decoder::{HDecLayer, HDecLayerConfig};
use crate::encoder::{HEncLayer, HEncLayerConfig};
use crate::error::DemucsError;
use crate::nn::{to_device, to_host, Conv1d, Conv1dConfig, Param, WeightPrecision};
use crate::stft::{Spectrogram, Stft};
use crate::transformer::{CrossTransformerEncoder, CrossTransformerEncoderConfig};
use crate::wave::WaveNet;

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
    freq_emb: Option<Param<B, 2>>,
    bottleneck: Option<Bottleneck<B>>,
    crosstransformer: Option<CrossTransformerEncoder<B>>,
    /// The layers of a waveform Demucs ([`Arch::Demucs`]); the lists above are empty.
    wave: Option<WaveNet<B>>,
    stft: Stft,
    device: B::Device,
    /// Device bytes of the loaded weights (0 before [`HTDemucs::load`]).
    weight_bytes: u64,
}

/// `f` over every input at once, each on a thread of its own (a single input on this
/// thread); a panic on one of them is raised again here.
///
/// Each input gets its own share of the cores: its parallel work (Flex's gemm calls,
/// the host kernels' loops) runs on a rayon pool of `cores / inputs` threads of its
/// own instead of all of them splitting every call across the one global pool. On two
/// cores, two passes that way ran 30 s of audio in 10.1–10.3 s instead of 11.4–11.6 s:
/// no call is split in halves that wait for each other, and no pass waits on a latch
/// while the other's work holds the pool.
pub(crate) fn on_threads<T: Send, R: Send>(
    mut inputs: Vec<T>,
    f: impl Fn(T) -> Result<R, DemucsError> + Sync,
) -> Result<Vec<R>, DemucsError> {
    if inputs.len() == 1 {
        return Ok(vec![f(inputs.remove(0))?]);
    }
    let share = (rayon::current_num_threads() / inputs.len()).max(1);
    std::thread::scope(|scope| {
        let f = &f;
        let run = move |input: T| match rayon::ThreadPoolBuilder::new().num_threads(share).build() {
            Ok(pool) => pool.install(|| f(input)),
            // No thread for a pool of its own: share the global one.
            Err(_) => f(input),
        };
        let handles: Vec<_> = inputs.into_iter().map(|input| scope.spawn(move || run(input))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect()
    })
}

/// `[B, C, L]` of a mix, with `C` the model's audio channels, or why not.
pub(crate) fn mix_dims(c: &HTDemucsConfig, mix: &HostTensor) -> Result<[usize; 3], DemucsError> {
    let [b, ch, length] = <[usize; 3]>::try_from(mix.shape.as_slice())
        .map_err(|_| DemucsError::InvalidArgument(format!("mix shape {:?}, expected [B, C, L]", mix.shape)))?;
    if ch != c.audio_channels {
        return Err(DemucsError::InvalidArgument(format!(
            "mix has {ch} channels, the model takes {}",
            c.audio_channels
        )));
    }
    Ok([b, ch, length])
}

fn mean_std(values: impl Iterator<Item = f64> + Clone, n: usize) -> (f64, f64) {
    let mean = values.clone().sum::<f64>() / n as f64;
    let var = values.map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n as f64 - 1.0);
    (mean, var.sqrt())
}

/// A layer's activations: frequency layers see `[B, C, F, T]`, time layers `[B, C, T]`
/// (Hybrid Demucs passes from one to the other where the branches merge).
#[derive(Debug, Clone)]
enum Feature<B: Backend> {
    Freq(Tensor<B, 4>),
    Time(Tensor<B, 3>),
}

impl<B: Backend> Feature<B> {
    /// As a frequency input of `channels` channels (`view(B, channels, -1, T)`).
    fn freq(self, channels: usize) -> Tensor<B, 4> {
        match self {
            Feature::Freq(x) => x,
            Feature::Time(x) => {
                let [b, c, t] = x.dims();
                x.reshape([b, channels, c / channels, t])
            }
        }
    }
    /// As a time input (`view(B, -1, T)`).
    fn time(self) -> Tensor<B, 3> {
        match self {
            Feature::Time(x) => x,
            Feature::Freq(x) => {
                let [b, c, f, t] = x.dims();
                x.reshape([b, c * f, t])
            }
        }
    }
    fn frames(&self) -> usize {
        match self {
            Feature::Freq(x) => x.dims()[3],
            Feature::Time(x) => x.dims()[2],
        }
    }
    fn zeros_like(&self) -> Self {
        match self {
            Feature::Freq(x) => Feature::Freq(x.zeros_like()),
            Feature::Time(x) => Feature::Time(x.zeros_like()),
        }
    }
}

impl HTDemucsConfig {
    /// A zero-initialised model with the layer layout of `HDemucs.__init__`.
    fn init_hdemucs<B: Backend>(&self, device: &B::Device) -> Result<HTDemucs<B>, DemucsError> {
        let c = self;
        let nsrc = c.sources.len();
        let spec_mul = if c.cac { 2 } else { 1 };
        let mut chin = c.audio_channels;
        let mut chin_z = chin * spec_mul;
        let mut chout = c.channels_time.unwrap_or(c.channels);
        let mut chout_z = c.channels;
        let mut freqs = c.nfft / 2;
        let (mut encoder, mut tencoder, mut decoder, mut tdecoder) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut freq_emb_shape = None;
        for index in 0..c.depth {
            let (lstm, attn, norm) = (index >= c.dconv_lstm, index >= c.dconv_attn, index >= c.norm_starts);
            // MultiWrap around the outer layers: one copy per frequency band.
            let multi = (!c.multi_freqs.is_empty() && index < c.multi_freqs_depth).then(|| c.multi_freqs.clone());
            if multi.is_some() && norm {
                return Err(DemucsError::Unsupported("MultiWrap around a layer with GroupNorm".into()));
            }
            let dconv = |on: bool, ch: usize| {
                on.then_some(DConvConfig { channels: ch, compress: c.dconv_comp, depth: c.dconv_depth, lstm, attn })
            };
            let freq = freqs > 1;
            let (mut ker, mut stri) = (c.kernel_size, c.stride);
            if !freq {
                if freqs != 1 {
                    return Err(DemucsError::Unsupported(format!("{freqs} frequencies left at a time layer")));
                }
                ker = 2 * c.time_stride;
                stri = c.time_stride;
            }
            let (mut pad, mut last_freq) = (true, false);
            if freq && freqs <= c.kernel_size {
                ker = freqs;
                pad = false;
                last_freq = true;
            }
            if last_freq {
                chout_z = chout.max(chout_z);
                chout = chout_z;
            }
            encoder.push(
                HEncLayerConfig {
                    chin: chin_z,
                    chout: chout_z,
                    kernel_size: ker,
                    stride: stri,
                    norm_groups: c.norm_groups,
                    freq,
                    dconv: dconv(c.dconv_mode & 1 != 0, chout_z),
                    norm,
                    context: c.context_enc,
                    pad,
                    rewrite: c.rewrite,
                    empty: false,
                    bands: multi.clone(),
                }
                .init(device),
            );
            if freq {
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
                        empty: last_freq,
                        bands: None,
                    }
                    .init(device),
                );
            }
            if index == 0 {
                chin = c.audio_channels * nsrc;
                chin_z = chin * spec_mul;
            }
            decoder.insert(
                0,
                HDecLayerConfig {
                    chin: chout_z,
                    chout: chin_z,
                    last: index == 0,
                    kernel_size: ker,
                    stride: stri,
                    norm_groups: c.norm_groups,
                    freq,
                    dconv: dconv(c.dconv_mode & 2 != 0, chout_z),
                    norm,
                    context: c.context,
                    pad,
                    rewrite: c.rewrite,
                    empty: false,
                    context_freq: multi.is_none(),
                    bands: multi.clone(),
                }
                .init(device),
            );
            if freq {
                tdecoder.insert(
                    0,
                    HDecLayerConfig {
                        chin: chout,
                        chout: chin,
                        last: index == 0,
                        kernel_size: c.kernel_size,
                        stride: c.stride,
                        norm_groups: c.norm_groups,
                        freq: false,
                        dconv: dconv(c.dconv_mode & 2 != 0, chout),
                        norm,
                        context: c.context,
                        pad: true,
                        rewrite: c.rewrite,
                        empty: last_freq,
                        context_freq: true,
                        bands: None,
                    }
                    .init(device),
                );
            }
            chin = chout;
            chin_z = chout_z;
            chout = (c.growth * chout as f64) as usize;
            chout_z = (c.growth * chout_z as f64) as usize;
            if freq {
                freqs = if freqs <= c.kernel_size { 1 } else { freqs / c.stride };
            }
            if index == 0 && c.freq_emb != 0.0 {
                freq_emb_shape = Some([freqs, chin_z]);
            }
        }
        Ok(HTDemucs {
            config: c.clone(),
            encoder,
            tencoder,
            decoder,
            tdecoder,
            freq_emb: freq_emb_shape.map(|s| Tensor::zeros(s, device).into()),
            bottleneck: None,
            crosstransformer: None,
            wave: None,
            stft: Stft::new(c.nfft),
            device: device.clone(),
            weight_bytes: 0,
        })
    }

    /// A zero-initialised model with the layer layout of its class's `__init__`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Result<HTDemucs<B>, DemucsError> {
        match self.arch {
            Arch::HDemucs => return self.init_hdemucs(device),
            Arch::Demucs => {
                return Ok(HTDemucs {
                    config: self.clone(),
                    encoder: Vec::new(),
                    tencoder: Vec::new(),
                    decoder: Vec::new(),
                    tdecoder: Vec::new(),
                    freq_emb: None,
                    bottleneck: None,
                    crosstransformer: None,
                    wave: Some(self.init_wave(device)?),
                    stft: Stft::new(self.nfft),
                    device: device.clone(),
                    weight_bytes: 0,
                })
            }
            Arch::HTDemucs => {}
        }
        let c = self;
        let nsrc = c.sources.len();
        let mut chin = c.audio_channels;
        let mut chin_z = chin * 2;
        let mut chout = c.channels_time.unwrap_or(c.channels);
        let mut chout_z = c.channels;
        let mut freqs = c.nfft / 2;
        let dconv = |on: bool, ch: usize| {
            on.then_some(DConvConfig {
                channels: ch,
                compress: c.dconv_comp,
                depth: c.dconv_depth,
                lstm: false,
                attn: false,
            })
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
                    empty: false,
                    bands: None,
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
                    empty: false,
                    bands: None,
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
                    empty: false,
                    context_freq: true,
                    bands: None,
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
            freq_emb: freq_emb_shape.map(|s| Tensor::zeros(s, device).into()),
            bottleneck,
            crosstransformer,
            wave: None,
            stft: Stft::new(c.nfft),
            device: device.clone(),
            weight_bytes: 0,
        })
    }
}

impl<B: Backend> HTDemucs<B> {
    /// Builds the model of a checkpoint and loads its weights (strict: every tensor of
    /// the state dict must be used), kept in `f32`.
    pub fn from_checkpoint(ckpt: Checkpoint, device: &B::Device) -> Result<Self, DemucsError> {
        Self::from_checkpoint_with(ckpt, device, WeightPrecision::Full)
    }

    /// [`HTDemucs::from_checkpoint`], with the weights kept in `precision` on the device.
    pub fn from_checkpoint_with(
        ckpt: Checkpoint,
        device: &B::Device,
        precision: WeightPrecision,
    ) -> Result<Self, DemucsError> {
        let arch = match ckpt.class_name() {
            Some(name) => Arch::from_class_path(&name).ok_or_else(|| {
                DemucsError::Unsupported(format!("model class {name} (this port has HTDemucs and HDemucs)"))
            })?,
            None => Arch::HTDemucs,
        };
        let config = HTDemucsConfig::for_arch(arch, &ckpt.args, &ckpt.kwargs)?;
        let model = config.init(device)?;
        let state = match ckpt.quantized {
            // No names on disk: the parameters in PyTorch's order, from a dry run.
            Some(q) => {
                let mut dry = StateDict::recording();
                config.init::<B>(device)?.load(&mut dry)?;
                crate::diffq::dequantize(q, &crate::diffq::canonical_order(dry.into_recorded()))?
            }
            None => ckpt.state,
        };
        let mut state = state.with_precision(precision);
        let model = model.load(&mut state)?;
        state.finish()?;
        Ok(model)
    }

    /// Reads a `.th` file and builds the model.
    pub fn load_file(path: &std::path::Path, device: &B::Device) -> Result<Self, DemucsError> {
        Self::load_file_with(path, device, WeightPrecision::Full)
    }

    /// [`HTDemucs::load_file`], with the weights kept in `precision` on the device.
    pub fn load_file_with(
        path: &std::path::Path,
        device: &B::Device,
        precision: WeightPrecision,
    ) -> Result<Self, DemucsError> {
        Self::from_checkpoint_with(Checkpoint::load(path)?, device, precision)
    }

    /// Device bytes of the loaded weights: about 4 per parameter, or 2 with
    /// [`WeightPrecision::Half`].
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Moves the checkpoint's weights in.
    pub fn load(self, state: &mut StateDict) -> Result<Self, DemucsError> {
        let kept_before = state.kept_bytes();
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
                Some(state.param_f32(t.mul_scalar(c.emb_scale as f32).mul_scalar(c.freq_emb as f32)))
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
        let mut model = HTDemucs {
            encoder: load_list(self.encoder, "encoder", state)?,
            tencoder: load_list(self.tencoder, "tencoder", state)?,
            decoder: load_dec(self.decoder, "decoder", state)?,
            tdecoder: load_dec(self.tdecoder, "tdecoder", state)?,
            freq_emb,
            bottleneck,
            crosstransformer: self.crosstransformer.map(|t| t.load(state, "crosstransformer")).transpose()?,
            wave: self.wave.map(|w| w.load(state)).transpose()?,
            config: self.config,
            stft: self.stft,
            device: self.device,
            weight_bytes: 0,
        };
        model.weight_bytes = state.kept_bytes() - kept_before;
        Ok(model)
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
        on_threads(inputs, |input| self.forward_with_training_length(&input, training_length))
    }

    /// `HTDemucs.forward` where `int(self.segment * samplerate)` is `training_length`
    /// (a bag may override the segment): `[B, C, L]` → `[B, S, C, L]`.
    pub fn forward_with_training_length(
        &self,
        mix: &HostTensor,
        training_length: usize,
    ) -> Result<HostTensor, DemucsError> {
        let c = &self.config;
        let [b, ch, length] = mix_dims(c, mix)?;
        if let Some(wave) = &self.wave {
            return crate::wave::forward(wave, c, mix, &self.device);
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

        // 2. spectrogram, complex as channels (or magnitudes), normalisation.
        let mut specs = Vec::with_capacity(b * ch);
        for row in 0..b * ch {
            specs.push(self.stft.spec_with(&mix.data[row * le..(row + 1) * le], c.hybrid_old)?);
        }
        let (fq, t) = (specs[0].freqs, specs[0].frames);
        let parts = if c.cac { 2 } else { 1 };
        let per_b = ch * parts * fq * t;
        let mut mag = vec![0f32; b * per_b];
        let mut stats = Vec::with_capacity(b);
        for bi in 0..b {
            let ss = &specs[bi * ch..(bi + 1) * ch];
            let (m, s) = if c.cac {
                mean_std(ss.iter().flat_map(|s| s.data.iter().flat_map(|z| [z.re, z.im])), per_b)
            } else {
                mean_std(ss.iter().flat_map(|s| s.data.iter().map(|z| z.norm())), per_b)
            };
            stats.push((m, s));
            for (ci, s_) in ss.iter().enumerate() {
                for k in 0..fq {
                    for ti in 0..t {
                        let z = s_.data[k * t + ti];
                        let base = bi * per_b + (ci * parts) * fq * t + k * t + ti;
                        if c.cac {
                            mag[base] = ((z.re - m) / (1e-5 + s)) as f32;
                            mag[base + fq * t] = ((z.im - m) / (1e-5 + s)) as f32;
                        } else {
                            mag[base] = ((z.norm() - m) / (1e-5 + s)) as f32;
                        }
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
        let x: Tensor<B, 4> = Tensor::from_data(TensorData::new(mag, [b, ch * parts, fq, t]), &self.device);
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
                    let base = ((bi * nsrc + si) * ch * parts + ci * parts) * fq * t;
                    let data = if c.cac {
                        (0..fq * t)
                            .map(|i| {
                                let re = x.data[base + i] as f64 * s + m;
                                let im = x.data[base + fq * t + i] as f64 * s + m;
                                Complex::new(re, im)
                            })
                            .collect()
                    } else {
                        // The magnitude with the mixture's phase (`_wiener` with no
                        // iteration); a silent bin has phase 0.
                        let mixture = &specs[bi * ch + ci].data;
                        (0..fq * t)
                            .map(|i| {
                                let magnitude = x.data[base + i] as f64 * s + m;
                                let z = mixture[i];
                                let r = z.norm();
                                if r > 0.0 {
                                    z * (magnitude / r)
                                } else {
                                    Complex::new(magnitude, 0.0)
                                }
                            })
                            .collect()
                    };
                    let wav = self.stft.ispec_with(&Spectrogram { freqs: fq, frames: t, data }, out_len, c.hybrid_old);
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
        if self.config.arch == Arch::HDemucs {
            return self.forward_hybrid(x, xt);
        }
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
                    x = x + emb.val().transpose().reshape([1, c, fr, 1]);
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

    /// `HDemucs.forward` between the normalised inputs and the outputs: the encoders
    /// (time layer `i` beside frequency layer `i`, its output injected at the merge), the
    /// decoders from zeros with the skips, the time decoders beside the frequency ones
    /// (the first fed the `pre` of the deepest frequency decoder).
    fn forward_hybrid(&self, x: Tensor<B, 4>, xt: Tensor<B, 3>) -> (Tensor<B, 4>, Tensor<B, 3>) {
        let mut x = Feature::Freq(x);
        let mut xt = xt;
        let (mut saved, mut saved_t, mut lengths, mut lengths_t) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (idx, enc) in self.encoder.iter().enumerate() {
            lengths.push(x.frames());
            let mut inject = None;
            if let Some(tenc) = self.tencoder.get(idx) {
                lengths_t.push(xt.dims()[2]);
                xt = tenc.forward_time(xt);
                if tenc.is_empty() {
                    inject = Some(xt.clone());
                } else {
                    saved_t.push(xt.clone());
                }
            }
            x = if enc.is_freq() {
                let chin = match &x {
                    Feature::Freq(t) => t.dims()[1],
                    Feature::Time(t) => t.dims()[1],
                };
                Feature::Freq(enc.forward_freq_inject(x.freq(chin), inject))
            } else {
                Feature::Time(enc.forward_time(x.time()))
            };
            if idx == 0 {
                if let (Some(emb), Feature::Freq(t)) = (&self.freq_emb, &x) {
                    let [fr, c] = emb.dims();
                    x = Feature::Freq(t.clone() + emb.val().transpose().reshape([1, c, fr, 1]));
                }
            }
            saved.push(x.clone());
        }
        let mut x = x.zeros_like();
        let offset = self.decoder.len() - self.tdecoder.len();
        for (idx, dec) in self.decoder.iter().enumerate() {
            let skip = saved.pop().expect("one skip per layer");
            let length = lengths.pop().expect("one length per layer");
            let pre = if dec.is_freq() {
                let skip = skip.freq(1);
                let chin = skip.dims()[1];
                let (z, pre) = dec.forward_freq(x.freq(chin), skip);
                x = Feature::Freq(z);
                Feature::Freq(pre)
            } else {
                let (z, pre) = dec.forward_time(x.time(), skip.time(), length);
                x = Feature::Time(z);
                Feature::Time(pre)
            };
            if idx >= offset {
                let tdec = &self.tdecoder[idx - offset];
                let length_t = lengths_t.pop().expect("one time length per time layer");
                xt = if tdec.is_empty() {
                    tdec.forward_time_skip(pre.time(), None, length_t).0
                } else {
                    let skip_t = saved_t.pop().expect("one time skip per time layer");
                    tdec.forward_time(xt, skip_t, length_t).0
                };
            }
        }
        let chout = self.config.audio_channels * self.config.sources.len() * if self.config.cac { 2 } else { 1 };
        (x.freq(chout), xt)
    }
}

#[cfg(test)]
mod tests {
    use super::on_threads;

    /// Concurrent passes split the cores between them instead of all sharing one pool.
    #[test]
    fn each_concurrent_pass_gets_its_share_of_the_threads() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        let threads = |inputs: usize| {
            pool.install(|| on_threads(vec![(); inputs], |()| Ok(rayon::current_num_threads()))).unwrap()
        };
        assert_eq!(threads(1), vec![4], "a pass alone has every thread");
        assert_eq!(threads(2), vec![2, 2]);
        assert_eq!(threads(3), vec![1, 1, 1]);
        assert_eq!(threads(8), vec![1; 8], "never fewer than one");
    }

    #[test]
    fn a_panic_in_one_pass_is_raised_again() {
        let caught = std::panic::catch_unwind(|| {
            on_threads(vec![1, 2], |i| if i == 2 { panic!("pass {i} failed") } else { Ok(i) })
        });
        let message = stemq_core::engine::panic_message(&*caught.unwrap_err());
        assert_eq!(message.as_deref(), Some("pass 2 failed"));
    }
}
