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

use std::time::Instant;

use stemq_audio::{separate_file, ClipMode, DecodeOptions, DspOptions, EncodeSettings, OutputFormat};

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
    stemq_audio::synth::write_demo_song(&input, minutes * 60.0, rate).expect("writing the input");
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
