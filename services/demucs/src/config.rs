//! Hyperparameters of `demucs.htdemucs.HTDemucs.__init__` and of Hybrid Demucs
//! (`demucs.hdemucs.HDemucs.__init__`, v3) in demucs 4.1.0, read from a checkpoint's
//! pickled `args` and `kwargs`, with each class's own defaults ([`Arch`] says which).
//! Options this port does not implement are refused with [`DemucsError::Unsupported`]
//! when their value differs from what the released models use.

use crate::error::DemucsError;
use crate::pickle::Value;

/// `HTDemucs(...)` keyword arguments that matter for inference.
#[derive(Debug, Clone, PartialEq)]
pub struct HTDemucsConfig {
    /// Source names, in output order.
    pub sources: Vec<String>,
    /// Audio channels (2).
    pub audio_channels: usize,
    /// Hidden channels of the first layer (48).
    pub channels: usize,
    /// Time-branch channels when different (`channels_time`).
    pub channels_time: Option<usize>,
    /// Channel growth per layer (2).
    pub growth: f64,
    /// STFT size (4096); hop is nfft / 4.
    pub nfft: usize,
    /// Complex-as-channels (must be true).
    pub cac: bool,
    /// Encoder/decoder depth (4).
    pub depth: usize,
    /// 1x1 "rewrite" convolutions.
    pub rewrite: bool,
    /// Weight of the frequency embedding (0.2; 0 = none).
    pub freq_emb: f64,
    /// Scale of the frequency embedding (10).
    pub emb_scale: f64,
    /// Kernel size (8).
    pub kernel_size: usize,
    /// Stride of the time layer after a merge (2).
    pub time_stride: usize,
    /// Stride (4).
    pub stride: usize,
    /// Decoder rewrite context (1).
    pub context: usize,
    /// Encoder rewrite context (0).
    pub context_enc: usize,
    /// First layer with GroupNorm (4).
    pub norm_starts: usize,
    /// GroupNorm groups (4).
    pub norm_groups: usize,
    /// DConv in encoder (bit 1) and decoder (bit 2).
    pub dconv_mode: usize,
    /// DConv depth (2; negative = no dilation).
    pub dconv_depth: i64,
    /// DConv compression (8).
    pub dconv_comp: f64,
    /// Channels of the transformer (512; 0 = no up/down 1x1 convs).
    pub bottom_channels: usize,
    /// Transformer layers per branch (5).
    pub t_layers: usize,
    /// FFN hidden scale (4).
    pub t_hidden_scale: f64,
    /// Attention heads (8).
    pub t_heads: usize,
    /// LayerNorm before the transformer.
    pub t_norm_in: bool,
    /// Pre-norm layers (must be true).
    pub t_norm_first: bool,
    /// GroupNorm(1) at the end of each layer.
    pub t_norm_out: bool,
    /// Sin embedding max period (1e4).
    pub t_max_period: f64,
    /// LayerScale in the transformer layers.
    pub t_layer_scale: bool,
    /// GELU (true) or ReLU FFN activation.
    pub t_gelu: bool,
    /// Weight of the positional embedding (1).
    pub t_weight_pos_embed: f64,
    /// Cross attention first (false).
    pub t_cross_first: bool,
    /// Sample rate (44100).
    pub samplerate: u32,
    /// Training segment in seconds as a fraction (39/5).
    pub segment: (i64, i64),
    /// Pad inputs to the training segment.
    pub use_train_segment: bool,
    /// Which class the checkpoint builds.
    pub arch: Arch,
    /// Hybrid Demucs: the MDX models' zero-padded, shifted spectrogram.
    pub hybrid_old: bool,
    /// Hybrid Demucs: DConv layers at this index and deeper hold a BLSTM.
    pub dconv_lstm: usize,
    /// Hybrid Demucs: DConv layers at this index and deeper hold a LocalState.
    pub dconv_attn: usize,
    /// Hybrid Demucs: `MultiWrap` band split ratios (empty: none).
    pub multi_freqs: Vec<f64>,
    /// Hybrid Demucs: how many outer layers `MultiWrap` wraps.
    pub multi_freqs_depth: usize,
    /// Waveform Demucs: BLSTM layers at the bottom (0 in every released model).
    pub lstm_layers: usize,
    /// Waveform Demucs: GLU after the rewrite convolutions (else ReLU).
    pub glu: bool,
    /// Waveform Demucs: GELU after the main convolutions (else ReLU).
    pub gelu: bool,
    /// Waveform Demucs: normalise each input by its mono mix's mean and std.
    pub normalize: bool,
    /// Waveform Demucs: run the network at twice the sample rate.
    pub resample: bool,
}

