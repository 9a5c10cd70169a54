//! Shared helpers of the parity tests: fixture loading and error figures.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use stemq_demucs::burn;
use stemq_demucs::checkpoint::HostTensor;
#[cfg(not(feature = "cuda"))]
use stemq_demucs::CpuBackend;

/// The backend the parity tests run on: the CPU, or CUDA with `--features cuda`.
#[cfg(not(feature = "cuda"))]
pub type B = CpuBackend;
/// The backend the parity tests run on: the CPU, or CUDA with `--features cuda`.
#[cfg(feature = "cuda")]
pub type B = stemq_demucs::CudaBackend;

/// The bar on a GPU backend (Vulkan, CUDA), blocks and end to end: CubeCL's reductions
/// and matmuls may sum in another order than PyTorch's CPU kernels (the figures are
/// well above it, see `PARITY` lines and docs/benchmarks.md).
pub const DEVICE_DB: f64 = 80.0;

/// Includes the suite file `$suite` once per device of the build, each in a module
/// of its own with its backend `B` and its bars `BLOCK_DB` and `E2E_DB`: `cpu` (the
/// bars given), `vulkan` with `--features vulkan` and `cuda` with `--features cuda`
/// (both [`DEVICE_DB`]). A test's path (`cpu::`, `vulkan::`, `cuda::`) names its device.
#[macro_export]
macro_rules! on_every_device {
    ($suite:literal, cpu_block_db: $block:expr, cpu_e2e_db: $e2e:expr) => {
        /// The CPU, host kernels and all.
        mod cpu {
            type B = stemq_demucs::CpuBackend;
            #[allow(dead_code)]
            const BLOCK_DB: f64 = $block;
            #[allow(dead_code)]
            const E2E_DB: f64 = $e2e;
            include!($suite);
        }

        /// A Vulkan device: CubeCL's kernels through its SPIR-V compiler.
        #[cfg(feature = "vulkan")]
        mod vulkan {
            type B = stemq_demucs::VulkanBackend;
            #[allow(dead_code)]
            const BLOCK_DB: f64 = $crate::common::DEVICE_DB;
            #[allow(dead_code)]
            const E2E_DB: f64 = $crate::common::DEVICE_DB;
            include!($suite);
        }

        /// An NVIDIA GPU: the same kernels through CubeCL's CUDA compiler.
        #[cfg(feature = "cuda")]
        mod cuda {
            type B = stemq_demucs::CudaBackend;
            #[allow(dead_code)]
            const BLOCK_DB: f64 = $crate::common::DEVICE_DB;
            #[allow(dead_code)]
            const E2E_DB: f64 = $crate::common::DEVICE_DB;
            include!($suite);
        }
    };
}

/// The device a test runs on, from its path (`cpu::`, `vulkan::`, `cuda::`), for the
/// `PARITY` lines.
fn device_of_test() -> String {
    let t = std::thread::current();
    let name = t.name().unwrap_or("");
    match name.split("::").next() {
        Some(d @ ("cpu" | "vulkan" | "cuda")) => d.to_string(),
        _ => "-".to_string(),
    }
}

/// True when the test should not run on backend `B`: a Vulkan build on a machine with
/// no Vulkan device says so and skips, except in CI (`CI=true`), where that fails.
pub fn skip<B: Backend>() -> bool {
    #[cfg(feature = "vulkan")]
    if std::any::TypeId::of::<B>() == std::any::TypeId::of::<stemq_demucs::VulkanBackend>() {
        return vulkan_adapter(std::thread::current().name().unwrap_or("a Vulkan test")).is_none();
    }
    false
}

/// The Vulkan device the tests run on (`vulkan`, a software driver allowed), or `None`
/// after a SKIPPED line naming `what`; in CI (`CI=true`) no device is a failure.
#[cfg(feature = "vulkan")]
pub fn vulkan_adapter(what: &str) -> Option<&'static stemq_demucs::vulkan::Adapter> {
    let found = stemq_demucs::vulkan::resolve(None, true);
    if found.is_none() {
        let why = format!(
            "no Vulkan device: {} (Mesa's lavapipe: scripts/install-test-deps.sh)",
            stemq_demucs::vulkan::describe()
        );
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
        eprintln!("SKIPPED: {what}: {why}");
    }
    found
}

