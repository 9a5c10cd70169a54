//! Owns streamed stem encoding: output formats (WAV 16/24-bit PCM, WAV 32-bit
//! float, FLAC 16/24-bit, MP3 at a constant bit rate), Demucs-compatible clip modes,
//! and the file summary (sha256, size, duration) used for manifests.
//!
//! # Clip modes (Demucs meanings)
//! * [`ClipMode::Rescale`] — divide the whole stem by `max(1.01 * peak, 1)`,
//!   so it never clips. The peak of the whole stem is needed before the first
//!   sample can be written, so this mode is **two-pass**: chunks are spooled
//!   as raw `f32` to an anonymous temporary file (deleted automatically) while
//!   the peak is tracked, and [`StemEncoder::finish`] reads the spool back in
//!   blocks, scales and encodes. Memory stays bounded; temporary disk use is
//!   8 bytes per stereo frame (≈ 21 MB per minute at 44.1 kHz).
//! * [`ClipMode::Clamp`] — clamp every sample to [-1, 1]; single pass.
//! * [`ClipMode::None`] — no processing; single pass. Integer formats still
//!   clamp on conversion (as Demucs does when saving integers); float WAV
//!   keeps out-of-range values.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::chunk::StereoChunk;
use crate::decode::{DecodeOptions, Decoder};
use crate::error::AudioError;
use crate::flac::FlacWriter;
#[cfg(feature = "mp3")]
use crate::mp3::Mp3Writer;
use crate::wav::{WavSampleFormat, WavWriter};

/// Output file format of a stem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputFormat {
    /// WAV, 16-bit signed PCM (the default, as in Demucs).
    #[default]
    Wav16,
    /// WAV, 24-bit signed PCM.
    Wav24,
    /// WAV, 32-bit IEEE float.
    WavF32,
    /// FLAC, 16 bit.
    Flac16,
    /// FLAC, 24 bit.
    Flac24,
    /// MP3 (MPEG-1 Layer III) at a constant bit rate, encoded by LAME (needs the `mp3`
    /// feature).
    Mp3(Mp3Settings),
}

impl OutputFormat {
    /// File extension without the dot (`"wav"`, `"flac"` or `"mp3"`).
    pub fn extension(self) -> &'static str {
        match self {
            OutputFormat::Flac16 | OutputFormat::Flac24 => "flac",
            OutputFormat::Mp3(_) => "mp3",
            OutputFormat::Wav16 | OutputFormat::Wav24 | OutputFormat::WavF32 => "wav",
        }
    }
}

/// How an MP3 stem is encoded (Demucs's `--mp3-bitrate` and `--mp3-preset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Mp3Settings {
    /// Constant bit rate in kbit/s, one of [`Mp3Settings::BITRATES`]; Demucs's default is 320.
    pub bitrate_kbps: u16,
    /// LAME's quality, 0 (best, slowest) to 9; Demucs's presets are 2 (its default) to 7.
    pub quality: u8,
}

impl Mp3Settings {
    /// The bit rates of MPEG-1 Layer III (the layer of 32, 44.1 and 48 kHz audio).
    pub const BITRATES: [u16; 14] = [32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320];
}

impl Default for Mp3Settings {
    /// Demucs's defaults: 320 kbit/s, preset 2.
    fn default() -> Self {
        Mp3Settings { bitrate_kbps: 320, quality: 2 }
    }
}

/// How out-of-range samples are handled: the request's own option (Demucs's
/// `--clip-mode`), defined once in `stemq-core` and used here as is.
pub use stemq_core::request::ClipMode;

enum Sink<W: Write + Seek> {
    Wav(WavWriter<W>),
    Flac(Box<FlacWriter<W>>),
    #[cfg(feature = "mp3")]
    Mp3(Box<Mp3Writer<W>>),
}

impl<W: Write + Seek> Sink<W> {
    fn write(&mut self, l: &[f32], r: &[f32]) -> Result<(), AudioError> {
        match self {
            Sink::Wav(w) => w.write(l, r),
            Sink::Flac(w) => w.write(l, r),
            #[cfg(feature = "mp3")]
            Sink::Mp3(w) => w.write(l, r),
        }
    }
    fn finish(self) -> Result<W, AudioError> {
        match self {
            Sink::Wav(w) => w.finish(),
            Sink::Flac(w) => w.finish(),
            #[cfg(feature = "mp3")]
            Sink::Mp3(w) => w.finish(),
        }
    }
}

struct Spool {
    file: BufWriter<File>,
    peak: f32,
}

/// A streamed stereo stem encoder writing to any `Write + Seek`.
pub struct StemEncoder<W: Write + Seek> {
    sink: Sink<W>,
    clip: ClipMode,
    spool: Option<Spool>,
    scratch: StereoChunk,
    frames: u64,
}

