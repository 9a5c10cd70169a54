//! The enum-valued options of a request and their wire names.
//!
//! Each enum is the one list of its accepted values: serde's derive reads and writes
//! them (and its errors list them, so a bad value is refused with the accepted ones
//! named), the JSON Schema is generated from it, and `wire_names!` gives each
//! `ALL` and `as_str` from the same variants (a test holds `as_str` to serde's names).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `ALL` (every value, in declaration order), `as_str` (the wire name) and `Display`
/// for an options enum; the `match` in `as_str` is exhaustive, so a new variant that is
/// not listed here does not compile.
macro_rules! wire_names {
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every accepted value, in documentation order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// The wire name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

/// A separation model (or engine) a job may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Model {
    /// Hybrid Transformer Demucs v4, 4 sources.
    Htdemucs,
    /// A bag of 4 fine-tuned HTDemucs models, one per source.
    HtdemucsFt,
    /// HTDemucs with 6 sources (adds guitar and piano).
    #[serde(rename = "htdemucs_6s")]
    Htdemucs6s,
    /// Hybrid Demucs v3, retrained on MusDB and 800 songs (one model).
    HdemucsMmi,
    /// A bag of 4 Hybrid Demucs v3 models (the MDX 2021 entry, extra data).
    MdxExtra,
    /// The reproduced MDX bag, its Hybrid Demucs v3 members only.
    ReproMdxAHybridOnly,
    /// The MDX 2021 entry: 2 waveform Demucs and 2 Hybrid Demucs v3, per-source weights.
    Mdx,
    /// `mdx` with DiffQ-quantised weights (smaller download).
    MdxQ,
    /// `mdx_extra` with DiffQ-quantised weights.
    MdxExtraQ,
    /// The reproduced MDX bag: 2 waveform Demucs and 2 Hybrid Demucs v3.
    ReproMdxA,
    /// The reproduced MDX bag, its waveform Demucs members only.
    ReproMdxATimeOnly,
    /// The built-in signal-processing baseline: needs no weights.
    Dsp,
}

wire_names!(Model {
    Htdemucs => "htdemucs",
    HtdemucsFt => "htdemucs_ft",
    Htdemucs6s => "htdemucs_6s",
    HdemucsMmi => "hdemucs_mmi",
    MdxExtra => "mdx_extra",
    ReproMdxAHybridOnly => "repro_mdx_a_hybrid_only",
    Mdx => "mdx",
    MdxQ => "mdx_q",
    MdxExtraQ => "mdx_extra_q",
    ReproMdxA => "repro_mdx_a",
    ReproMdxATimeOnly => "repro_mdx_a_time_only",
    Dsp => "dsp"
});

impl Model {
    /// Parses a wire name.
    pub fn parse(s: &str) -> Option<Model> {
        Model::ALL.iter().copied().find(|m| m.as_str() == s)
    }

    /// The stems this model produces, in output order.
    pub fn sources(self) -> &'static [&'static str] {
        match self {
            Model::Htdemucs6s => &["drums", "bass", "other", "vocals", "guitar", "piano"],
            _ => &["drums", "bass", "other", "vocals"],
        }
    }

    /// The longest segment (seconds) the model was trained on; `None` when any length
    /// works. Requests may ask for shorter segments, never longer ones.
    pub fn max_segment(self) -> Option<f64> {
        match self {
            Model::Htdemucs | Model::HtdemucsFt | Model::Htdemucs6s => Some(7.8),
            // Hybrid and waveform Demucs take chunks of any length (no training-length
            // padding).
            _ => None,
        }
    }
}

/// Container of the written stems.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OutputFormat {
    /// RIFF WAVE, 16-bit PCM.
    #[default]
    Wav,
    /// FLAC, lossless.
    Flac,
    /// MP3 at a constant bit rate (`mp3_bitrate`, `mp3_preset`), as `demucs --mp3`.
    Mp3,
}

wire_names!(OutputFormat { Wav => "wav", Flac => "flac", Mp3 => "mp3" });

