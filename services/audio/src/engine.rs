//! The `dsp` separator as a pipeline engine: [`DspEngine`] implements
//! [`stemq_core::engine::Engine`].
//!
//! This module owns the translation between the worker's engine seam and this crate:
//! request fields → [`DecodeOptions`], [`DspOptions`] and [`EncodeSettings`], the
//! worker's progress and cancellation callbacks → [`separate_file`]'s, and
//! [`AudioError`] → [`EngineError`] (input errors are permanent with a stable code and a
//! message for people, cancellation is [`EngineError::Cancelled`], I/O is transient).
//! It also keeps the model allow-list honest: this engine runs `dsp` and nothing else.

use stemq_core::device::Device;
use stemq_core::engine::{Engine, EngineContext, EngineError, EngineJob, StemAudio, StemFile};
use stemq_core::failure::FailureCode;
use stemq_core::request::{ClipMode, Encoding, Model, OutputFormat as RequestFormat};
use tracing::{debug, info_span};

use crate::dsp::{separate_file, DspOptions, EncodeSettings, Stem};
use crate::encode::{Mp3Settings, OutputFormat};
use crate::error::AudioError;
use crate::SUPPORTED;
use crate::{DecodeOptions, ENGINE_SAMPLE_RATE};

/// Default longest accepted input: 3 hours.
pub const DEFAULT_MAX_DURATION_SECS: f64 = 3.0 * 3600.0;

/// The weight-free `dsp` separation engine (CPU only).
#[derive(Debug, Clone)]
pub struct DspEngine {
    /// Inputs longer than this many seconds fail with `too_long`.
    pub max_duration_secs: f64,
}

impl Default for DspEngine {
    fn default() -> Self {
        DspEngine { max_duration_secs: DEFAULT_MAX_DURATION_SECS }
    }
}

impl DspEngine {
    /// An engine rejecting inputs longer than `max_duration_secs`.
    pub fn with_max_duration(max_duration_secs: f64) -> Self {
        DspEngine { max_duration_secs }
    }
}

/// The stem file format and clip mode a request asks for (shared by every engine that
/// writes stems with this crate).
pub fn output_settings(req: &stemq_core::NormalizedRequest) -> (OutputFormat, ClipMode) {
    let format = match (req.output_format, req.encoding) {
        (RequestFormat::Wav, Encoding::S16) => OutputFormat::Wav16,
        (RequestFormat::Wav, Encoding::S24) => OutputFormat::Wav24,
        (RequestFormat::Wav, Encoding::F32) => OutputFormat::WavF32,
        (RequestFormat::Flac, Encoding::S24) => OutputFormat::Flac24,
        // f32 FLAC is refused at validation; 16 bit is the safe reading.
        (RequestFormat::Flac, _) => OutputFormat::Flac16,
        // A validated MP3 request always names both; the defaults are the safe reading.
        (RequestFormat::Mp3, _) => {
            let default = Mp3Settings::default();
            OutputFormat::Mp3(Mp3Settings {
                bitrate_kbps: req.mp3_bitrate.and_then(|b| u16::try_from(b).ok()).unwrap_or(default.bitrate_kbps),
                quality: req.mp3_preset.and_then(|p| u8::try_from(p).ok()).unwrap_or(default.quality),
            })
        }
    };
    (format, req.clip_mode)
}

