//! The `stemq` command line as a library, so the binary stays thin and the integration
//! tests can run the very same commands as child processes.
//!
//! - [`cli`]: arguments and dispatch;
//! - [`dev`]: the one-process development stack;
//! - [`models`]: pulling the official Demucs checkpoints into a model folder;
//! - [`separate`]: the Demucs-compatible one-shot command;
//! - [`services`]: each service alone;
//! - [`client`]: submit, status, list, watch, dead-letter replay;
//! - [`bench`]: the benchmarks;
//! - [`top`]: the live terminal view;
//! - [`webhooks`]: webhook settings (re-enabling a URL a 410 disabled).

pub mod bench;
pub mod cli;
pub mod client;
pub mod dev;
pub mod models;
pub mod separate;
pub mod services;
pub mod top;
pub mod webhooks;

use clap::Parser;

/// Parses `std::env::args`, runs the command, and returns the process exit code.
pub fn main_entry() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    stemq_core::telemetry::init(args.log_format(), args.service_name());
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = rt.block_on(cli::run(args));
    stemq_core::telemetry::flush();
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