/// The model class of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `demucs.htdemucs.HTDemucs` (v4): cross-transformer between the branches.
    HTDemucs,
    /// `demucs.hdemucs.HDemucs` (v3, Hybrid Demucs): the branches merge in the deepest
    /// layers; no transformer.
    HDemucs,
    /// `demucs.demucs.Demucs`: the waveform model (time domain only).
    Demucs,
}

impl Arch {
    /// The class's dotted path, as checkpoints name it.
    pub fn class_path(self) -> &'static str {
        match self {
            Arch::HTDemucs => "demucs.htdemucs.HTDemucs",
            Arch::HDemucs => "demucs.hdemucs.HDemucs",
            Arch::Demucs => "demucs.demucs.Demucs",
        }
    }

    /// The class named `path`, if this port has it.
    pub fn from_class_path(path: &str) -> Option<Arch> {
        [Arch::HTDemucs, Arch::HDemucs, Arch::Demucs].into_iter().find(|a| a.class_path() == path)
    }
}

impl Default for HTDemucsConfig {
    fn default() -> Self {
        HTDemucsConfig {
            sources: ["drums", "bass", "other", "vocals"].map(String::from).to_vec(),
            audio_channels: 2,
            channels: 48,
            channels_time: None,
            growth: 2.0,
            nfft: 4096,
            cac: true,
            depth: 4,
            rewrite: true,
            freq_emb: 0.2,
            emb_scale: 10.0,
            kernel_size: 8,
            time_stride: 2,
            stride: 4,
            context: 1,
            context_enc: 0,
            norm_starts: 4,
            norm_groups: 4,
            dconv_mode: 1,
            dconv_depth: 2,
            dconv_comp: 8.0,
            bottom_channels: 0,
            t_layers: 5,
            t_hidden_scale: 4.0,
            t_heads: 8,
            t_norm_in: true,
            t_norm_first: true,
            t_norm_out: true,
            t_max_period: 10000.0,
            t_layer_scale: true,
            t_gelu: true,
            t_weight_pos_embed: 1.0,
            t_cross_first: false,
            samplerate: 44100,
            segment: (10, 1),
            use_train_segment: true,
            arch: Arch::HTDemucs,
            hybrid_old: false,
            dconv_lstm: usize::MAX,
            dconv_attn: usize::MAX,
            multi_freqs: Vec::new(),
            multi_freqs_depth: 2,
            lstm_layers: 0,
            glu: true,
            gelu: true,
            normalize: true,
            resample: true,
        }
    }
}

impl HTDemucsConfig {
    /// `HDemucs.__init__`'s defaults (depth 6, DConv compression 4, BLSTM and LocalState
    /// from layer 4, segment 40 s, no transformer, any input length).
    pub fn hdemucs_defaults() -> Self {
        HTDemucsConfig {
            depth: 6,
            dconv_comp: 4.0,
            t_layers: 0,
            bottom_channels: 0,
            segment: (40, 1),
            use_train_segment: false,
            arch: Arch::HDemucs,
            dconv_lstm: 4,
            dconv_attn: 4,
            ..HTDemucsConfig::default()
        }
    }
}

impl HTDemucsConfig {
    /// `Demucs.__init__`'s defaults (the waveform model: 64 channels, depth 6, GroupNorm,
    /// BLSTM and LocalState from layer 4, resampling, normalisation, segment 40 s).
    pub fn demucs_defaults() -> Self {
        HTDemucsConfig {
            channels: 64,
            depth: 6,
            dconv_comp: 4.0,
            t_layers: 0,
            bottom_channels: 0,
            segment: (40, 1),
            use_train_segment: false,
            arch: Arch::Demucs,
            dconv_lstm: 4,
            dconv_attn: 4,
            ..HTDemucsConfig::default()
        }
    }
}

