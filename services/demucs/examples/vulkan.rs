//! The Vulkan device's figures for docs/benchmarks.md: what a run costs there (on
//! lavapipe a test cost, not a GPU figure), the memory its pool holds after tracks of
//! growing length, and, with `CUBECL_DEBUG_LOG=FILE`, the kernels a forward pass
//! launches (one line per kernel in FILE).
//!
//! ```text
//! cargo run -p stemq-demucs --release --features vulkan --example vulkan -- --seconds 10,60,300
//! CUBECL_DEBUG_LOG=/tmp/k1.log cargo run ... --example vulkan -- --forwards 1
//! CUBECL_DEBUG_LOG=/tmp/k2.log cargo run ... --example vulkan -- --forwards 2   # the difference: one pass
//! ```
//!
//! `--repo DIR --model NAME` picks another model (default: the reduced fixture model
//! `a0a0a0a0`, 8 kHz, 1.5 s segment); `--fused` (with `--features fusion`) runs Burn's
//! fusion over CubeCL, `--plain` without it (the default, and what the engine runs).

use std::path::PathBuf;
use std::time::Instant;

use stemq_demucs::apply::{ApplyOptions, NoProgress};
use stemq_demucs::burn::tensor::backend::Backend;
use stemq_demucs::repo::ModelRepo;
use stemq_demucs::stream::{separate_stream, StatsAccumulator};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let repo = flag("--repo")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/repo"));
    let model = flag("--model").unwrap_or_else(|| "a0a0a0a0".into());
    let repo = ModelRepo::open(&repo).expect("model folder");
    let adapter = stemq_demucs::vulkan::resolve(None, true).expect("a Vulkan device");
    let opened = stemq_demucs::vulkan::open(adapter.index, None).expect("opens");
    println!(
        "device vulkan:{} = {} (driver {}), device-local memory {:?} bytes, f16 {}",
        adapter.index, adapter.name, adapter.driver, opened.device_memory, opened.f16
    );
    if args.iter().any(|a| a == "--fused") {
        #[cfg(feature = "fusion")]
        return run::<burn_fusion_backend::Fused>(&repo, &model, &opened, &args, "fused");
        #[cfg(not(feature = "fusion"))]
        panic!("--fused needs --features fusion");
    }
    run::<Plain>(&repo, &model, &opened, &args, "plain");
}

/// CubeCL's backend on wgpu without Burn's fusion (the engine's `VulkanBackend` without
/// `--features fusion`).
type Plain =
    stemq_demucs::burn::backend::wgpu::CubeBackend<stemq_demucs::burn::backend::wgpu::WgpuRuntime, f32, i32, u8>;

#[cfg(feature = "fusion")]
mod burn_fusion_backend {
    /// Burn's fusion over the same CubeCL backend.
    pub type Fused = stemq_demucs::burn::backend::wgpu::Wgpu<f32, i32, u8>;
}

fn run<B: Backend<Device = stemq_demucs::burn::backend::wgpu::WgpuDevice>>(
    repo: &ModelRepo,
    model: &str,
    opened: &stemq_demucs::vulkan::Opened,
    args: &[String],
    label: &str,
) {
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let t0 = Instant::now();
    let bag = repo.load::<B>(model, &opened.device).expect("load");
    println!("{label}: loaded {model} in {:.2} s", t0.elapsed().as_secs_f64());
    let sr = bag.samplerate() as usize;
    if let Some(n) = flag("--forwards") {
        // N forward passes of one trained segment: the kernels' log (CUBECL_DEBUG_LOG)
        // of N = 2 minus that of N = 1 is one pass.
        let n: usize = n.parse().expect("--forwards N");
        let len = (bag.max_allowed_segment() * sr as f64) as usize;
        let track = stemq_demucs::checkpoint::HostTensor {
            shape: vec![2, len],
            data: (0..2 * len).map(|i| ((i as f32) * 0.001).sin() * 0.3).collect(),
        };
        let opts = ApplyOptions { shifts: 0, split: false, ..ApplyOptions::default() };
        let t0 = Instant::now();
        for _ in 0..n {
            stemq_demucs::apply::separate(&bag, &track, &opts, &mut NoProgress).expect("forward");
        }
        println!("{label}: {n} forward passes of {len} samples in {:.2} s", t0.elapsed().as_secs_f64());
        return;
    }
    let lengths: Vec<f64> = flag("--seconds")
        .unwrap_or_else(|| "10,60".into())
        .split(',')
        .map(|s| s.parse().expect("--seconds S[,S…]"))
        .collect();
    for seconds in lengths {
        let len = (seconds * sr as f64) as usize;
        let sample = |c: usize, i: usize| -> f32 {
            let t = i as f64 / sr as f64;
            (0.3 * (2.0 * std::f64::consts::PI * 220.0 * t).sin() + 0.05 * ((i * 7 + c * 13) % 17) as f64 / 17.0) as f32
        };
        let block = |pos: usize| -> Vec<Vec<f32>> {
            let end = (pos + sr).min(len);
            (0..2).map(|c| (pos..end).map(|i| sample(c, i)).collect()).collect()
        };
        let mut acc = StatsAccumulator::default();
        for pos in (0..len).step_by(sr) {
            let b = block(pos);
            acc.push(&[&b[0], &b[1]]);
        }
        let mut pos = 0;
        let mut next = || {
            if pos >= len {
                return Ok(None);
            }
            let b = block(pos);
            pos += sr;
            Ok(Some(b))
        };
        let opts = ApplyOptions { shifts: 0, ..ApplyOptions::default() };
        let t0 = Instant::now();
        separate_stream(&bag, acc.finish(), &mut next, &opts, &mut NoProgress, &mut |_| Ok(())).expect("stream");
        let took = t0.elapsed().as_secs_f64();
        let pool = stemq_demucs::vulkan::pool_usage(opened).expect("pool usage");
        println!(
            "{label}: {seconds} s track in {took:.2} s ({:.2}× real time); pool after it: {} bytes in use, {} reserved",
            seconds / took,
            pool.in_use,
            pool.reserved
        );
    }
}
