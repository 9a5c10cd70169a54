//! `stemq`: parses the command line and runs it. Everything else lives in the modules.

mod bench;
mod cli;
mod client;
mod dev;
mod services;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    stemq_core::telemetry::init(args.log_format());
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    match rt.block_on(cli::run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
