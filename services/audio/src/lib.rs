//! `stemq-audio`: everything stemq does with audio samples.
//!
//! * [`decode`] — streamed decoding of every format in [`SUPPORTED`] into stereo `f32`
//!   chunks at 44.1 kHz, with typed input errors; `container` names a file from its
//!   bytes, `opus` is the Opus codec;
//! * [`encode`] — streamed WAV (16/24-bit PCM, 32-bit float), FLAC (16/24, with
//!   LPC and the MD5 of the samples) and MP3 (LAME, `mp3` feature) stem writers with
//!   Demucs's clip modes, and file summaries for manifests;
//! * [`dsp`] — the weight-free baseline separation engine (vocals, drums,
//!   bass, other), streamed with bounded memory;
//! * [`engine`] — [`DspEngine`], the `dsp` separator behind stemq's engine seam;
//! * [`error`] — the single error enum, [`AudioError`];
//! * `preflight` — metadata lengths checked against the file before symphonia
//!   allocates them.
//!
//! The typical pipeline is [`separate_file`]: decode → separate → encode,
//! chunk by chunk, with memory independent of the track's length.

mod aac;
pub mod chunk;
mod container;
pub mod decode;
pub mod dsp;
pub mod encode;
pub mod engine;
pub mod error;
pub mod flac;
#[cfg(feature = "mp3")]
pub mod mp3;
mod opus;
mod preflight;
mod resample;
pub mod synth;
pub mod wav;

pub use chunk::StereoChunk;
pub use container::SUPPORTED;
pub use decode::{probe_duration_ms, DecodeOptions, Decoder, SourceInfo, ENGINE_SAMPLE_RATE};
pub use dsp::{separate_file, DspOptions, DspSeparator, EncodeSettings, Stem, StemOutput};
pub use encode::{summarize_file, ClipMode, FileSummary, Mp3Settings, OutputFormat, StemEncoder};
pub use engine::DspEngine;
pub use error::AudioError;
