//! Decoding speed and peak memory of one input file, for `docs/benchmarks.md` (beside
//! ffmpeg's decode of the same file).
//!
//! ```text
//! cargo run -p stemq-audio --release --example decode_bench -- song.m4a          # at its own rate
//! cargo run -p stemq-audio --release --example decode_bench -- song.m4a --44k    # as the engines get it
//! ```
//! Prints the codec, the audio's length, the wall time, the speed (× real time) and the
//! peak RSS (VmHWM) of the process.

use std::time::Instant;

use stemq_audio::{DecodeOptions, Decoder, ENGINE_SAMPLE_RATE};

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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.iter().find(|a| !a.starts_with("--")).expect("usage: decode_bench FILE [--44k]");
    let engine_rate = args.iter().any(|a| a == "--44k");
    let started = Instant::now();
    let probe = Decoder::open_path(path, DecodeOptions::default()).expect("open");
    let native = probe.info().sample_rate;
    let codec = probe.info().codec.clone();
    drop(probe);
    let rate = if engine_rate { ENGINE_SAMPLE_RATE } else { native };
    let mut d =
        Decoder::open_path(path, DecodeOptions { target_sample_rate: rate, max_duration_secs: None }).expect("open");
    let mut frames = 0u64;
    while let Some(c) = d.next_chunk().expect("decode") {
        frames += c.len() as u64;
    }
    let took = started.elapsed().as_secs_f64();
    let secs = frames as f64 / f64::from(rate);
    println!(
        "{path}: {codec}, {secs:.1} s of audio at {rate} Hz in {took:.2} s ({:.0}x real time), peak RSS {:.1} MiB",
        secs / took,
        vm_hwm_kib() as f64 / 1024.0
    );
}
