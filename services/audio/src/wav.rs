//! Owns the streamed WAV writer (16/24-bit PCM and 32-bit IEEE float, stereo), a thin
//! layer over `hound`.
//!
//! hound writes the header with placeholder sizes when the writer is made, the samples
//! as they come, and patches the sizes in [`WavWriter::finish`], so any `Write + Seek`
//! sink works and memory stays constant (one chunk of converted samples at most; wrap
//! a file in a `BufWriter`, as [`crate::StemEncoder::create`] does). 16-bit files carry
//! the plain 44-byte PCM header; 24-bit and float ones the `WAVE_FORMAT_EXTENSIBLE`
//! header that formats over 16 bits call for. This layer adds what hound leaves to its
//! caller: the float-to-integer conversion (rounded and clamped as Demucs does), the
//! 4 GiB limit of plain RIFF (refused before it is crossed), writing from any position
//! of the sink, and handing the sink back when the file is complete.

use std::io::{Seek, SeekFrom, Write};
use std::sync::{Arc, Mutex};

use crate::error::AudioError;

/// Sample encoding of a WAV file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WavSampleFormat {
    /// 16-bit signed integer PCM.
    Pcm16,
    /// 24-bit signed integer PCM.
    Pcm24,
    /// 32-bit IEEE float.
    Float32,
}

impl WavSampleFormat {
    fn bytes(self) -> u32 {
        match self {
            WavSampleFormat::Pcm16 => 2,
            WavSampleFormat::Pcm24 => 3,
            WavSampleFormat::Float32 => 4,
        }
    }
}

/// Converts a float sample to a signed integer of `bits` bits: scale by
/// `2^(bits-1)`, round, then clamp to the integer range (as Demucs does when
/// saving integer files; this clamping happens whatever the clip mode).
pub(crate) fn float_to_int(x: f32, bits: u32) -> i32 {
    let scale = (1u32 << (bits - 1)) as f32;
    let max = (1i32 << (bits - 1)) - 1;
    let min = -(1i32 << (bits - 1));
    let v = (x * scale).round();
    if v.is_nan() {
        0
    } else if v >= max as f32 {
        max
    } else if v <= min as f32 {
        min
    } else {
        v as i32
    }
}

/// The most sample bytes a file may hold: the RIFF size field (`u32`) counts them
/// plus the header after its first 8 bytes (at most 60, for the extensible header).
const MAX_DATA_BYTES: u64 = u32::MAX as u64 - 60;

/// Streamed stereo WAV writer.
pub struct WavWriter<W: Write + Seek> {
    wav: hound::WavWriter<Sink<W>>,
    format: WavSampleFormat,
    data_bytes: u64,
    /// Where the sink comes back when hound lets go of it, with the end of the file.
    slot: Slot<W>,
}

type Slot<W> = Arc<Mutex<Option<(W, u64)>>>;

/// The sink as hound sees it: positions relative to where the file starts (hound
/// writes the header at 0), and the sink handed back through `slot` when hound drops it
/// (hound has no way to return its writer).
struct Sink<W: Write + Seek> {
    inner: Option<W>,
    /// Absolute position of the file's first byte in `inner`.
    start: u64,
    /// Current and furthest position, relative to `start`.
    pos: u64,
    end: u64,
    slot: Slot<W>,
}

impl<W: Write + Seek> Sink<W> {
    fn inner(&mut self) -> &mut W {
        self.inner.as_mut().expect("the sink is only taken on drop")
    }
}

impl<W: Write + Seek> Write for Sink<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner().write(buf)?;
        self.pos += n as u64;
        self.end = self.end.max(self.pos);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner().flush()
    }
}

impl<W: Write + Seek> Seek for Sink<W> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let to = match to {
            SeekFrom::Start(n) => SeekFrom::Start(self.start + n),
            other => other,
        };
        let start = self.start;
        let at = self.inner().seek(to)?;
        self.pos = at.checked_sub(start).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start of the WAV file")
        })?;
        Ok(self.pos)
    }
}

impl<W: Write + Seek> Drop for Sink<W> {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            let end = self.start + self.end;
            *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some((inner, end));
        }
    }
}

fn wav_error(e: hound::Error) -> AudioError {
    match e {
        hound::Error::IoError(io) => AudioError::Io(io),
        other => AudioError::Internal(format!("WAV writer: {other}")),
    }
}

impl<W: Write + Seek> WavWriter<W> {
    /// Writes the header and returns a writer for 2-channel audio at `sample_rate`.
    pub fn new(mut out: W, format: WavSampleFormat, sample_rate: u32) -> Result<Self, AudioError> {
        if sample_rate == 0 {
            return Err(AudioError::InvalidArgument("sample rate must be > 0".into()));
        }
        let start = out.stream_position()?;
        let spec = hound::WavSpec {
            channels: 2,
            sample_rate,
            bits_per_sample: (format.bytes() * 8) as u16,
            sample_format: match format {
                WavSampleFormat::Float32 => hound::SampleFormat::Float,
                WavSampleFormat::Pcm16 | WavSampleFormat::Pcm24 => hound::SampleFormat::Int,
            },
        };
        let slot: Slot<W> = Arc::default();
        let sink = Sink { inner: Some(out), start, pos: 0, end: 0, slot: slot.clone() };
        let wav = hound::WavWriter::new(sink, spec).map_err(wav_error)?;
        Ok(WavWriter { wav, format, data_bytes: 0, slot })
    }

