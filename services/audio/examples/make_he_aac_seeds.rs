//! Writes the HE-AAC seeds of the decoders' fuzz corpus (`tests/corpus/audio/`): a tenth
//! of a second of a tone over noise, mono at 32 kHz, by `oxideav-aac`'s HE-AAC encoder
//! (no encoder Debian ships makes SBR), as ADTS and, copied by ffmpeg, as M4A.
//!
//! With two arguments it encodes a 16-bit stereo 44.1 kHz WAV to HE-AAC (ADTS, 48 kbit/s)
//! instead, for the decoding benchmark in `docs/benchmarks.md`.
//!
//! ```text
//! cargo run -p stemq-audio --example make_he_aac_seeds
//! cargo run -p stemq-audio --release --example make_he_aac_seeds -- song.wav song_he.aac
//! ```

use std::path::Path;
use std::process::Command;

use oxideav_aac::he_aac_encoder::{HeAacConfig, HeAacEncoder};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [wav, out] = &args[..] {
        let pcm: Vec<i16> =
            hound::WavReader::open(wav).expect("a WAV").samples::<i16>().map(|s| s.expect("16-bit")).collect();
        let mut enc = HeAacEncoder::new(HeAacConfig::new(44_100, 2, 48_000)).expect("encoder");
        std::fs::write(out, enc.encode_all(&pcm).expect("encode")).expect("write");
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/audio");
    let rate = 32_000u32;
    let mut seed = 7u32;
    let pcm: Vec<i16> = (0..rate as usize / 10)
        .map(|i| {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let noise = f64::from(seed >> 16) / 65_536.0 - 0.5;
            let tone = (2.0 * std::f64::consts::PI * 440.0 * i as f64 / f64::from(rate)).sin();
            ((0.5 * tone + 0.1 * noise) * 32_767.0) as i16
        })
        .collect();
    let mut enc = HeAacEncoder::new(HeAacConfig::new(rate, 1, 24_000)).expect("encoder");
    let adts = dir.join("he_aac_mono_32k.aac");
    std::fs::write(&adts, enc.encode_all(&pcm).expect("encode")).expect("write");
    let m4a = dir.join("he_aac_mono_32k.m4a");
    let status = Command::new("ffmpeg")
        .args(["-hide_banner", "-loglevel", "error", "-y", "-i"])
        .arg(&adts)
        .args(["-c", "copy", "-map_metadata", "-1", "-fflags", "+bitexact"])
        .arg(&m4a)
        .status()
        .expect("ffmpeg runs");
    assert!(status.success());
    println!("wrote {} and {}", adts.display(), m4a.display());
}