/// The MP3 bit rates a request may ask for, in kbit/s: those of MPEG-1 Layer III, the
/// layer of 44.1 kHz stems.
pub const MP3_BITRATES: [u32; 14] = [32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320];
/// The MP3 bit rate when a request names none (Demucs's `--mp3-bitrate` default).
pub const DEFAULT_MP3_BITRATE: u32 = 320;
/// The accepted MP3 encoder presets (Demucs's `--mp3-preset`: LAME's quality, 2 for the
/// best quality to 7 for the fastest).
pub const MP3_PRESETS: std::ops::RangeInclusive<u32> = 2..=7;
/// The MP3 preset when a request names none (Demucs's default).
pub const DEFAULT_MP3_PRESET: u32 = 2;

impl OutputFormat {
    /// File extension of the format.
    pub fn extension(self) -> &'static str {
        self.as_str()
    }
}

/// Sample encoding of the stems (Demucs's default, `--int24`, `--float32`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// 16-bit signed integers.
    #[default]
    S16,
    /// 24-bit signed integers.
    S24,
    /// 32-bit IEEE float (WAV only).
    F32,
}

wire_names!(Encoding { S16 => "s16", S24 => "s24", F32 => "f32" });

/// How samples outside [-1, 1] are handled before writing (Demucs's `--clip-mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ClipMode {
    /// Scale the whole stem down so it never clips (divides by max(1.01 · peak, 1)).
    #[default]
    Rescale,
    /// Clamp each sample to [-1, 1].
    Clamp,
    /// Leave samples alone (integer formats still saturate).
    None,
}

wire_names!(ClipMode { Rescale => "rescale", Clamp => "clamp", None => "none" });

/// How the complement of the stem is made when only one stem is asked for (Demucs's
/// `--other-method`), which also names it, as Demucs does: `no_<stem>` for `add`,
/// `minus_<stem>` for `minus`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OtherMethod {
    /// `no_<stem>`: the sum of the other stems the model predicted.
    #[default]
    Add,
    /// `minus_<stem>`: the input mixture minus the stem.
    Minus,
    /// No complement at all.
    None,
}

wire_names!(OtherMethod { Add => "add", Minus => "minus", None => "none" });

/// Which lane of its pool a job waits in. A worker takes every interactive job it can
/// run before any batch job; within a lane, jobs run in the order they were queued.
/// Not part of the job id: it says when to compute, not what.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Someone is waiting for it (the default of the HTTP API).
    #[default]
    Interactive,
    /// Bulk work: runs when no interactive job of the pool waits.
    Batch,
}

wire_names!(Priority { Interactive => "interactive", Batch => "batch" });

impl Priority {
    /// Parses a wire name.
    pub fn parse(s: &str) -> Option<Priority> {
        Priority::ALL.iter().copied().find(|p| p.as_str() == s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::de::DeserializeOwned;

    /// `as_str` is serde's name for every value, and serde reads it back.
    fn agrees<T: Copy + PartialEq + std::fmt::Debug + Serialize + DeserializeOwned>(
        all: &[T],
        name: fn(T) -> &'static str,
    ) {
        for &v in all {
            assert_eq!(serde_json::to_value(v).unwrap(), serde_json::json!(name(v)), "{v:?}");
            assert_eq!(serde_json::from_value::<T>(serde_json::json!(name(v))).unwrap(), v);
        }
    }

    #[test]
    fn wire_names_are_serdes_names() {
        agrees(Model::ALL, Model::as_str);
        agrees(OutputFormat::ALL, OutputFormat::as_str);
        agrees(Encoding::ALL, Encoding::as_str);
        agrees(ClipMode::ALL, ClipMode::as_str);
        agrees(OtherMethod::ALL, OtherMethod::as_str);
        agrees(Priority::ALL, Priority::as_str);
        assert_eq!(Model::parse("htdemucs_6s"), Some(Model::Htdemucs6s));
        assert_eq!(Model::parse("spleeter"), None);
        assert_eq!(OutputFormat::Flac.extension(), "flac");
        assert_eq!(OutputFormat::Mp3.extension(), "mp3");
    }
}
