//! Helpers shared by the integration tests: signal generators and measurements.
#![allow(dead_code)]

use std::path::Path;

use stemq_audio::{ClipMode, DecodeOptions, Decoder, OutputFormat, StemEncoder, StereoChunk};

pub fn sine(freq: f64, amp: f64, rate: u32, frames: usize) -> Vec<f32> {
    (0..frames).map(|i| (amp * (2.0 * std::f64::consts::PI * freq * i as f64 / rate as f64).sin()) as f32).collect()
}

/// Deterministic xorshift noise in [-1, 1).
pub struct Noise(pub u64);

impl Noise {
    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f64 / (1u64 << 23) as f64 - 1.0) as f32
    }
}

pub fn decode_all(path: &Path, opts: DecodeOptions) -> Result<StereoChunk, stemq_audio::AudioError> {
    let mut d = Decoder::open_path(path, opts)?;
    let mut all = StereoChunk::default();
    while let Some(c) = d.next_chunk()? {
        assert_eq!(c.left.len(), c.right.len());
        all.extend_from(&c);
    }
    Ok(all)
}

/// Frequency from linearly-interpolated upward zero crossings.
pub fn measure_freq(x: &[f32], rate: u32) -> f64 {
    let mut crossings = Vec::new();
    for i in 1..x.len() {
        if x[i - 1] < 0.0 && x[i] >= 0.0 {
            let frac = -x[i - 1] as f64 / (x[i] - x[i - 1]) as f64;
            crossings.push(i as f64 - 1.0 + frac);
        }
    }
    assert!(crossings.len() > 2, "signal has no oscillation");
    let periods = (crossings.len() - 1) as f64;
    rate as f64 * periods / (crossings[crossings.len() - 1] - crossings[0])
}

/// Amplitude of a sine from its RMS.
pub fn measure_amp(x: &[f32]) -> f64 {
    let e: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    (2.0 * e / x.len() as f64).sqrt()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Writes `chunk` as one stem file, fed in odd-sized pieces to exercise buffering.
pub fn write_stem(path: &Path, chunk: &StereoChunk, format: OutputFormat, clip: ClipMode, rate: u32) {
    let mut enc = StemEncoder::create(path, format, clip, rate).unwrap();
    let mut i = 0;
    while i < chunk.len() {
        let j = (i + 3001).min(chunk.len());
        enc.write(&StereoChunk::from_planar(chunk.left[i..j].to_vec(), chunk.right[i..j].to_vec())).unwrap();
        i = j;
    }
    enc.finish().unwrap();
}

/// Whether `program` runs (`program arg` exits 0). When it does not, the skip rule:
/// in CI (`CI=true`) the test fails; elsewhere it prints `SKIPPED: <what>` and this
/// returns `false` for the test to skip that part.
pub fn have_tool(program: &str, arg: &str, what: &str) -> bool {
    let ok = std::process::Command::new(program).arg(arg).output().is_ok_and(|o| o.status.success());
    if !ok {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "{what}: {program} is missing under CI (scripts/install-test-deps.sh installs it)"
        );
        eprintln!("SKIPPED: {what} ({program} is not installed: scripts/install-test-deps.sh installs it)");
    }
    ok
}