    /// Appends planar stereo samples (`left.len()` must equal `right.len()`).
    /// Integer formats clamp out-of-range values; float is written as is.
    pub fn write(&mut self, left: &[f32], right: &[f32]) -> Result<(), AudioError> {
        if left.len() != right.len() {
            return Err(AudioError::InvalidArgument("left and right differ in length".into()));
        }
        let bytes = left.len() as u64 * 2 * self.format.bytes() as u64;
        if self.data_bytes + bytes > MAX_DATA_BYTES {
            return Err(AudioError::InvalidArgument("WAV output would exceed 4 GiB; use FLAC for this length".into()));
        }
        self.data_bytes += bytes;
        let mut frames = left.iter().zip(right);
        match self.format {
            WavSampleFormat::Pcm16 => {
                // One buffered write per chunk.
                let mut w = self.wav.get_i16_writer(2 * left.len() as u32);
                for (&l, &r) in frames {
                    w.write_sample(float_to_int(l, 16) as i16);
                    w.write_sample(float_to_int(r, 16) as i16);
                }
                w.flush()
            }
            WavSampleFormat::Pcm24 => frames.try_for_each(|(&l, &r)| {
                self.wav.write_sample(float_to_int(l, 24)).and_then(|()| self.wav.write_sample(float_to_int(r, 24)))
            }),
            WavSampleFormat::Float32 => {
                frames.try_for_each(|(&l, &r)| self.wav.write_sample(l).and_then(|()| self.wav.write_sample(r)))
            }
        }
        .map_err(wav_error)
    }

    /// Patches the sizes in the header, flushes, and returns the sink, positioned at
    /// the end of the file.
    pub fn finish(self) -> Result<W, AudioError> {
        let WavWriter { wav, slot, .. } = self;
        let finalized = wav.finalize().map_err(wav_error);
        let taken = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        finalized?;
        let (mut out, end) =
            taken.ok_or_else(|| AudioError::Internal("the WAV writer did not hand its sink back".into()))?;
        out.seek(SeekFrom::Start(end))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int_conversion_clamps() {
        assert_eq!(float_to_int(1.5, 16), 32767);
        assert_eq!(float_to_int(-1.5, 16), -32768);
        assert_eq!(float_to_int(-1.0, 16), -32768);
        assert_eq!(float_to_int(0.5, 16), 16384);
        assert_eq!(float_to_int(f32::NAN, 24), 0);
        assert_eq!(float_to_int(1.0, 24), 8388607);
    }

    /// Writes two chunks after `prefix` bytes already in the sink.
    fn write_file(format: WavSampleFormat, prefix: usize) -> Vec<u8> {
        let mut out = std::io::Cursor::new(vec![7u8; prefix]);
        out.seek(SeekFrom::End(0)).unwrap();
        let mut w = WavWriter::new(out, format, 48_000).unwrap();
        w.write(&[0.5, -0.25], &[1.5, -1.0]).unwrap();
        w.write(&[0.0], &[0.125]).unwrap();
        let mut out = w.finish().unwrap();
        assert_eq!(out.stream_position().unwrap(), out.get_ref().len() as u64, "the sink is left at the end");
        out.into_inner()
    }

    #[test]
    fn files_read_back_with_their_sizes_patched() {
        for (format, bits) in [(WavSampleFormat::Pcm16, 16), (WavSampleFormat::Pcm24, 24)] {
            let bytes = write_file(format, 0);
            let r = hound::WavReader::new(&bytes[..]).unwrap();
            assert_eq!((r.spec().channels, r.spec().sample_rate, r.spec().bits_per_sample), (2, 48_000, bits));
            assert_eq!(r.len(), 6);
            let got: Vec<i32> = r.into_samples::<i32>().map(Result::unwrap).collect();
            let want: Vec<i32> =
                [0.5, 1.5, -0.25, -1.0, 0.0, 0.125].iter().map(|&x| float_to_int(x, bits as u32)).collect();
            assert_eq!(got, want, "{format:?}");
            let riff = u32::from_le_bytes(bytes[4..8].try_into().unwrap());
            assert_eq!(riff as usize, bytes.len() - 8, "{format:?}");
        }
        let bytes = write_file(WavSampleFormat::Float32, 0);
        let r = hound::WavReader::new(&bytes[..]).unwrap();
        assert_eq!(r.spec().sample_format, hound::SampleFormat::Float);
        let got: Vec<f32> = r.into_samples::<f32>().map(Result::unwrap).collect();
        assert_eq!(got, [0.5, 1.5, -0.25, -1.0, 0.0, 0.125], "float keeps out-of-range values");
    }

    #[test]
    fn a_file_may_start_anywhere_in_the_sink() {
        let alone = write_file(WavSampleFormat::Pcm24, 0);
        let after = write_file(WavSampleFormat::Pcm24, 10);
        assert_eq!(&after[..10], &[7u8; 10]);
        assert_eq!(&after[10..], &alone[..]);
    }

    #[test]
    fn plain_riff_limit_is_refused_before_it_is_crossed() {
        let mut w = WavWriter::new(std::io::Cursor::new(Vec::new()), WavSampleFormat::Pcm16, 44_100).unwrap();
        w.data_bytes = MAX_DATA_BYTES - 4;
        w.write(&[0.0], &[0.0]).unwrap();
        let e = w.write(&[0.0], &[0.0]).unwrap_err();
        assert!(e.to_string().contains("4 GiB"), "{e}");
        assert!(matches!(
            WavWriter::new(std::io::Cursor::new(Vec::new()), WavSampleFormat::Pcm16, 0),
            Err(AudioError::InvalidArgument(_))
        ));
    }
}
