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

// The parity bar of the port: blocks and whole models.
crate::on_every_device!("suites/parity_v3.rs", cpu_block_db: 100.0, cpu_e2e_db: 100.0);
