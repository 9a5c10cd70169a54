//! Block-by-block and end-to-end parity against PyTorch demucs 4.1.0 on the reduced,
//! fully randomised model of `scripts/make_fixtures.py` (references computed in f64).
//! Run with `--nocapture` to see the figures (`PARITY ...` lines).
//!
//! The suite (`suites/parity.rs`) runs on every device of the build: `cpu::` always,
//! `vulkan::` with `--features vulkan` (skipped with a message where no Vulkan device
//! is, a failure in CI), `cuda::` with `--features cuda`.

mod common;

/// The CPU, host kernels and all.
mod cpu {
    type B = stemq_demucs::CpuBackend;
    /// Blocks: well above the 90 dB end-to-end target (a faithful f32 port is ~120 dB).
    #[allow(dead_code)]
    const BLOCK_DB: f64 = 100.0;
    #[allow(dead_code)]
    const E2E_DB: f64 = 90.0;
    include!("suites/parity.rs");
}

/// A Vulkan device: CubeCL's kernels through its SPIR-V compiler.
#[cfg(feature = "vulkan")]
mod vulkan {
    type B = stemq_demucs::VulkanBackend;
    #[allow(dead_code)]
    const BLOCK_DB: f64 = crate::common::DEVICE_DB;
    #[allow(dead_code)]
    const E2E_DB: f64 = crate::common::DEVICE_DB;
    include!("suites/parity.rs");
}

/// An NVIDIA GPU: the same kernels through CubeCL's CUDA compiler.
#[cfg(feature = "cuda")]
mod cuda {
    type B = stemq_demucs::CudaBackend;
    #[allow(dead_code)]
    const BLOCK_DB: f64 = crate::common::DEVICE_DB;
    #[allow(dead_code)]
    const E2E_DB: f64 = crate::common::DEVICE_DB;
    include!("suites/parity.rs");
}
