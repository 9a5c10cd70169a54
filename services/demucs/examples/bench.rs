//! CPU speed of the port on a full-size (randomised) htdemucs.
//!
//! ```text
//! .stemq/venv-ref/bin/python services/demucs/scripts/make_fixtures.py --full --bench-seconds 30
//! cargo run -p stemq-demucs --release --example bench -- --seconds 30
//! ```
//!
//! Prints seconds and real-time factor, and the PyTorch figure recorded by the script
//! (`target/demucs-full/meta.json`) when present. `--parity` also compares the 10 s
//! end-to-end reference of the script; `--stream` uses the bounded-memory path;
//! `--batch N` runs N segments per forward pass; `--jobs N` runs N passes on
//! parallel threads; `--together N` runs N streamed jobs at once on one loaded model,
//! first each on its own passes, then sharing forward passes across jobs
//! (`stemq_demucs::batch`, up to N × batch × jobs segments per pass), and prints both and
//! their ratio; `--device cuda` (with
//! `--features cuda`) runs on the GPU, `--device ndarray` (with `--features
//! bench-ndarray`) on Burn's ndarray backend; `--weights f16` keeps the weights in f16
//! on the device (`--gpu-weights f16`); `STEMQ_DEMUCS_GENERIC_OPS=1` turns the host
//! kernels off; `STEMQ_BENCH_PACE=1` prints the time at each tenth of a streamed job.

use std::path::PathBuf;
use std::time::Instant;

use stemq_demucs::apply::{separate, ApplyOptions, BagOfModels, NoProgress};
use stemq_demucs::batch::CrossJobBatching;
use stemq_demucs::checkpoint::HostTensor;
use stemq_demucs::nn::WeightPrecision;
use stemq_demucs::repo::ModelRepo;
use stemq_demucs::stream::{separate_stream, StatsAccumulator};
use stemq_demucs::CpuBackend;

/// The parity tests' fixture reader and error figures.
#[path = "../tests/common/mod.rs"]
mod common;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seconds: f64 = flag(&args, "--seconds").map(|s| s.parse().expect("--seconds N")).unwrap_or(30.0);
    let dir = flag(&args, "--dir")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/demucs-full"));
    let repo = ModelRepo::open(dir.join("repo")).expect("run make_fixtures.py --full first");
    match flag(&args, "--device").map(String::as_str) {
        None | Some("cpu") => run::<CpuBackend>(&repo, &dir, &args, seconds, "burn/flex"),
        #[cfg(feature = "cuda")]
        Some("cuda") => run::<stemq_demucs::CudaBackend>(&repo, &dir, &args, seconds, "burn/cuda"),
        #[cfg(feature = "bench-ndarray")]
        Some("ndarray") => run::<burn_ndarray::NdArray>(&repo, &dir, &args, seconds, "burn/ndarray"),
        Some(other) => panic!("unknown --device {other} (cpu, or cuda with --features cuda)"),
    }
}

