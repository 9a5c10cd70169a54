//! Size of stemq's FLAC against libFLAC's `flac` command line at its default level (-5).
//!
//! Writes three kinds of 16-bit 44.1 kHz WAV into a temp dir: the synthetic demo song
//! (`stemq synth`), the four stems the `dsp` engine makes of it (what stemq really
//! encodes), and a second synthetic signal (decaying harmonic notes, panned, over a
//! −60 dB noise floor). Each is encoded by stemq's `FlacWriter` and by `flac -5`; the
//! table gives the sizes, their ratio and the encoding times (libFLAC's: the whole
//! command, reading the WAV included; stemq's: the encoder alone, from memory).
//!
//! ```text
//! apt-get install -y flac
//! cargo run -p stemq-audio --release --example flac_size -- --seconds 60
//! ```
//! Options: `--seconds N` (default 60), `--flac PATH` (default `flac` on the `PATH`).
//! With the `mp3` feature it also times MP3 encoding of the demo song (320 kbit/s,
//! presets 2 and 7).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use stemq_audio::{
    separate_file, ClipMode, DecodeOptions, Decoder, DspOptions, EncodeSettings, OutputFormat, StemEncoder, StereoChunk,
};

/// Decaying harmonic notes (a plucked-string-like spectrum), four voices panned apart,
/// over a −60 dB white-noise floor.
fn write_notes(path: &Path, seconds: f64) {
    let rate = 44_100.0;
    let frames = (seconds * rate) as usize;
    let mut enc = StemEncoder::create(path, OutputFormat::Wav16, ClipMode::Clamp, 44_100).unwrap();
    let scale = [196.0, 220.0, 246.94, 293.66, 329.63, 392.0, 440.0, 493.88];
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut noise = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f64 / (1u64 << 23) as f64 - 1.0
    };
    let block = 65_536;
    let mut i = 0;
    while i < frames {
        let n = block.min(frames - i);
        let mut c = StereoChunk::with_capacity(n);
        for j in i..i + n {
            let t = j as f64 / rate;
            let (mut l, mut r) = (0.0, 0.0);
            for voice in 0..4 {
                // A new note every 0.6 s per voice, offset between voices.
                let period = 0.6;
                let start = voice as f64 * 0.15;
                let since = (t - start).rem_euclid(period);
                let k = ((t - start) / period).floor() as i64;
                let f = scale[((k * 3 + voice * 2) as usize) % scale.len()] * if voice == 3 { 0.5 } else { 1.0 };
                let mut s = 0.0;
                for h in 1..=8 {
                    let decay = (-since * (2.0 + 1.5 * h as f64)).exp();
                    s += decay / h as f64 * (2.0 * std::f64::consts::PI * f * h as f64 * since).sin();
                }
                let pan = [0.2, 0.8, 0.4, 0.6][voice as usize];
                l += 0.15 * s * (1.0 - pan);
                r += 0.15 * s * pan;
            }
            c.left.push((l + 0.001 * noise()) as f32);
            c.right.push((r + 0.001 * noise()) as f32);
        }
        enc.write(&c).unwrap();
        i += n;
    }
    enc.finish().unwrap();
}

/// Encodes a 16-bit WAV with stemq's FLAC writer (the integers go through exactly);
/// the time is of the encoding alone (the WAV is decoded into memory first).
fn stemq_flac(wav: &Path, out: &Path) -> f64 {
    let mut d = Decoder::open_path(wav, DecodeOptions { target_sample_rate: 44_100, max_duration_secs: None }).unwrap();
    let mut chunks = Vec::new();
    while let Some(c) = d.next_chunk().unwrap() {
        chunks.push(c);
    }
    let t = Instant::now();
    let mut enc = StemEncoder::create(out, OutputFormat::Flac16, ClipMode::None, 44_100).unwrap();
    for c in &chunks {
        enc.write(c).unwrap();
    }
    enc.finish().unwrap();
    t.elapsed().as_secs_f64()
}

