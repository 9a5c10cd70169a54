//! Hybrid Demucs (v3, `demucs.hdemucs.HDemucs`) against PyTorch demucs 4.1.0: block by
//! block and end to end, on the two reduced, fully randomised models of
//! `scripts/make_fixtures_v3.py` (references in f64): `c3c3c3c3` (complex as channels)
//! and `d4d4d4d4` (magnitudes with the mixture's phase, `hybrid_old`). Run with
//! `--nocapture` for the figures (`PARITY ...` lines).
//!
//! The suite (`suites/parity_v3.rs`) runs on every device of the build: `cpu::` always,
//! `vulkan::` with `--features vulkan` (skipped with a message where no Vulkan device
//! is, a failure in CI), `cuda::` with `--features cuda`.

mod common;

/// The CPU, host kernels and all.
mod cpu {
    type B = stemq_demucs::CpuBackend;
    /// The parity bar of the port: blocks and whole models.
    #[allow(dead_code)]
    const BLOCK_DB: f64 = 100.0;
    #[allow(dead_code)]
    const E2E_DB: f64 = 100.0;
    include!("suites/parity_v3.rs");
}

/// A Vulkan device: CubeCL's kernels through its SPIR-V compiler.
#[cfg(feature = "vulkan")]
mod vulkan {
    type B = stemq_demucs::VulkanBackend;
    #[allow(dead_code)]
    const BLOCK_DB: f64 = crate::common::DEVICE_DB;
    #[allow(dead_code)]
    const E2E_DB: f64 = crate::common::DEVICE_DB;
    include!("suites/parity_v3.rs");
}

/// An NVIDIA GPU: the same kernels through CubeCL's CUDA compiler.
#[cfg(feature = "cuda")]
mod cuda {
    type B = stemq_demucs::CudaBackend;
    #[allow(dead_code)]
    const BLOCK_DB: f64 = crate::common::DEVICE_DB;
    #[allow(dead_code)]
    const E2E_DB: f64 = crate::common::DEVICE_DB;
    include!("suites/parity_v3.rs");
}