fn run<B: stemq_demucs::burn::tensor::backend::Backend>(
    repo: &ModelRepo,
    dir: &std::path::Path,
    args: &[String],
    seconds: f64,
    label: &str,
) {
    stemq_demucs::cpu::tune_allocator(); // as the stemq worker does
    let precision: WeightPrecision =
        flag(args, "--weights").map(|s| s.parse().expect("--weights f32|f16")).unwrap_or_default();
    let load = || repo.load_with::<B>("f0f0f0f0", &Default::default(), precision).expect("load");
    let t0 = Instant::now();
    let bag = load();
    let weight_bytes: u64 = bag.models().iter().map(|m| m.weight_bytes()).sum();
    eprintln!(
        "loaded in {:.2} s, weights {} ({:.1} MiB on the device)",
        t0.elapsed().as_secs_f64(),
        precision.as_str(),
        weight_bytes as f64 / (1u64 << 20) as f64
    );
    let sr = bag.samplerate() as usize;
    let len = (seconds * sr as f64) as usize;
    // Deterministic test signal: a tone plus hashed noise, computed per sample so the
    // streamed run holds none of the track (its memory is the model's and one pass's).
    let sample = |c: usize, i: usize| -> f32 {
        let mut z = (i as u64 * 2 + c as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        let n = ((z ^ (z >> 31)) >> 40) as f64 / (1u64 << 24) as f64 - 0.5;
        let t = i as f64 / sr as f64;
        (0.3 * (2.0 * std::f64::consts::PI * 220.0 * t).sin() + 0.1 * n + 0.01 * c as f64) as f32
    };
    let batch = flag(args, "--batch").map(|s| s.parse().expect("--batch N")).unwrap_or(1);
    let jobs = flag(args, "--jobs").map(|s| s.parse().expect("--jobs N")).unwrap_or(1);
    let opts = ApplyOptions { shifts: 0, batch_size: batch, jobs, ..ApplyOptions::default() };
    if let Some(n) = flag(args, "--together") {
        let n: usize = n.parse().expect("--together N");
        let alone = together(&bag, n, len, &opts, &sample);
        let mut shared_bag = load();
        let linger = std::time::Duration::from_millis(20);
        shared_bag.batch_across_jobs(CrossJobBatching { max_rows: n * batch * jobs, linger });
        let shared = together(&shared_bag, n, len, &opts, &sample);
        let stats = shared_bag.hub().expect("a hub").stats();
        let audio = n as f64 * seconds;
        println!(
            "{label}: {n} jobs × {seconds:.1} s at once (jobs {jobs}, batch {batch}): own passes {alone:.2} s \
             ({:.2} audio s/s), shared passes {shared:.2} s ({:.2} audio s/s), {:.2}× ({} forward passes, {} shared, \
             {:.2} segments each)",
            audio / alone,
            audio / shared,
            alone / shared,
            stats.forwards,
            stats.shared,
            stats.rows as f64 / stats.forwards.max(1) as f64
        );
        return;
    }
    let block = |pos: usize| -> Vec<Vec<f32>> {
        let end = (pos + sr).min(len);
        (0..2).map(|c| (pos..end).map(|i| sample(c, i)).collect()).collect()
    };
    let t0 = Instant::now();
    if args.iter().any(|a| a == "--stream") {
        // Bounded memory: blocks of 1 s in (generated on the fly, twice: statistics,
        // then separation), finished samples out and dropped.
        stream_job(&bag, len, &opts, &block, || ());
    } else {
        let data = (0..2).flat_map(|c| (0..len).map(move |i| (c, i))).map(|(c, i)| sample(c, i)).collect();
        let mix = HostTensor { shape: vec![2, len], data };
        let _ = separate(&bag, &mix, &opts, &mut NoProgress).expect("separate");
    }
    let dt = t0.elapsed().as_secs_f64();
    println!(
        "{label}: {seconds:.1} s of audio in {dt:.2} s, real-time factor {:.3} (jobs {}, batch {}, cores {}, weights {})",
        dt / seconds,
        opts.jobs,
        opts.batch_size,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        precision.as_str()
    );
    if let Ok(meta) = std::fs::read_to_string(dir.join("meta.json")) {
        println!("pytorch (from make_fixtures.py --full): {}", meta.trim().replace('\n', " "));
    }
    if args.iter().any(|a| a == "--parity") {
        parity(dir, &bag);
    }
}

fn parity<B: stemq_demucs::burn::tensor::backend::Backend>(
    dir: &std::path::Path,
    bag: &stemq_demucs::apply::BagOfModels<B>,
) {
    let f = common::load_path(&dir.join("apply_full.safetensors"));
    let t0 = Instant::now();
    let y =
        separate(bag, &f["track"], &ApplyOptions { shifts: 0, ..ApplyOptions::default() }, &mut NoProgress).unwrap();
    let (snr, max) = common::figures(&f["out.split"].data, &y.data);
    println!(
        "full-size parity (10 s, split/overlap 0.25, shifts 0): SNR {snr:.1} dB, max abs {max:.2e} ({:.1} s)",
        t0.elapsed().as_secs_f64()
    );
}

/// Seconds taken by `n` streamed jobs of `len` samples at once on `bag`; job `j` reads
/// the test signal from sample `j · 7919` on, so no two inputs are the same.
fn together<B: stemq_demucs::burn::tensor::backend::Backend>(
    bag: &BagOfModels<B>,
    n: usize,
    len: usize,
    opts: &ApplyOptions,
    sample: &(dyn Fn(usize, usize) -> f32 + Sync),
) -> f64 {
    let sr = bag.samplerate() as usize;
    let barrier = std::sync::Barrier::new(n);
    let t0 = Instant::now();
    std::thread::scope(|scope| {
        for j in 0..n {
            let barrier = &barrier;
            scope.spawn(move || {
                let block = |pos: usize| -> Vec<Vec<f32>> {
                    let end = (pos + sr).min(len);
                    (0..2).map(|c| (pos..end).map(|i| sample(c, i + j * 7919)).collect()).collect()
                };
                stream_job(bag, len, opts, &block, || barrier.wait());
            });
        }
    });
    t0.elapsed().as_secs_f64()
}

/// One streamed job over `len` samples read by `block(pos)` (1 s blocks): the
/// statistics pass, then `ready()`, then the separation as a job on the bag (output
/// dropped).
fn stream_job<B: stemq_demucs::burn::tensor::backend::Backend, R>(
    bag: &BagOfModels<B>,
    len: usize,
    opts: &ApplyOptions,
    block: &dyn Fn(usize) -> Vec<Vec<f32>>,
    ready: impl FnOnce() -> R,
) {
    let sr = bag.samplerate() as usize;
    let mut acc = StatsAccumulator::default();
    for pos in (0..len).step_by(sr) {
        let b = block(pos);
        acc.push(&[&b[0], &b[1]]);
    }
    ready();
    let _slot = bag.join();
    let mut pos = 0;
    let mut next = || {
        if pos >= len {
            return Ok(None);
        }
        let b = block(pos);
        pos += sr;
        Ok(Some(b))
    };
    if std::env::var_os("STEMQ_BENCH_PACE").is_some() {
        let mut pace = Pace { t0: std::time::Instant::now(), last: 0.0, every: 0.1 };
        separate_stream(bag, acc.finish(), &mut next, opts, &mut pace, &mut |_| Ok(())).expect("stream");
        return;
    }
    separate_stream(bag, acc.finish(), &mut next, opts, &mut NoProgress, &mut |_| Ok(())).expect("stream");
}

/// `STEMQ_BENCH_PACE=1`: prints the elapsed time at each tenth of the job, to see whether
/// a long run slows down as it goes (the machine's, not the work's, pace).
struct Pace {
    t0: std::time::Instant,
    last: f32,
    every: f32,
}

impl stemq_demucs::apply::Progress for Pace {
    fn chunk_done(&mut self, fraction: f32) {
        if fraction >= self.last + self.every || fraction >= 1.0 {
            self.last = fraction;
            eprintln!("pace: {:.0} % at {:.1} s", fraction * 100.0, self.t0.elapsed().as_secs_f64());
        }
    }
}

/// The value after `name` on the command line.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1))
}