impl<W: Write + Seek> StemEncoder<W> {
    /// Starts a stem in `format` at `sample_rate` with the given clip mode.
    pub fn new(out: W, format: OutputFormat, clip: ClipMode, sample_rate: u32) -> Result<Self, AudioError> {
        let sink = match format {
            OutputFormat::Wav16 => Sink::Wav(WavWriter::new(out, WavSampleFormat::Pcm16, sample_rate)?),
            OutputFormat::Wav24 => Sink::Wav(WavWriter::new(out, WavSampleFormat::Pcm24, sample_rate)?),
            OutputFormat::WavF32 => Sink::Wav(WavWriter::new(out, WavSampleFormat::Float32, sample_rate)?),
            OutputFormat::Flac16 => Sink::Flac(Box::new(FlacWriter::new(out, 16, sample_rate)?)),
            OutputFormat::Flac24 => Sink::Flac(Box::new(FlacWriter::new(out, 24, sample_rate)?)),
            #[cfg(feature = "mp3")]
            OutputFormat::Mp3(settings) => Sink::Mp3(Box::new(Mp3Writer::new(out, settings, sample_rate)?)),
            #[cfg(not(feature = "mp3"))]
            OutputFormat::Mp3(_) => return Err(AudioError::FormatUnavailable { format: "MP3", feature: "mp3" }),
        };
        let spool = if clip == ClipMode::Rescale {
            Some(Spool { file: BufWriter::with_capacity(1 << 16, tempfile::tempfile()?), peak: 0.0 })
        } else {
            None
        };
        Ok(StemEncoder { sink, clip, spool, scratch: StereoChunk::default(), frames: 0 })
    }

    /// Frames written so far.
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// Appends a chunk.
    pub fn write(&mut self, chunk: &StereoChunk) -> Result<(), AudioError> {
        if chunk.left.len() != chunk.right.len() {
            return Err(AudioError::InvalidArgument("left and right differ in length".into()));
        }
        self.frames += chunk.len() as u64;
        match self.clip {
            ClipMode::Rescale => {
                let spool = self.spool.as_mut().expect("rescale has a spool");
                spool.peak = spool.peak.max(chunk.peak());
                let mut bytes = Vec::with_capacity(chunk.len() * 8);
                for (&l, &r) in chunk.left.iter().zip(&chunk.right) {
                    bytes.extend_from_slice(&l.to_le_bytes());
                    bytes.extend_from_slice(&r.to_le_bytes());
                }
                spool.file.write_all(&bytes)?;
                Ok(())
            }
            ClipMode::Clamp => {
                self.scratch.left.clear();
                self.scratch.right.clear();
                self.scratch.left.extend(chunk.left.iter().map(|x| x.clamp(-1.0, 1.0)));
                self.scratch.right.extend(chunk.right.iter().map(|x| x.clamp(-1.0, 1.0)));
                self.sink.write(&self.scratch.left, &self.scratch.right)
            }
            ClipMode::None => self.sink.write(&chunk.left, &chunk.right),
        }
    }

    /// Completes the file (for `Rescale`, runs the second pass) and returns the sink.
    pub fn finish(mut self) -> Result<W, AudioError> {
        if let Some(spool) = self.spool.take() {
            let scale = 1.0 / (1.01 * spool.peak).max(1.0);
            let mut file = spool.file.into_inner().map_err(|e| AudioError::Io(e.into_error()))?;
            file.seek(SeekFrom::Start(0))?;
            let mut reader = BufReader::with_capacity(1 << 16, file);
            let mut buf = vec![0u8; 8 * 8192];
            let (mut l, mut r) = (Vec::with_capacity(8192), Vec::with_capacity(8192));
            loop {
                let mut n = 0;
                while n < buf.len() {
                    let k = reader.read(&mut buf[n..])?;
                    if k == 0 {
                        break;
                    }
                    n += k;
                }
                if n == 0 {
                    break;
                }
                l.clear();
                r.clear();
                for f in buf[..n].chunks_exact(8) {
                    l.push(f32::from_le_bytes([f[0], f[1], f[2], f[3]]) * scale);
                    r.push(f32::from_le_bytes([f[4], f[5], f[6], f[7]]) * scale);
                }
                self.sink.write(&l, &r)?;
                if n < buf.len() {
                    break;
                }
            }
        }
        self.sink.finish()
    }
}

impl StemEncoder<BufWriter<File>> {
    /// Creates (truncating) the file at `path` and starts a stem there.
    pub fn create(
        path: impl AsRef<Path>,
        format: OutputFormat,
        clip: ClipMode,
        sample_rate: u32,
    ) -> Result<Self, AudioError> {
        let f = BufWriter::with_capacity(1 << 16, File::create(path)?);
        Self::new(f, format, clip, sample_rate)
    }
}

/// What a manifest needs to know about a written audio file.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FileSummary {
    /// Lower-case hex SHA-256 of the file's bytes.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Duration in seconds (from the header, or by decoding when the header does not say).
    pub duration_secs: f64,
    /// Native sample rate.
    pub sample_rate: u32,
}

/// Computes the SHA-256, size and duration of an audio file (streamed).
pub fn summarize_file(path: impl AsRef<Path>) -> Result<FileSummary, AudioError> {
    let path = path.as_ref();
    let mut f = BufReader::with_capacity(1 << 16, File::open(path)?);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bytes += n as u64;
    }
    let sha256 = hex::encode(h.finalize());
    // Decode at the native rate so no resampling happens.
    let probe = Decoder::open_path(path, DecodeOptions::default())?;
    let rate = probe.info().sample_rate;
    let duration_secs = match probe.info().duration_secs {
        Some(d) => d,
        None => {
            drop(probe);
            let mut d = Decoder::open_path(path, DecodeOptions { target_sample_rate: rate, max_duration_secs: None })?;
            while d.next_chunk()?.is_some() {}
            d.decoded_frames() as f64 / rate as f64
        }
    };
    Ok(FileSummary { sha256, bytes, duration_secs, sample_rate: rate })
}
