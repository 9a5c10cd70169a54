//! CPU speed of the port on a full-size (randomised) htdemucs.
//!
//! ```text
//! .venv-ref/bin/python services/demucs/scripts/make_fixtures.py --full --bench-seconds 30
//! cargo run -p stemq-demucs --release --example bench -- --seconds 30
//! ```
//!
//! Prints seconds and real-time factor, and the PyTorch figure recorded by the script
//! (`target/demucs-full/meta.json`) when present. `--parity` also compares the 10 s
//! end-to-end reference of the script; `--stream` uses the bounded-memory path;
//! `--batch N` runs N segments per forward pass; `--jobs N` runs N passes on
//! parallel threads; `--device cuda` (with
//! `--features cuda`) runs on the GPU.

use std::path::PathBuf;
use std::time::Instant;

use stemq_demucs::apply::{separate, ApplyOptions, NoProgress};
use stemq_demucs::checkpoint::HostTensor;
use stemq_demucs::repo::ModelRepo;
use stemq_demucs::stream::{separate_stream, StatsAccumulator};
use stemq_demucs::CpuBackend;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let seconds: f64 = arg("--seconds").map(|s| s.parse().expect("--seconds N")).unwrap_or(30.0);
    let dir = arg("--dir")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/demucs-full"));
    let repo = ModelRepo::open(dir.join("repo")).expect("run make_fixtures.py --full first");
    match arg("--device").as_deref() {
        None | Some("cpu") => run::<CpuBackend>(&repo, &dir, &args, seconds, "burn/flex"),
        #[cfg(feature = "cuda")]
        Some("cuda") => run::<stemq_demucs::CudaBackend>(&repo, &dir, &args, seconds, "burn/cuda"),
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
    let t0 = Instant::now();
    let bag = repo.load::<B>("f0f0f0f0", &Default::default()).expect("load");
    eprintln!("loaded in {:.2} s", t0.elapsed().as_secs_f64());
    let sr = bag.samplerate() as usize;
    let len = (seconds * sr as f64) as usize;
    // deterministic test signal: tones + LCG noise
    let mut state = 1u64;
    let mut data = vec![0f32; 2 * len];
    for c in 0..2 {
        for i in 0..len {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let n = ((state >> 33) as f64 / (1u64 << 31) as f64) - 0.5;
            let t = i as f64 / sr as f64;
            data[c * len + i] =
                (0.3 * (2.0 * std::f64::consts::PI * 220.0 * t).sin() + 0.1 * n + 0.01 * c as f64) as f32;
        }
    }
    let mix = HostTensor { shape: vec![2, len], data };
    let batch = args
        .iter()
        .position(|a| a == "--batch")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.parse().expect("--batch N"))
        .unwrap_or(1);
    let jobs = args
        .iter()
        .position(|a| a == "--jobs")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.parse().expect("--jobs N"))
        .unwrap_or(1);
    let opts = ApplyOptions { shifts: 0, batch_size: batch, jobs, ..ApplyOptions::default() };
    let t0 = Instant::now();
    if args.iter().any(|a| a == "--stream") {
        // Bounded memory: blocks of 1 s in, finished samples out and dropped.
        let (l, r) = mix.data.split_at(len);
        let mut acc = StatsAccumulator::default();
        acc.push(&[l, r]);
        let mut pos = 0;
        let mut next = || {
            if pos >= len {
                return Ok(None);
            }
            let end = (pos + sr).min(len);
            let b = vec![l[pos..end].to_vec(), r[pos..end].to_vec()];
            pos = end;
            Ok(Some(b))
        };
        separate_stream(&bag, acc.finish(), &mut next, &opts, &mut NoProgress, &mut |_| Ok(())).expect("stream");
    } else {
        let _ = separate(&bag, &mix, &opts, &mut NoProgress).expect("separate");
    }
    let dt = t0.elapsed().as_secs_f64();
    println!(
        "{label}: {seconds:.1} s of audio in {dt:.2} s, real-time factor {:.3} (jobs {}, batch {}, cores {})",
        dt / seconds,
        opts.jobs,
        opts.batch_size,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
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
    let bytes = std::fs::read(dir.join("apply_full.safetensors")).expect("apply_full.safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let get = |k: &str| {
        let v = st.tensor(k).unwrap();
        HostTensor {
            shape: v.shape().to_vec(),
            data: v.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
        }
    };
    let track = get("track");
    let reference = get("out.split");
    let t0 = Instant::now();
    let y = separate(bag, &track, &ApplyOptions { shifts: 0, ..ApplyOptions::default() }, &mut NoProgress).unwrap();
    let (mut sig, mut err, mut max) = (0f64, 0f64, 0f64);
    for (r, e) in reference.data.iter().zip(&y.data) {
        let d = *r as f64 - *e as f64;
        sig += (*r as f64).powi(2);
        err += d * d;
        max = max.max(d.abs());
    }
    println!(
        "full-size parity (10 s, split/overlap 0.25, shifts 0): SNR {:.1} dB, max abs {:.2e} ({:.1} s)",
        10.0 * (sig / err).log10(),
        max,
        t0.elapsed().as_secs_f64()
    );
}