/// The parameters of `demucs.demucs.Demucs.__init__` (4.1.0) in order.
pub const DEMUCS_PARAMS: &[&str] = &[
    "sources",
    "audio_channels",
    "channels",
    "growth",
    "depth",
    "rewrite",
    "lstm_layers",
    "kernel_size",
    "stride",
    "context",
    "gelu",
    "glu",
    "norm_starts",
    "norm_groups",
    "dconv_mode",
    "dconv_depth",
    "dconv_comp",
    "dconv_attn",
    "dconv_lstm",
    "dconv_init",
    "normalize",
    "resample",
    "rescale",
    "samplerate",
    "segment",
];

/// The parameters of `demucs.hdemucs.HDemucs.__init__` (4.1.0) in order.
pub const HDEMUCS_PARAMS: &[&str] = &[
    "sources",
    "audio_channels",
    "channels",
    "channels_time",
    "growth",
    "nfft",
    "wiener_iters",
    "end_iters",
    "wiener_residual",
    "cac",
    "depth",
    "rewrite",
    "hybrid",
    "hybrid_old",
    "multi_freqs",
    "multi_freqs_depth",
    "freq_emb",
    "emb_scale",
    "emb_smooth",
    "kernel_size",
    "time_stride",
    "stride",
    "context",
    "context_enc",
    "norm_starts",
    "norm_groups",
    "dconv_mode",
    "dconv_depth",
    "dconv_comp",
    "dconv_attn",
    "dconv_lstm",
    "dconv_init",
    "rescale",
    "samplerate",
    "segment",
];

fn bad(key: &str, v: &Value) -> DemucsError {
    DemucsError::Checkpoint(format!("kwarg `{key}` has an unexpected value {v:?}"))
}

fn as_f64(key: &str, v: &Value) -> Result<f64, DemucsError> {
    match v {
        Value::Int(i) => Ok(*i as f64),
        Value::Float(f) => Ok(*f),
        Value::Bool(b) => Ok(*b as i64 as f64),
        _ => Err(bad(key, v)),
    }
}

fn as_usize(key: &str, v: &Value) -> Result<usize, DemucsError> {
    match v {
        Value::Int(i) if *i >= 0 => Ok(*i as usize),
        Value::Bool(b) => Ok(*b as usize),
        Value::Float(f) if f.fract() == 0.0 && *f >= 0.0 => Ok(*f as usize),
        _ => Err(bad(key, v)),
    }
}

fn as_bool(key: &str, v: &Value) -> Result<bool, DemucsError> {
    match v {
        Value::Bool(b) => Ok(*b),
        Value::Int(i) => Ok(*i != 0),
        Value::None => Ok(false),
        Value::Float(f) => Ok(*f != 0.0),
        _ => Err(bad(key, v)),
    }
}

/// Parses `Fraction('39/5')`, `Fraction(39, 5)`, an int or a float into num/den.
fn as_fraction(key: &str, v: &Value) -> Result<(i64, i64), DemucsError> {
    match v {
        Value::Int(i) => Ok((*i, 1)),
        Value::Float(f) => {
            // Exact enough for segments like 7.8: find a small denominator.
            for den in 1..=1000i64 {
                let num = (f * den as f64).round();
                if (num / den as f64 - f).abs() < 1e-9 {
                    return Ok((num as i64, den));
                }
            }
            Err(bad(key, v))
        }
        Value::Object { callable, args, state, .. } => {
            let is_fraction = matches!(callable.as_ref(), Value::Global(m, n) if m == "fractions" && n == "Fraction");
            if !is_fraction {
                return Err(bad(key, v));
            }
            let parts: Vec<Value> = match (args.as_ref(), state) {
                (Value::Tuple(a), _) if !a.is_empty() => a.clone(),
                (_, Some(s)) => vec![s.as_ref().clone()],
                _ => return Err(bad(key, v)),
            };
            match parts.as_slice() {
                [Value::Str(s)] => {
                    let (n, d) = s.split_once('/').unwrap_or((s.as_str(), "1"));
                    let n: i64 = n.trim().parse().map_err(|_| bad(key, v))?;
                    let d: i64 = d.trim().parse().map_err(|_| bad(key, v))?;
                    Ok((n, d))
                }
                [Value::Int(n), Value::Int(d)] => Ok((*n, *d)),
                [Value::Int(n)] => Ok((*n, 1)),
                _ => Err(bad(key, v)),
            }
        }
        _ => Err(bad(key, v)),
    }
}