fn libflac(flac: &str, wav: &Path, out: &Path) -> f64 {
    let t = Instant::now();
    let st = Command::new(flac).args(["-5", "-s", "-f", "-o"]).arg(out).arg(wav).status().expect("run flac");
    assert!(st.success(), "flac -5 failed on {}", wav.display());
    t.elapsed().as_secs_f64()
}

fn size(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let seconds: f64 = get("--seconds").map(|v| v.parse().expect("--seconds N")).unwrap_or(60.0);
    let flac = get("--flac").unwrap_or_else(|| "flac".into());
    let dir = tempfile::tempdir().unwrap();
    let song = dir.path().join("demo.wav");
    stemq_audio::synth::write_demo_song(&song, seconds, 44_100).unwrap();
    let notes = dir.path().join("notes.wav");
    write_notes(&notes, seconds);
    let stems_dir = dir.path().join("stems");
    std::fs::create_dir(&stems_dir).unwrap();
    let stems = separate_file(
        &song,
        &stems_dir,
        &DecodeOptions::default(),
        &DspOptions::default(),
        EncodeSettings { format: OutputFormat::Wav16, clip: ClipMode::Rescale },
        &mut |_| {},
        &|| false,
    )
    .unwrap();
    let mut inputs: Vec<(String, PathBuf)> = vec![("demo song".into(), song)];
    inputs.extend(stems.into_iter().map(|s| (format!("demo song, dsp `{}` stem", s.name), s.path)));
    inputs.push(("notes over a noise floor".into(), notes));

    println!("{seconds} s each, 16-bit stereo 44.1 kHz; `{flac} -5` against stemq's FlacWriter\n");
    println!("| signal | WAV (B) | libFLAC -5 (B) | stemq (B) | stemq / libFLAC | libFLAC s | stemq s |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let (mut total_lib, mut total_ours) = (0u64, 0u64);
    for (i, (name, wav)) in inputs.iter().enumerate() {
        let ours = dir.path().join(format!("{i}.stemq.flac"));
        let theirs = dir.path().join(format!("{i}.libflac.flac"));
        let t_ours = stemq_flac(wav, &ours);
        let t_lib = libflac(&flac, wav, &theirs);
        let (w, l, o) = (size(wav), size(&theirs), size(&ours));
        total_lib += l;
        total_ours += o;
        println!("| {name} | {w} | {l} | {o} | {:.4} | {t_lib:.2} | {t_ours:.2} |", o as f64 / l as f64);
        let st = Command::new(&flac).args(["-t", "-s"]).arg(&ours).status().expect("run flac -t");
        assert!(st.success(), "flac -t refused stemq's {}", ours.display());
    }
    println!(
        "\nall: stemq / libFLAC = {:.4} (every stemq file passed `flac -t`)",
        total_ours as f64 / total_lib as f64
    );
    #[cfg(feature = "mp3")]
    mp3_speed(&inputs[0].1, dir.path());
}

/// MP3 of the first input at Demucs's default (320 kbit/s, preset 2) and its fastest
/// preset: size and encoding time (from memory).
#[cfg(feature = "mp3")]
fn mp3_speed(wav: &Path, dir: &Path) {
    let mut d = Decoder::open_path(wav, DecodeOptions { target_sample_rate: 44_100, max_duration_secs: None }).unwrap();
    let mut chunks = Vec::new();
    while let Some(c) = d.next_chunk().unwrap() {
        chunks.push(c);
    }
    for quality in [2, 7] {
        let out = dir.join(format!("q{quality}.mp3"));
        let t = Instant::now();
        let format = OutputFormat::Mp3(stemq_audio::Mp3Settings { bitrate_kbps: 320, quality });
        let mut enc = StemEncoder::create(&out, format, ClipMode::None, 44_100).unwrap();
        for c in &chunks {
            enc.write(c).unwrap();
        }
        enc.finish().unwrap();
        println!(
            "MP3 320 kbit/s preset {quality} of the first signal: {} B in {:.2} s",
            size(&out),
            t.elapsed().as_secs_f64()
        );
    }
}
