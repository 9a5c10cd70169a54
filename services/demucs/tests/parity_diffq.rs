//! DiffQ-quantised checkpoints (the `_q` models) decoded without Python: two reduced
//! models quantised by diffq 0.2.4 as demucs exports them (`scripts/make_fixtures_diffq.py`,
//! random bit widths 2 to 14), loaded, and run against the models diffq itself restores
//! (references in f64). Run with `--nocapture` for the figures.
//!
//! The suite (`suites/parity_diffq.rs`) runs on every device of the build: `cpu::` always,
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
    include!("suites/parity_diffq.rs");
}

/// A Vulkan device: CubeCL's kernels through its SPIR-V compiler.
#[cfg(feature = "vulkan")]
mod vulkan {
    type B = stemq_demucs::VulkanBackend;
    #[allow(dead_code)]
    const BLOCK_DB: f64 = crate::common::DEVICE_DB;
    #[allow(dead_code)]
    const E2E_DB: f64 = crate::common::DEVICE_DB;
    include!("suites/parity_diffq.rs");
}

/// An NVIDIA GPU: the same kernels through CubeCL's CUDA compiler.
#[cfg(feature = "cuda")]
mod cuda {
    type B = stemq_demucs::CudaBackend;
    #[allow(dead_code)]
    const BLOCK_DB: f64 = crate::common::DEVICE_DB;
    #[allow(dead_code)]
    const E2E_DB: f64 = crate::common::DEVICE_DB;
    include!("suites/parity_diffq.rs");
}