/// The parameters of `demucs.htdemucs.HTDemucs.__init__` (4.1.0) in order: where the
/// checkpoint's positional `args` land (demucs builds the model as `klass(*args,
/// **kwargs)`).
pub const HTDEMUCS_PARAMS: &[&str] = &[
    "sources",
    "audio_channels",
    "channels",
    "channels_time",
    "growth",
    "nfft",
    "wiener_iters",
    "end_iters",
    "wiener_residual",
    "cac",
    "depth",
    "rewrite",
    "multi_freqs",
    "multi_freqs_depth",
    "freq_emb",
    "emb_scale",
    "emb_smooth",
    "kernel_size",
    "time_stride",
    "stride",
    "context",
    "context_enc",
    "norm_starts",
    "norm_groups",
    "dconv_mode",
    "dconv_depth",
    "dconv_comp",
    "dconv_init",
    "bottom_channels",
    "t_layers",
    "t_emb",
    "t_hidden_scale",
    "t_heads",
    "t_dropout",
    "t_max_positions",
    "t_norm_in",
    "t_norm_in_group",
    "t_group_norm",
    "t_norm_first",
    "t_norm_out",
    "t_max_period",
    "t_weight_decay",
    "t_lr",
    "t_layer_scale",
    "t_gelu",
    "t_weight_pos_embed",
    "t_sin_random_shift",
    "t_cape_mean_normalize",
    "t_cape_augment",
    "t_cape_glob_loc_scale",
    "t_sparse_self_attn",
    "t_sparse_cross_attn",
    "t_mask_type",
    "t_mask_random_seed",
    "t_sparse_attn_window",
    "t_global_window",
    "t_sparsity",
    "t_auto_sparsity",
    "t_cross_first",
    "rescale",
    "samplerate",
    "segment",
    "use_train_segment",
];

/// The keyword arguments a call `klass(*args, **kwargs)` binds, as one dict: the
/// positional `args` named by `params` (in order), then `kwargs`. Like Python, a
/// parameter given both ways, or more positional arguments than parameters, is an error.
pub fn bind_args(params: &[&str], args: &Value, kwargs: &Value) -> Result<Value, DemucsError> {
    let positional: &[Value] = match args {
        Value::List(l) | Value::Tuple(l) => l,
        Value::None => &[],
        other => return Err(DemucsError::Checkpoint(format!("`args` is not a list: {other:?}"))),
    };
    let named = kwargs.dict_items().ok_or_else(|| DemucsError::Checkpoint("`kwargs` is not a dict".into()))?;
    if positional.len() > params.len() {
        return Err(DemucsError::Checkpoint(format!(
            "{} positional arguments; the model takes at most {}",
            positional.len(),
            params.len()
        )));
    }
    let mut items: Vec<(Value, Value)> =
        params.iter().zip(positional).map(|(p, v)| (Value::Str(p.to_string()), v.clone())).collect();
    for (k, v) in named {
        if let Some(key) = k.as_str().filter(|k| params[..positional.len()].contains(k)) {
            return Err(DemucsError::Checkpoint(format!("`{key}` given both in `args` and in `kwargs`")));
        }
        items.push((k.clone(), v.clone()));
    }
    Ok(Value::Dict(items))
}

