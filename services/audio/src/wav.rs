//! Owns the streamed WAV writer (16/24-bit PCM and 32-bit IEEE float, stereo).
//!
//! The RIFF and `data` sizes are written as placeholders and patched by
//! [`WavWriter::finish`], so any `Write + Seek` sink works and memory stays
//! constant. Files over 4 GiB are refused (plain RIFF cannot describe them).

use std::io::{Seek, SeekFrom, Write};

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

/// Streamed stereo WAV writer.
pub struct WavWriter<W: Write + Seek> {
    out: W,
    format: WavSampleFormat,
    data_bytes: u64,
    start: u64,
    buf: Vec<u8>,
}

const HEADER_LEN: u64 = 44;

impl<W: Write + Seek> WavWriter<W> {
    /// Writes the header and returns a writer for 2-channel audio at `sample_rate`.
    pub fn new(mut out: W, format: WavSampleFormat, sample_rate: u32) -> Result<Self, AudioError> {
        if sample_rate == 0 {
            return Err(AudioError::InvalidArgument("sample rate must be > 0".into()));
        }
        let start = out.stream_position()?;
        let channels: u16 = 2;
        let bps = format.bytes();
        let block_align = channels as u32 * bps;
        let mut h = Vec::with_capacity(HEADER_LEN as usize);
        h.extend_from_slice(b"RIFF");
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(b"WAVE");
        h.extend_from_slice(b"fmt ");
        h.extend_from_slice(&16u32.to_le_bytes());
        let tag: u16 = if format == WavSampleFormat::Float32 { 3 } else { 1 };
        h.extend_from_slice(&tag.to_le_bytes());
        h.extend_from_slice(&channels.to_le_bytes());
        h.extend_from_slice(&sample_rate.to_le_bytes());
        h.extend_from_slice(&(sample_rate * block_align).to_le_bytes());
        h.extend_from_slice(&(block_align as u16).to_le_bytes());
        h.extend_from_slice(&((bps * 8) as u16).to_le_bytes());
        h.extend_from_slice(b"data");
        h.extend_from_slice(&0u32.to_le_bytes());
        out.write_all(&h)?;
        Ok(WavWriter { out, format, data_bytes: 0, start, buf: Vec::new() })
    }

    /// Appends planar stereo samples (`left.len()` must equal `right.len()`).
    /// Integer formats clamp out-of-range values; float is written as is.
    pub fn write(&mut self, left: &[f32], right: &[f32]) -> Result<(), AudioError> {
        if left.len() != right.len() {
            return Err(AudioError::InvalidArgument("left and right differ in length".into()));
        }
        self.buf.clear();
        self.buf.reserve(left.len() * 2 * self.format.bytes() as usize);
        for (&l, &r) in left.iter().zip(right) {
            for x in [l, r] {
                match self.format {
                    WavSampleFormat::Pcm16 => self.buf.extend_from_slice(&(float_to_int(x, 16) as i16).to_le_bytes()),
                    WavSampleFormat::Pcm24 => self.buf.extend_from_slice(&float_to_int(x, 24).to_le_bytes()[..3]),
                    WavSampleFormat::Float32 => self.buf.extend_from_slice(&x.to_le_bytes()),
                }
            }
        }
        self.data_bytes += self.buf.len() as u64;
        if self.data_bytes + HEADER_LEN - 8 > u32::MAX as u64 {
            return Err(AudioError::InvalidArgument("WAV output would exceed 4 GiB; use FLAC for this length".into()));
        }
        self.out.write_all(&self.buf)?;
        Ok(())
    }

    /// Patches the sizes in the header, flushes, and returns the sink.
    pub fn finish(mut self) -> Result<W, AudioError> {
        let end = self.out.stream_position()?;
        self.out.seek(SeekFrom::Start(self.start + 4))?;
        self.out.write_all(&((self.data_bytes + HEADER_LEN - 8) as u32).to_le_bytes())?;
        self.out.seek(SeekFrom::Start(self.start + 40))?;
        self.out.write_all(&(self.data_bytes as u32).to_le_bytes())?;
        self.out.seek(SeekFrom::Start(end))?;
        self.out.flush()?;
        Ok(self.out)
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
}
