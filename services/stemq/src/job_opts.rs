//! How a job request is spelled on the command line, shared by `submit` and
//! `separate` so the two agree on flag names where they mean the same thing.
//!
//! This module owns the mapping from flags to the request document: the demucs
//! spellings (`--two-stems`, `--other-method`, `--segment`, `--overlap`, `--shifts`,
//! `--flac`, `--mp3`, `--mp3-bitrate`, `--mp3-preset`, `--int24`, `--float32`,
//! `--clip-mode`) parse into typed values here and
//! become the request's fields through the core crate's own enums, so a value the
//! request does not know is refused by the parser, before anything runs.

use clap::{Args, ValueEnum};
use serde_json::Value;
use stemq_core::request::{ClipMode, Encoding, OtherMethod, OutputFormat, Priority, MP3_BITRATES};

/// How to split: shared by `submit` and `separate`.
#[derive(Debug, Args, Clone, Default)]
pub struct SplitOpts {
    /// Only this stem and its complement (`no_<stem>`, or `minus_<stem>` with
    /// `--other-method minus`, as demucs names them).
    #[arg(long)]
    pub two_stems: Option<String>,
    /// With `--two-stems`: the complement as the sum of the other stems (`add`, the
    /// default: `no_<stem>`), as the mixture minus the stem (`minus`: `minus_<stem>`), or
    /// not at all (`none`). Without `--two-stems` it changes nothing (as in demucs).
    #[arg(long, value_enum)]
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
            ("other_method", self.other_method.filter(|_| self.two_stems.is_some()).map(|m| json_of(m.method()))),
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
    #[arg(long, conflicts_with = "mp3")]
    pub flac: bool,
    /// Write MP3 instead of WAV (LAME, constant bit rate; `--int24` and `--float32` are
    /// then ignored, as demucs ignores them).
    #[arg(long)]
    pub mp3: bool,
    /// MP3 bit rate in kbit/s (default 320). As with demucs (LAME), a rate MPEG-1 does
    /// not have becomes the nearest one it has (32 to 320). Ignored without MP3 output.
    #[arg(long, value_name = "KBPS")]
    pub mp3_bitrate: Option<u32>,
    /// MP3 encoder preset: 2 for the best quality (default) to 7 for the fastest.
    /// Ignored without MP3 output.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(2..=7))]
    pub mp3_preset: Option<u32>,
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
        if self.mp3 {
            Some(OutputFormat::Mp3)
        } else {
            self.flac.then_some(OutputFormat::Flac)
        }
    }

    /// The sample encoding the flags ask for, if they ask (never with `--mp3`: demucs
    /// ignores `--int24` and `--float32` there).
    pub fn encoding(&self) -> Option<Encoding> {
        if self.mp3 {
            None
        } else if self.float32 {
            Some(Encoding::F32)
        } else if self.int24 {
            Some(Encoding::S24)
        } else {
            None
        }
    }
}

/// The MPEG-1 Layer III bit rate nearest to `kbps` (the lower one on a tie), as LAME
/// picks it for demucs's `--mp3-bitrate`.
pub fn nearest_mp3_bitrate(kbps: u32) -> u32 {
    *MP3_BITRATES.iter().min_by_key(|&&b| b.abs_diff(kbps)).expect("non-empty")
}