impl HTDemucsConfig {
    /// Reads a checkpoint's `args` and `kwargs` as demucs passes them to the class
    /// (`klass(*args, **kwargs)`): `sources` may come first in `args` rather than in
    /// `kwargs`.
    pub fn from_args_kwargs(args: &Value, kwargs: &Value) -> Result<Self, DemucsError> {
        Self::from_kwargs(&bind_args(HTDEMUCS_PARAMS, args, kwargs)?)
    }

    /// The configuration of a checkpoint of class `arch` from its `args` and `kwargs`.
    pub fn for_arch(arch: Arch, args: &Value, kwargs: &Value) -> Result<Self, DemucsError> {
        match arch {
            Arch::HTDemucs => Self::from_args_kwargs(args, kwargs),
            Arch::HDemucs => Self::read_kwargs(Self::hdemucs_defaults(), &bind_args(HDEMUCS_PARAMS, args, kwargs)?),
            Arch::Demucs => Self::read_kwargs(Self::demucs_defaults(), &bind_args(DEMUCS_PARAMS, args, kwargs)?),
        }
    }

    /// Reads the pickled `kwargs` of a checkpoint. Unknown keys are ignored (demucs
    /// drops them too); options with behaviour this port lacks are refused.
    pub fn from_kwargs(kwargs: &Value) -> Result<Self, DemucsError> {
        Self::read_kwargs(HTDemucsConfig::default(), kwargs)
    }

