//! DiffQ-quantised checkpoints (the `_q` models) decoded without Python: two reduced
//! models quantised by diffq 0.2.4 as demucs exports them (`scripts/make_fixtures_diffq.py`,
//! random bit widths 2 to 14), loaded, and run against the models diffq itself restores
//! (references in f64). Run with `--nocapture` for the figures.
//!
//! The suite (`suites/parity_diffq.rs`) runs on every device of the build: `cpu::` always,
//! `vulkan::` with `--features vulkan` (skipped with a message where no Vulkan device
//! is, a failure in CI), `cuda::` with `--features cuda`.

mod common;

// The parity bar of the port: blocks and whole models.
crate::on_every_device!("suites/parity_diffq.rs", cpu_block_db: 100.0, cpu_e2e_db: 100.0);