impl OutputOpts {
    /// The request's `mp3_bitrate` and `mp3_preset` for a job whose container is
    /// `format`: the flags' values with MP3, nothing otherwise.
    pub fn mp3_fields(&self, format: Option<OutputFormat>) -> [(&'static str, Option<Value>); 2] {
        let mp3 = format == Some(OutputFormat::Mp3);
        [
            ("mp3_bitrate", self.mp3_bitrate.filter(|_| mp3).map(|b| Value::from(nearest_mp3_bitrate(b)))),
            ("mp3_preset", self.mp3_preset.filter(|_| mp3).map(Value::from)),
        ]
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
    /// MP3.
    Mp3,
}

impl FormatArg {
    /// The request's value.
    pub fn format(self) -> OutputFormat {
        match self {
            FormatArg::Wav => OutputFormat::Wav,
            FormatArg::Flac => OutputFormat::Flac,
            FormatArg::Mp3 => OutputFormat::Mp3,
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

/// `separate -d` and `worker --device`: where the engine runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceArg(pub stemq_core::device::Device);

/// A device as demucs's `-d` takes it (torch's spelling), and Vulkan's: `cpu`, `cuda`,
/// `cuda:N`, `vulkan`, `vulkan:N`.
pub fn parse_device(s: &str) -> Result<DeviceArg, String> {
    match stemq_core::device::Device::from(s) {
        stemq_core::device::Device::Other(_) => {
            Err(format!("unknown device `{s}`: cpu, cuda, cuda:N, vulkan or vulkan:N"))
        }
        d => Ok(DeviceArg(d)),
    }
}

impl DeviceArg {
    /// True when `device`, one an engine offers, is the one asked for: `cuda` and
    /// `vulkan` take any device of their kind, `cuda:N` too (the engine runs CUDA's
    /// default device), `vulkan:N` only itself.
    pub fn matches(&self, device: &stemq_core::device::Device) -> bool {
        use stemq_core::device::Device;
        match (&self.0, device) {
            (Device::Cpu, d) => d.is_cpu(),
            (Device::Cuda(_), Device::Cuda(_)) | (Device::Vulkan(None), Device::Vulkan(_)) => true,
            (Device::Vulkan(Some(want)), Device::Vulkan(Some(have))) => want == have,
            _ => false,
        }
    }
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
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

    #[test]
    fn mp3_flags_follow_demucs() {
        let out =
            OutputOpts { mp3: true, int24: true, mp3_bitrate: Some(192), mp3_preset: Some(7), ..Default::default() };
        assert_eq!(json_of(out.format()), "mp3");
        // demucs ignores the sample depth for MP3.
        assert_eq!(out.encoding(), None);
        let mut req = serde_json::json!({});
        set_fields(&mut req, out.mp3_fields(out.format()));
        assert_eq!(req, serde_json::json!({"mp3_bitrate": 192, "mp3_preset": 7}));
        // Without MP3 output the MP3 flags change nothing (as in demucs).
        let wav = OutputOpts { mp3_bitrate: Some(128), ..Default::default() };
        let mut req = serde_json::json!({});
        set_fields(&mut req, wav.mp3_fields(wav.format()));
        assert_eq!(req, serde_json::json!({}));
        // LAME's nearest MPEG-1 rate.
        for (asked, used) in [(320, 320), (300, 320), (1000, 320), (0, 32), (50, 48), (52, 48), (60, 56), (144, 128)] {
            assert_eq!(nearest_mp3_bitrate(asked), used, "{asked}");
        }
        assert_eq!(FormatArg::Mp3.format(), OutputFormat::Mp3);
    }

    #[test]
    fn devices_parse_in_torchs_spelling_and_vulkans() {
        use stemq_core::device::Device;
        for (arg, device) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(None)),
            ("cuda:1", Device::Cuda(Some(1))),
            ("vulkan", Device::Vulkan(None)),
            ("vulkan:2", Device::Vulkan(Some(2))),
        ] {
            assert_eq!(parse_device(arg).unwrap().0, device, "{arg}");
        }
        for bad in ["gpu", "vulkan:", "vulkan:x", "cuda:-1", "Vulkan"] {
            assert!(parse_device(bad).unwrap_err().contains("vulkan:N"), "{bad}");
        }
        let vulkan = parse_device("vulkan").unwrap();
        assert!(vulkan.matches(&Device::Vulkan(Some(3))) && !vulkan.matches(&Device::Cpu));
        let second = parse_device("vulkan:1").unwrap();
        assert!(second.matches(&Device::Vulkan(Some(1))) && !second.matches(&Device::Vulkan(Some(0))));
        assert!(parse_device("cuda:1").unwrap().matches(&Device::Cuda(None)));
        assert!(!parse_device("cpu").unwrap().matches(&Device::Vulkan(None)));
    }
}
