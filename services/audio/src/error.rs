//! Owns the crate's single error type, [`AudioError`].
//!
//! Every failure this crate can report is one variant. The input-related
//! variants ([`AudioError::NotAudio`], [`AudioError::UnsupportedCodec`],
//! [`AudioError::Empty`], [`AudioError::TooLong`], [`AudioError::CorruptFrame`],
//! [`AudioError::SampleRate`], [`AudioError::TooLarge`], [`AudioError::Undecodable`])
//! are permanent: retrying the same bytes gives the same answer. I/O errors
//! are kept apart in [`AudioError::Io`] because they may be transient.

use std::io;

/// Every error produced by `stemq-audio`.
#[derive(Debug, thiserror::Error)]
pub enum AudioError {
    /// The bytes are not an audio file of any supported container (WAV, FLAC, MP3, Ogg).
    #[error("not a valid audio file: {detail}")]
    NotAudio {
        /// What the probe saw, for logs.
        detail: String,
    },
    /// The container is recognised but the codec inside it is not supported.
    #[error("unsupported audio codec: {codec}")]
    UnsupportedCodec {
        /// Human-readable name of the codec (e.g. `"AAC"`, `"WAV format tag 0x0055"`).
        codec: String,
    },
    /// The file is valid but holds no audio samples.
    #[error("the audio file is empty: it contains no samples")]
    Empty,
    /// The audio is longer than the configured maximum.
    #[error("the audio is too long: {duration} exceeds the maximum of {max}")]
    TooLong {
        /// Duration found, formatted `mm:ss` (or `>= mm:ss` if found while decoding).
        duration: String,
        /// The configured maximum, formatted `mm:ss`.
        max: String,
    },
    /// A frame could not be decoded; the file is damaged or truncated.
    #[error("corrupt audio frame at {at}: {detail}")]
    CorruptFrame {
        /// Position in the track where decoding failed, formatted `mm:ss`.
        at: String,
        /// What went wrong, from the decoder.
        detail: String,
    },
    /// The source's sample rate is outside what any real recording uses
    /// ([`crate::decode::MIN_SAMPLE_RATE`]`..=`[`crate::decode::MAX_SAMPLE_RATE`]).
    #[error(
        "unsupported sample rate: {rate} Hz (accepted: {} to {} Hz)",
        crate::decode::MIN_SAMPLE_RATE,
        crate::decode::MAX_SAMPLE_RATE
    )]
    SampleRate {
        /// The rate the header declares.
        rate: u32,
    },
    /// The decoded audio would be more than [`crate::decode::MAX_EXPANSION`] times
    /// larger than the file: the header claims far more audio than the file can hold.
    #[error(
        "the file ({input_bytes} bytes) would decode to more than {max_ratio} times its size; \
         its header claims more audio than it can hold"
    )]
    TooLarge {
        /// Size of the input file.
        input_bytes: u64,
        /// The largest accepted ratio of decoded bytes (stereo `f32`) to input bytes.
        max_ratio: u64,
    },
    /// The decoder failed on these bytes in a way it does not report as an error (a
    /// panic inside symphonia or a conversion step, caught): bad input, not a fault
    /// of the engine.
    #[error("the decoder cannot read this file: {detail}")]
    Undecodable {
        /// The first line of the decoder's panic message.
        detail: String,
    },
    /// The operation was cancelled by the caller's cancellation check.
    #[error("cancelled")]
    Cancelled,
    /// A caller passed an invalid argument (bad sample rate, wrong chunk shape, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The output format was left out of this build (a cargo feature of `stemq-audio`).
    #[error("{format} output is not built into this program (stemq-audio's `{feature}` feature)")]
    FormatUnavailable {
        /// The format's name, e.g. `"MP3"`.
        format: &'static str,
        /// The cargo feature that brings it.
        feature: &'static str,
    },
    /// An internal failure that should not happen (resampler construction, ...).
    #[error("internal audio error: {0}")]
    Internal(String),
    /// Reading or writing failed at the operating-system level.
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

impl AudioError {
    /// True for errors caused by the input bytes themselves (retrying cannot help).
    pub fn is_input_error(&self) -> bool {
        matches!(
            self,
            AudioError::NotAudio { .. }
                | AudioError::UnsupportedCodec { .. }
                | AudioError::Empty
                | AudioError::TooLong { .. }
                | AudioError::CorruptFrame { .. }
                | AudioError::SampleRate { .. }
                | AudioError::TooLarge { .. }
                | AudioError::Undecodable { .. }
        )
    }
}

/// Formats seconds as `mm:ss` (minutes may exceed 59, e.g. `75:03`).
pub fn format_mmss(secs: f64) -> String {
    let total = if secs.is_finite() && secs > 0.0 { secs.floor() as u64 } else { 0 };
    format!("{:02}:{:02}", total / 60, total % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mmss() {
        assert_eq!(format_mmss(0.0), "00:00");
        assert_eq!(format_mmss(61.9), "01:01");
        assert_eq!(format_mmss(4503.0), "75:03");
    }
}