    /// `kwargs` over the defaults `c`.
    fn read_kwargs(mut c: HTDemucsConfig, kwargs: &Value) -> Result<Self, DemucsError> {
        let items = kwargs.dict_items().ok_or_else(|| DemucsError::Checkpoint("`kwargs` is not a dict".into()))?;
        let mut have_sources = false;
        for (k, v) in items {
            let Some(key) = k.as_str() else { continue };
            match key {
                "sources" => {
                    let (Value::List(l) | Value::Tuple(l)) = v else {
                        return Err(bad(key, v));
                    };
                    c.sources = l
                        .iter()
                        .map(|s| s.as_str().map(String::from).ok_or_else(|| bad(key, v)))
                        .collect::<Result<_, _>>()?;
                    have_sources = true;
                }
                "audio_channels" => c.audio_channels = as_usize(key, v)?,
                "channels" => c.channels = as_usize(key, v)?,
                "channels_time" => {
                    c.channels_time = match v {
                        Value::None => None,
                        _ => Some(as_usize(key, v)?),
                    }
                }
                "growth" => c.growth = as_f64(key, v)?,
                "nfft" => c.nfft = as_usize(key, v)?,
                "cac" => c.cac = as_bool(key, v)?,
                "depth" => c.depth = as_usize(key, v)?,
                "rewrite" => c.rewrite = as_bool(key, v)?,
                "freq_emb" => c.freq_emb = as_f64(key, v)?,
                "emb_scale" => c.emb_scale = as_f64(key, v)?,
                "kernel_size" => c.kernel_size = as_usize(key, v)?,
                "time_stride" => c.time_stride = as_usize(key, v)?,
                "stride" => c.stride = as_usize(key, v)?,
                "context" => c.context = as_usize(key, v)?,
                "context_enc" => c.context_enc = as_usize(key, v)?,
                "norm_starts" => c.norm_starts = as_usize(key, v)?,
                "norm_groups" => c.norm_groups = as_usize(key, v)?,
                "dconv_mode" => c.dconv_mode = as_usize(key, v)?,
                "dconv_depth" => c.dconv_depth = as_f64(key, v)? as i64,
                "dconv_comp" => c.dconv_comp = as_f64(key, v)?,
                "bottom_channels" => c.bottom_channels = as_usize(key, v)?,
                "t_layers" => c.t_layers = as_usize(key, v)?,
                "t_hidden_scale" => c.t_hidden_scale = as_f64(key, v)?,
                "t_heads" => c.t_heads = as_usize(key, v)?,
                "t_norm_in" => c.t_norm_in = as_bool(key, v)?,
                "t_norm_first" => c.t_norm_first = as_bool(key, v)?,
                "t_norm_out" => c.t_norm_out = as_bool(key, v)?,
                "t_max_period" => c.t_max_period = as_f64(key, v)?,
                "t_layer_scale" => c.t_layer_scale = as_bool(key, v)?,
                "t_gelu" => c.t_gelu = as_bool(key, v)?,
                "t_weight_pos_embed" => c.t_weight_pos_embed = as_f64(key, v)?,
                "t_cross_first" => c.t_cross_first = as_bool(key, v)?,
                "samplerate" => c.samplerate = as_usize(key, v)? as u32,
                "segment" => c.segment = as_fraction(key, v)?,
                "use_train_segment" => c.use_train_segment = as_bool(key, v)?,
                "hybrid_old" => c.hybrid_old = as_bool(key, v)?,
                "lstm_layers" => c.lstm_layers = as_usize(key, v)?,
                "glu" => c.glu = as_bool(key, v)?,
                "gelu" => c.gelu = as_bool(key, v)?,
                "normalize" => c.normalize = as_bool(key, v)?,
                "resample" => c.resample = as_bool(key, v)?,
                "dconv_lstm" => c.dconv_lstm = as_usize(key, v)?,
                "dconv_attn" => c.dconv_attn = as_usize(key, v)?,
                "hybrid" if !as_bool(key, v)? => {
                    return Err(DemucsError::Unsupported("hybrid = false (no time branch)".into()))
                }
                "wiener_residual" if as_bool(key, v)? => {
                    return Err(DemucsError::Unsupported("wiener_residual (Wiener filtering)".into()))
                }
                // Options whose non-default values change inference and are not ported.
                "wiener_iters" | "end_iters" if as_f64(key, v)? != 0.0 => {
                    return Err(DemucsError::Unsupported(format!("{key} > 0 (Wiener filtering)")))
                }
                "multi_freqs" => {
                    c.multi_freqs = match v {
                        Value::None => Vec::new(),
                        Value::List(l) | Value::Tuple(l) => {
                            l.iter().map(|r| as_f64(key, r)).collect::<Result<_, _>>()?
                        }
                        _ => return Err(bad(key, v)),
                    }
                }
                "multi_freqs_depth" => c.multi_freqs_depth = as_usize(key, v)?,
                "t_emb" if v.as_str() != Some("sin") => {
                    return Err(DemucsError::Unsupported(format!("t_emb {v:?} (only `sin`)")))
                }
                "t_norm_in_group" | "t_group_norm" | "t_sparse_self_attn" | "t_sparse_cross_attn"
                    if as_bool(key, v)? =>
                {
                    return Err(DemucsError::Unsupported(format!("{key} = true")))
                }
                "t_sin_random_shift" if as_f64(key, v)? != 0.0 => {
                    return Err(DemucsError::Unsupported("t_sin_random_shift > 0".into()))
                }
                _ => {}
            }
        }
        if !have_sources {
            return Err(DemucsError::Checkpoint("kwargs without `sources`".into()));
        }
        if !c.multi_freqs.is_empty() && c.arch == Arch::HTDemucs {
            return Err(DemucsError::Unsupported("multi_freqs (MultiWrap) in HTDemucs".into()));
        }
        if !c.cac && c.arch == Arch::HTDemucs {
            return Err(DemucsError::Unsupported("cac = false in HTDemucs (masking models)".into()));
        }
        if !c.t_norm_first && c.t_layers > 0 {
            return Err(DemucsError::Unsupported("t_norm_first = false".into()));
        }
        if !c.nfft.is_multiple_of(4) || !c.nfft.is_power_of_two() {
            return Err(DemucsError::Unsupported(format!("nfft {}", c.nfft)));
        }
        Ok(c)
    }

    /// STFT hop length (nfft / 4).
    pub fn hop_length(&self) -> usize {
        self.nfft / 4
    }

    /// Training segment in seconds.
    pub fn segment_seconds(&self) -> f64 {
        self.segment.0 as f64 / self.segment.1 as f64
    }

    /// `int(segment * samplerate)`, exactly as Python computes it with a Fraction.
    pub fn training_length(&self) -> usize {
        ((self.segment.0 * self.samplerate as i64) / self.segment.1) as usize
    }
}
