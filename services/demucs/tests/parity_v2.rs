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

// The parity bar of the port: blocks and whole models.
crate::on_every_device!("suites/parity_v2.rs", cpu_block_db: 100.0, cpu_e2e_db: 100.0);