/// Maps this crate's errors onto the engine seam.
pub fn engine_error(e: AudioError) -> EngineError {
    let invalid = |code: FailureCode, message: String| EngineError::InvalidInput { code, message };
    match e {
        AudioError::NotAudio { detail } => invalid(
            FailureCode::InvalidAudio,
            format!("the input is not an audio file stemq can read ({detail}); stemq reads {SUPPORTED}"),
        ),
        AudioError::UnsupportedCodec { codec } => invalid(
            FailureCode::UnsupportedCodec,
            format!("the input is {codec}, which stemq does not decode; stemq reads {SUPPORTED}"),
        ),
        AudioError::Empty => invalid(FailureCode::EmptyAudio, "the input contains no audio samples".into()),
        AudioError::TooLong { duration, max } => {
            invalid(FailureCode::TooLong, format!("the input lasts {duration}, longer than the maximum of {max}"))
        }
        AudioError::CorruptFrame { at, detail } => {
            invalid(FailureCode::CorruptAudio, format!("the input is damaged: corrupt frame at {at} ({detail})"))
        }
        AudioError::SampleRate { .. } => {
            invalid(FailureCode::InvalidAudio, format!("the input is not an audio file stemq can read ({e})"))
        }
        AudioError::TooLarge { .. } => invalid(FailureCode::InvalidAudio, format!("the input is refused: {e}")),
        AudioError::Undecodable { detail } => invalid(
            FailureCode::InvalidAudio,
            format!("the input is not an audio file stemq can read (the decoder failed on it: {detail})"),
        ),
        AudioError::Cancelled => EngineError::Cancelled,
        // A build without the format: every worker of this build refuses it alike.
        e @ AudioError::FormatUnavailable { .. } => {
            EngineError::Unsupported { code: FailureCode::InvalidArgument, message: e.to_string() }
        }
        AudioError::Io(e) => EngineError::transient("I/O error", e),
        // Our own bugs: not the input's fault, and another try will not fix them.
        e @ (AudioError::InvalidArgument(_) | AudioError::Internal(_)) => {
            EngineError::Unsupported { code: FailureCode::EngineError, message: e.to_string() }
        }
    }
}

fn stem_of(name: &str) -> Option<Stem> {
    Stem::ALL.into_iter().find(|s| s.name() == name)
}

impl Engine for DspEngine {
    fn name(&self) -> &str {
        "dsp"
    }

    fn devices(&self) -> Vec<Device> {
        vec![Device::Cpu]
    }

    fn models(&self) -> Vec<Model> {
        vec![Model::Dsp]
    }

    fn separate(&self, job: &EngineJob<'_>, ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
        let req = job.request;
        let span = info_span!("dsp.separate", job_id = %job.job_id, attempt = job.attempt);
        let _enter = span.enter();
        if req.model != Model::Dsp {
            return Err(EngineError::Unsupported {
                code: FailureCode::ModelUnavailable,
                message: format!(
                    "model `{}` is not available on this worker (it needs the neural engine); use model `dsp`",
                    req.model
                ),
            });
        }
        let two_stems = match &req.two_stems {
            None => None,
            Some(s) => Some(stem_of(s).ok_or_else(|| EngineError::Unsupported {
                code: FailureCode::InvalidStem,
                message: format!("the dsp engine has no `{s}` stem"),
            })?),
        };
        let (format, clip) = output_settings(req);
        let decode =
            DecodeOptions { target_sample_rate: ENGINE_SAMPLE_RATE, max_duration_secs: Some(self.max_duration_secs) };
        let mut progress = |f: f32| ctx.progress(f, "separate");
        let cancel = || ctx.cancelled();
        let outputs = separate_file(
            job.input,
            job.out_dir,
            &decode,
            &DspOptions { two_stems, other_method: req.other_method.unwrap_or_default() },
            EncodeSettings { format, clip },
            &mut progress,
            &cancel,
        )
        .map_err(engine_error)?;
        // In the order the request lists its stems.
        let mut files = Vec::with_capacity(outputs.len());
        for name in req.stems() {
            let out = outputs.iter().find(|o| o.name == name).ok_or_else(|| EngineError::Unsupported {
                code: FailureCode::EngineError,
                message: format!("no `{name}` stem was written"),
            })?;
            let rate = out.summary.sample_rate;
            debug!(stem = %name, bytes = out.summary.bytes, "stem written");
            files.push(StemFile {
                stem: name,
                path: out.path.clone(),
                audio: Some(StemAudio {
                    sample_rate: rate,
                    frames: (out.summary.duration_secs * f64::from(rate)).round() as u64,
                }),
            });
        }
        Ok(files)
    }
}
