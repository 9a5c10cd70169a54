//! Block-by-block and end-to-end parity against PyTorch demucs 4.1.0 on the reduced,
//! fully randomised model of `scripts/make_fixtures.py` (references computed in f64).
//! Run with `--nocapture` to see the figures (`PARITY ...` lines).
//!
//! The suite (`suites/parity.rs`) runs on every device of the build: `cpu::` always,
//! `vulkan::` with `--features vulkan` (skipped with a message where no Vulkan device
//! is, a failure in CI), `cuda::` with `--features cuda`.

mod common;

// Blocks: well above the 90 dB end-to-end target (a faithful f32 port is ~120 dB).
crate::on_every_device!("suites/parity.rs", cpu_block_db: 100.0, cpu_e2e_db: 90.0);
