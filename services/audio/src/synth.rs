//! A synthetic song for demos and benchmarks: no audio files in git, no downloads.
//!
//! This module owns the demo input. [`write_demo_song`] streams a stereo 16-bit WAV of
//! any length to disk in blocks (memory stays flat): a centre-panned voice-like tone
//! with vibrato and harmonics, percussive hits (decaying noise, panned), a bass line and
//! a wide detuned pad, so every stem of a separation has something to find.

use std::f64::consts::PI;
use std::path::Path;

use crate::{AudioError, ClipMode, OutputFormat, StemEncoder, StereoChunk};

/// Writes `seconds` of the demo song at `rate` Hz to `path` (16-bit WAV).
pub fn write_demo_song(path: &Path, seconds: f64, rate: u32) -> Result<(), AudioError> {
    let frames = (seconds * rate as f64).round() as u64;
    let mut enc = StemEncoder::create(path, OutputFormat::Wav16, ClipMode::Clamp, rate)?;
    let block = 65_536u64;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    // A bar of four beats at 120 bpm; the bass walks a fifth every bar, the voice sings
    // a small melody.
    let melody = [220.0, 246.94, 261.63, 293.66, 261.63, 246.94, 220.0, 196.0];
    let mut i = 0u64;
    while i < frames {
        let n = block.min(frames - i);
        let mut c = StereoChunk::with_capacity(n as usize);
        for j in i..i + n {
            let t = j as f64 / rate as f64;
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let noise = (seed >> 40) as f64 / (1u64 << 24) as f64 - 0.5;
            let beat = t % 0.5;
            let kick = (-beat / 0.08).exp() * (2.0 * PI * (50.0 + 60.0 * (-beat / 0.02).exp()) * beat).sin();
            let off = (t + 0.25) % 0.5;
            let hat = (-off / 0.02).exp() * noise;
            let f = melody[((t / 0.5) as usize) % melody.len()];
            let vib = 1.0 + 0.006 * (2.0 * PI * 5.5 * t).sin();
            let phase = 2.0 * PI * f * vib * t;
            let voice = 0.18 * (phase.sin() + 0.5 * (2.0 * phase).sin() + 0.25 * (3.0 * phase).sin());
            let root = if ((t / 2.0) as u64) % 2 == 0 { 55.0 } else { 82.41 };
            let bass = 0.28 * (2.0 * PI * root * t).sin();
            let pad_l = 0.06 * ((2.0 * PI * 329.6 * t).sin() + (2.0 * PI * 415.3 * t).sin());
            let pad_r = 0.06 * ((2.0 * PI * 330.4 * t + 1.0).sin() + (2.0 * PI * 414.6 * t + 2.0).sin());
            let drums = 0.5 * kick + 0.25 * hat;
            c.left.push((voice + bass + pad_l + drums * 1.1) as f32);
            c.right.push((voice + bass + pad_r + drums * 0.9) as f32);
        }
        enc.write(&c)?;
        i += n;
    }
    enc.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_song_has_the_asked_length_and_is_not_silent() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("demo.wav");
        write_demo_song(&p, 2.0, 44_100).unwrap();
        let mut d = crate::Decoder::open_path(&p, crate::DecodeOptions::default()).unwrap();
        let mut frames = 0;
        let mut peak = 0f32;
        while let Some(c) = d.next_chunk().unwrap() {
            frames += c.left.len();
            peak = peak.max(c.peak());
        }
        assert_eq!(frames, 88_200);
        assert!(peak > 0.3 && peak <= 1.0, "{peak}");
    }
}
