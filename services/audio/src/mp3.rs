//! Owns the streamed MP3 encoder: LAME 3.100 (vendored C, LGPL-3.0) through the
//! `mp3lame-encoder` crate, as `demucs` encodes with `lameenc`: constant bit rate,
//! joint stereo, LAME's `quality` set from Demucs's `--mp3-preset`.
//!
//! Samples are converted to 16-bit integers first (clamped, as Demucs does before
//! LAME). The first frame of the file is LAME's Xing/Info frame: a placeholder while
//! encoding, overwritten at [`Mp3Writer::finish`] with the real one (frame count,
//! encoder delay and padding), which is why the sink must be seekable. Decoders that
//! read it (symphonia, mpg123, browsers) then know the exact length.
//!
//! Compiled only with the `mp3` feature (default on); without it
//! [`Mp3Writer::new`] does not exist and [`crate::StemEncoder`] refuses MP3 with
//! [`AudioError::FormatUnavailable`].

use std::io::{Seek, SeekFrom, Write};
use std::num::NonZeroU32;
use std::os::raw::c_int;

use mp3lame_encoder::{Builder, Encoder, FlushGap, InterleavedPcm, Quality};

use crate::encode::Mp3Settings;
use crate::error::AudioError;
use crate::wav::float_to_int;

/// Output sample rates of MPEG-1 Layer III, which every bit rate of
/// [`Mp3Settings::BITRATES`] is valid at.
const MPEG1_RATES: [u32; 3] = [32_000, 44_100, 48_000];

fn lame_error(what: &str, e: impl std::fmt::Display) -> AudioError {
    AudioError::Internal(format!("MP3 encoder (LAME): {what}: {e}"))
}

/// Streamed stereo MP3 writer.
pub struct Mp3Writer<W: Write + Seek> {
    out: W,
    enc: Encoder,
    /// Where the file starts in `out` (the Info frame is written back there).
    start: u64,
    pcm: Vec<i16>,
    buf: Vec<u8>,
}

impl<W: Write + Seek> Mp3Writer<W> {
    /// Starts an MP3 stream of 2 channels at `sample_rate` with `settings`.
    pub fn new(mut out: W, settings: Mp3Settings, sample_rate: u32) -> Result<Self, AudioError> {
        if !Mp3Settings::BITRATES.contains(&settings.bitrate_kbps) {
            return Err(AudioError::InvalidArgument(format!(
                "MP3 bit rate {} kbps is not one of {:?}",
                settings.bitrate_kbps,
                Mp3Settings::BITRATES
            )));
        }
        let quality = match settings.quality {
            0 => Quality::Best,
            1 => Quality::SecondBest,
            2 => Quality::NearBest,
            3 => Quality::VeryNice,
            4 => Quality::Nice,
            5 => Quality::Good,
            6 => Quality::Decent,
            7 => Quality::Ok,
            8 => Quality::SecondWorst,
            9 => Quality::Worst,
            q => return Err(AudioError::InvalidArgument(format!("LAME quality {q} is not in 0..=9"))),
        };
        let mut b = Builder::new().ok_or_else(|| lame_error("init", "out of memory"))?;
        b.set_num_channels(2).map_err(|e| lame_error("channels", e))?;
        b.set_sample_rate(sample_rate).map_err(|e| lame_error("sample rate", e))?;
        // Keep the stems' rate where MPEG-1 has it (LAME would otherwise resample down
        // at low bit rates); other rates are left to LAME's choice.
        if MPEG1_RATES.contains(&sample_rate) {
            b.set_output_sample_rate(NonZeroU32::new(sample_rate)).map_err(|e| lame_error("output rate", e))?;
        }
        // SAFETY: `as_ptr` is the builder's own `lame_global_flags`, allocated by
        // `lame_init` and alive until the builder is consumed by `build` below; the
        // builder is borrowed mutably for the call, so nothing else uses it meanwhile.
        // `lame_set_brate` only stores the integer in that struct (LAME validates it in
        // `lame_init_params`, which `build` calls and whose error it reports). The raw
        // call is needed because the crate's `Bitrate` enum lacks 56 kbps.
        let rc = unsafe { mp3lame_encoder::ffi::lame_set_brate(b.as_ptr(), settings.bitrate_kbps as c_int) };
        if rc < 0 {
            return Err(lame_error("bit rate", rc));
        }
        b.set_quality(quality).map_err(|e| lame_error("quality", e))?;
        b.set_to_write_vbr_tag(true).map_err(|e| lame_error("Info tag", e))?;
        let enc = b.build().map_err(|e| lame_error("parameters", e))?;
        let start = out.stream_position()?;
        Ok(Mp3Writer { out, enc, start, pcm: Vec::new(), buf: Vec::new() })
    }

    /// Appends planar stereo float samples; they are scaled to 16-bit integers and clamped.
    pub fn write(&mut self, left: &[f32], right: &[f32]) -> Result<(), AudioError> {
        if left.len() != right.len() {
            return Err(AudioError::InvalidArgument("left and right differ in length".into()));
        }
        if left.is_empty() {
            return Ok(());
        }
        self.pcm.clear();
        for (&l, &r) in left.iter().zip(right) {
            self.pcm.push(float_to_int(l, 16) as i16);
            self.pcm.push(float_to_int(r, 16) as i16);
        }
        self.buf.clear();
        self.buf.reserve(mp3lame_encoder::max_required_buffer_size(self.pcm.len()));
        self.enc.encode_to_vec(InterleavedPcm(&self.pcm), &mut self.buf).map_err(|e| lame_error("encode", e))?;
        self.out.write_all(&self.buf)?;
        Ok(())
    }

    /// Flushes LAME's last frames, writes the final Info frame over the placeholder,
    /// flushes, and returns the sink.
    pub fn finish(mut self) -> Result<W, AudioError> {
        self.buf.clear();
        self.buf.reserve(mp3lame_encoder::max_required_buffer_size(0));
        self.enc.flush_to_vec::<FlushGap>(&mut self.buf).map_err(|e| lame_error("flush", e))?;
        self.out.write_all(&self.buf)?;
        if self.enc.is_lame_tag_written() {
            let mut tag = Vec::with_capacity(self.enc.lame_tag_size());
            if self.enc.lame_tag_encode_to_vec(&mut tag).is_some() {
                let end = self.out.stream_position()?;
                self.out.seek(SeekFrom::Start(self.start))?;
                self.out.write_all(&tag)?;
                self.out.seek(SeekFrom::Start(end))?;
            }
        }
        self.out.flush()?;
        Ok(self.out)
    }
}
