//! The waveform Demucs (`demucs.demucs.Demucs`) against PyTorch demucs 4.1.0, on the two
//! reduced, fully randomised models of `scripts/make_fixtures_v2.py` (references in
//! f64): `e5e5e5e5` (with rewrite convolutions) and `f6f6f6f6` (without, like the `mdx`
//! members); and a bag mixing them with a Hybrid Demucs, as `mdx` does. Run with
//! `--nocapture` for the figures (`PARITY ...` lines).
//!
//! The suite (`suites/parity_v2.rs`) runs on every device of the build: `cpu::` always,
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
    include!("suites/parity_v2.rs");
}

/// A Vulkan device: CubeCL's kernels through its SPIR-V compiler.
#[cfg(feature = "vulkan")]
mod vulkan {
    type B = stemq_demucs::VulkanBackend;
    #[allow(dead_code)]
    const BLOCK_DB: f64 = crate::common::DEVICE_DB;
    #[allow(dead_code)]
    const E2E_DB: f64 = crate::common::DEVICE_DB;
    include!("suites/parity_v2.rs");
}

/// An NVIDIA GPU: the same kernels through CubeCL's CUDA compiler.
#[cfg(feature = "cuda")]
mod cuda {
    type B = stemq_demucs::CudaBackend;
    #[allow(dead_code)]
    const BLOCK_DB: f64 = crate::common::DEVICE_DB;
    #[allow(dead_code)]
    const E2E_DB: f64 = crate::common::DEVICE_DB;
    include!("suites/parity_v2.rs");
}
