//! Peak-memory benchmark of the whole streamed pipeline.
//!
//! Synthesises an N-minute stereo 16-bit WAV on disk (streamed), then runs
//! `separate_file`: decode → dsp-separate → encode 4 WAV stems into a temp
//! dir, chunk by chunk, and prints the peak RSS (VmHWM) and the time taken.
//!
//! ```text
//! cargo run -p stemq-audio --release --example rss_bench -- --minutes 5
//! cargo run -p stemq-audio --release --example rss_bench -- --minutes 60 --clip clamp
//! ```
//! Options: `--minutes N` (default 5), `--clip rescale|clamp|none` (default
//! rescale, Demucs's default), `--rate HZ` input sample rate (default 44100;
//! anything else also exercises the resampler).

use std::f64::consts::PI;
use std::time::Instant;

use stemq_audio::{
    separate_file, ClipMode, DecodeOptions, DspOptions, EncodeSettings, OutputFormat, StemEncoder, StereoChunk,
};

fn vm_hwm_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let minutes: f64 = get("--minutes").map(|v| v.parse().expect("--minutes N")).unwrap_or(5.0);
    let rate: u32 = get("--rate").map(|v| v.parse().expect("--rate HZ")).unwrap_or(44_100);
    let clip = match get("--clip").as_deref() {
        None | Some("rescale") => ClipMode::Rescale,
        Some("clamp") => ClipMode::Clamp,
        Some("none") => ClipMode::None,
        Some(other) => panic!("unknown clip mode {other}"),
    };

    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("input.wav");
    let t0 = Instant::now();
    let frames = (minutes * 60.0 * rate as f64) as u64;
    let mut enc = StemEncoder::create(&input, OutputFormat::Wav16, ClipMode::Clamp, rate).unwrap();
    let block = 65_536u64;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
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
            let hit = (-(t % 0.25) / 0.03).exp() * noise;
            let voice = 0.2 * (2.0 * PI * 220.0 * t * (1.0 + 0.01 * (2.0 * PI * 5.0 * t).sin())).sin();
            let bass = 0.3 * (2.0 * PI * 55.0 * t).sin();
            let pad_l = 0.1 * (2.0 * PI * 441.3 * t).sin();
            let pad_r = 0.1 * (2.0 * PI * 438.2 * t + 1.0).sin();
            c.left.push((voice + bass + pad_l + 0.6 * hit) as f32);
            c.right.push((voice + bass + pad_r + 0.3 * hit) as f32);
        }
        enc.write(&c).unwrap();
        i += n;
    }
    enc.finish().unwrap();
    let gen_secs = t0.elapsed().as_secs_f64();
    let hwm_after_gen = vm_hwm_kib();

    let out = dir.path().join("stems");
    std::fs::create_dir(&out).unwrap();
    let t1 = Instant::now();
    let mut last = -1i32;
    let stems = separate_file(
        &input,
        &out,
        &DecodeOptions::default(),
        &DspOptions::default(),
        EncodeSettings { format: OutputFormat::Wav16, clip },
        &mut |f| {
            let pct = (f * 10.0) as i32;
            if pct != last {
                last = pct;
                eprint!("{}% ", pct * 10);
            }
        },
        &|| false,
    )
    .expect("separation");
    eprintln!();
    let sep_secs = t1.elapsed().as_secs_f64();
    for s in &stems {
        println!(
            "stem {:7} {:>12} bytes  {:.1} s  sha256 {}",
            s.name,
            s.summary.bytes,
            s.summary.duration_secs,
            &s.summary.sha256[..16]
        );
    }
    println!("input: {minutes} min stereo at {rate} Hz ({frames} frames), clip mode {clip:?}");
    println!("generate input WAV: {gen_secs:.1} s (VmHWM so far {:.1} MiB)", hwm_after_gen as f64 / 1024.0);
    println!("decode+separate+encode 4 stems: {sep_secs:.1} s ({:.1}x realtime)", minutes * 60.0 / sep_secs);
    println!("peak RSS (VmHWM): {:.1} MiB", vm_hwm_kib() as f64 / 1024.0);
}
