//! How a job request is spelled on the command line, shared by `submit` and
//! `separate` so the two agree on flag names where they mean the same thing.
//!
//! This module owns the mapping from flags to the request document: the demucs
//! spellings (`--two-stems`, `--other-method`, `--segment`, `--overlap`, `--shifts`,
//! `--flac`, `--int24`, `--float32`, `--clip-mode`) parse into typed values here and
//! become the request's fields through the core crate's own enums, so a value the
//! request does not know is refused by the parser, before anything runs.

use clap::{Args, ValueEnum};
use serde_json::Value;
use stemq_core::request::{ClipMode, Encoding, OtherMethod, OutputFormat, Priority};

/// How to split: shared by `submit` and `separate`.
#[derive(Debug, Args, Clone, Default)]
pub struct SplitOpts {
    /// Only this stem and its complement (`no_<stem>`).
    #[arg(long)]
    pub two_stems: Option<String>,
    /// With `--two-stems`: `no_<stem>` as the sum of the other stems (`add`, the
    /// default), as the mixture minus the stem (`minus`), or not at all (`none`).
    #[arg(long, value_enum, requires = "two_stems")]
    pub other_method: Option<OtherMethodArg>,
    /// Segment length in seconds.
    #[arg(long)]
    pub segment: Option<f64>,
    /// Overlap between segments.
    #[arg(long)]
    pub overlap: Option<f64>,
    /// Random shifts (test-time augmentation).
    #[arg(long)]
    pub shifts: Option<u32>,
}

impl SplitOpts {
    /// Sets the given options on a request document.
    pub fn fill(&self, req: &mut Value) {
        let fields = [
            ("two_stems", self.two_stems.clone().map(Value::from)),
            ("other_method", self.other_method.map(|m| json_of(m.method()))),
            ("segment", self.segment.map(Value::from)),
            ("overlap", self.overlap.map(Value::from)),
            ("shifts", self.shifts.map(Value::from)),
        ];
        set_fields(req, fields);
    }
}

/// How the stems are written, in demucs's spellings: shared by `submit` and
/// `separate`.
#[derive(Debug, Args, Clone, Default)]
pub struct OutputOpts {
    /// Write FLAC instead of WAV.
    #[arg(long)]
    pub flac: bool,
    /// 24-bit integer samples.
    #[arg(long, conflicts_with = "float32")]
    pub int24: bool,
    /// 32-bit float samples (WAV only).
    #[arg(long)]
    pub float32: bool,
    /// Samples outside [-1, 1]: scale the stem down (`rescale`, the default), `clamp`
    /// them, or leave them (`none`).
    #[arg(long, value_enum)]
    pub clip_mode: Option<ClipModeArg>,
}

impl OutputOpts {
    /// The container the flags ask for, if they ask.
    pub fn format(&self) -> Option<OutputFormat> {
        self.flac.then_some(OutputFormat::Flac)
    }

    /// The sample encoding the flags ask for, if they ask.
    pub fn encoding(&self) -> Option<Encoding> {
        if self.float32 {
            Some(Encoding::F32)
        } else if self.int24 {
            Some(Encoding::S24)
        } else {
            None
        }
    }
}

/// `--other-method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OtherMethodArg {
    /// The sum of the other stems.
    Add,
    /// The mixture minus the stem.
    Minus,
    /// No complement.
    None,
}

impl OtherMethodArg {
    /// The request's value.
    pub fn method(self) -> OtherMethod {
        match self {
            OtherMethodArg::Add => OtherMethod::Add,
            OtherMethodArg::Minus => OtherMethod::Minus,
            OtherMethodArg::None => OtherMethod::None,
        }
    }
}

/// `--clip-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ClipModeArg {
    /// Scale the whole stem down so it never clips.
    Rescale,
    /// Clamp each sample.
    Clamp,
    /// Leave samples alone.
    None,
}

impl ClipModeArg {
    /// The request's value.
    pub fn mode(self) -> ClipMode {
        match self {
            ClipModeArg::Rescale => ClipMode::Rescale,
            ClipModeArg::Clamp => ClipMode::Clamp,
            ClipModeArg::None => ClipMode::None,
        }
    }
}

/// `submit --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// RIFF WAVE.
    Wav,
    /// FLAC.
    Flac,
}

impl FormatArg {
    /// The request's value.
    pub fn format(self) -> OutputFormat {
        match self {
            FormatArg::Wav => OutputFormat::Wav,
            FormatArg::Flac => OutputFormat::Flac,
        }
    }
}

/// `submit --encoding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EncodingArg {
    /// 16-bit integers.
    S16,
    /// 24-bit integers (`--int24`).
    S24,
    /// 32-bit float, WAV only (`--float32`).
    F32,
}

impl EncodingArg {
    /// The request's value.
    pub fn encoding(self) -> Encoding {
        match self {
            EncodingArg::S16 => Encoding::S16,
            EncodingArg::S24 => Encoding::S24,
            EncodingArg::F32 => Encoding::F32,
        }
    }
}

/// `--priority` (`submit`, `keys create`): the lane a job waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PriorityArg {
    /// Someone waits for it: runs before any batch job of its pool.
    Interactive,
    /// Bulk work: runs when no interactive job of its pool waits.
    Batch,
}

impl PriorityArg {
    /// The request's (and the key's) value.
    pub fn priority(self) -> Priority {
        match self {
            PriorityArg::Interactive => Priority::Interactive,
            PriorityArg::Batch => Priority::Batch,
        }
    }
}

/// `separate -d`: where the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// The CPU.
    Cpu,
    /// An NVIDIA GPU.
    Cuda,
}

impl DeviceArg {
    /// The engine's device name.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceArg::Cpu => "cpu",
            DeviceArg::Cuda => "cuda",
        }
    }

    /// True when `device`, one an engine offers, is of this kind (`cuda` matches `cuda`
    /// and `cuda:<n>`).
    pub fn matches(self, device: &stemq_core::device::Device) -> bool {
        use stemq_core::device::Device;
        match self {
            DeviceArg::Cpu => device.is_cpu(),
            DeviceArg::Cuda => matches!(device, Device::Cuda(_)),
        }
    }
}

/// A request field's JSON value (the core enums serialise as their snake_case names).
pub fn json_of<T: serde::Serialize>(v: T) -> Value {
    serde_json::to_value(v).expect("request enums serialise")
}

/// Sets each field that has a value.
pub fn set_fields<const N: usize>(req: &mut Value, fields: [(&str, Option<Value>); N]) {
    for (k, v) in fields {
        if let Some(v) = v {
            req[k] = v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_become_the_request_fields_the_core_crate_names() {
        let split = SplitOpts {
            two_stems: Some("vocals".into()),
            other_method: Some(OtherMethodArg::Minus),
            ..Default::default()
        };
        let mut req = serde_json::json!({});
        split.fill(&mut req);
        assert_eq!(req, serde_json::json!({"two_stems": "vocals", "other_method": "minus"}));
        let out = OutputOpts { flac: true, int24: true, ..Default::default() };
        assert_eq!(json_of(out.format()), "flac");
        assert_eq!(json_of(out.encoding()), "s24");
        assert_eq!(json_of(ClipModeArg::None.mode()), "none");
        assert_eq!(json_of(EncodingArg::F32.encoding()), "f32");
        assert_eq!(json_of(PriorityArg::Batch.priority()), "batch");
        assert_eq!(json_of(PriorityArg::Interactive.priority()), "interactive");
    }
}