/// The fixtures folder: `STEMQ_DEMUCS_FIXTURES` when set (a test binary built on one
/// machine and run on another, `scripts/gpu_check.sh`), else the crate's own.
pub fn fixtures() -> PathBuf {
    match std::env::var_os("STEMQ_DEMUCS_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
    }
}

/// Reads a committed fixture (f32 or i64 tensors) into host tensors.
pub fn load(name: &str) -> HashMap<String, HostTensor> {
    load_path(&fixtures().join(name))
}

/// Reads a safetensors file (f32 or i64 tensors) into host tensors.
pub fn load_path(path: &std::path::Path) -> HashMap<String, HostTensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| {
        panic!("{}: {e} (run scripts/make_fixtures.py, with --full for the full size)", path.display())
    });
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            let shape = v.shape().to_vec();
            let data = match v.dtype() {
                safetensors::Dtype::F32 => {
                    v.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
                }
                safetensors::Dtype::I64 => {
                    v.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f32).collect()
                }
                d => panic!("unexpected dtype {d:?}"),
            };
            (k, HostTensor { shape, data })
        })
        .collect()
}

/// A host tensor on backend `B`'s default device.
pub fn dev<B: Backend, const D: usize>(t: &HostTensor) -> Tensor<B, D> {
    let shape: [usize; D] = t.shape.clone().try_into().unwrap();
    Tensor::from_data(TensorData::new(t.data.clone(), shape), &Default::default())
}

/// (SNR in dB of `est` against `reference`, max abs error).
pub fn figures(reference: &[f32], est: &[f32]) -> (f64, f64) {
    assert_eq!(reference.len(), est.len(), "length mismatch");
    let mut sig = 0f64;
    let mut err = 0f64;
    let mut max = 0f64;
    for (r, e) in reference.iter().zip(est) {
        let d = (*r as f64) - (*e as f64);
        sig += (*r as f64) * (*r as f64);
        err += d * d;
        max = max.max(d.abs());
    }
    (10.0 * (sig / err.max(1e-300)).log10(), max)
}

/// Asserts shapes match and SNR ≥ `min_db`; prints the figures.
pub fn check(label: &str, reference: &HostTensor, est: &HostTensor, min_db: f64) -> f64 {
    assert_eq!(reference.shape, est.shape, "{label}: shape");
    let (snr, max) = figures(&reference.data, &est.data);
    eprintln!("PARITY {:<6} {label:<40} SNR {snr:7.1} dB   max abs {max:.2e}", device_of_test());
    assert!(snr >= min_db, "{label}: SNR {snr:.1} dB < {min_db} dB (max abs {max:.2e})");
    snr
}

/// `separate_stream` on a whole `[C, L]` track handed over in blocks of `block` samples:
/// the engine's path, collected back into `[S, C, L]`.
#[allow(dead_code)]
pub fn stream_separate<B: Backend>(
    bag: &stemq_demucs::apply::BagOfModels<B>,
    track: &HostTensor,
    opts: &stemq_demucs::apply::ApplyOptions,
    block: usize,
) -> HostTensor {
    use stemq_demucs::stream::{separate_stream, StatsAccumulator};
    let (ch, len) = (track.shape[0], track.shape[1]);
    let rows_in: Vec<&[f32]> = (0..ch).map(|c| &track.data[c * len..(c + 1) * len]).collect();
    let mut acc = StatsAccumulator::default();
    acc.push(&rows_in);
    let mut pos = 0;
    let mut next = || {
        if pos >= len {
            return Ok(None);
        }
        let end = (pos + block).min(len);
        let b = rows_in.iter().map(|r| r[pos..end].to_vec()).collect();
        pos = end;
        Ok(Some(b))
    };
    let nsrc = bag.sources().len();
    let mut rows: Vec<Vec<f32>> = vec![Vec::new(); nsrc * ch];
    let mut sink = |t: HostTensor| {
        let n = t.shape[2];
        for (i, row) in rows.iter_mut().enumerate() {
            row.extend_from_slice(&t.data[i * n..(i + 1) * n]);
        }
        Ok(())
    };
    separate_stream(bag, acc.finish(), &mut next, opts, &mut stemq_demucs::apply::NoProgress, &mut sink)
        .expect("separate_stream");
    HostTensor { shape: vec![nsrc, ch, len], data: rows.concat() }
}
