//! The `stemq` command line as a library, so the binary stays thin and the integration
//! tests can run the very same commands as child processes.
//!
//! - [`cli`]: the parser and the dispatch;
//! - [`global`]: options every command shares, option groups, the shutdown signal;
//! - [`job_opts`]: the request flags `submit` and `separate` share;
//! - [`dev`]: the one-process development stack;
//! - [`models`]: pulling the official Demucs checkpoints into a model folder;
//! - [`separate`]: the Demucs-compatible one-shot command;
//! - [`services`]: each service alone, and loading engines;
//! - [`client`]: submit, status, list, watch, cancel, retry, dead-letter replay over NATS;
//! - [`api`]: the same client commands over the HTTP API (`--api URL`);
//! - [`batch`]: a folder of songs as one batch over the HTTP API (`stemq batch DIR`);
//! - [`bench`]: the benchmarks;
//! - [`top`]: the live terminal view;
//! - [`webhooks`]: webhook settings (re-enabling a URL a 410 disabled);
//! - [`keys`]: API keys (create, list, revoke) and `stemq dev`'s admin key;
//! - [`users`]: NATS users and their credentials (`stemq nats users`).

pub mod alloc;
pub mod api;
pub mod batch;
pub mod bench;
pub mod cli;
pub mod client;
pub mod credits;
pub mod dev;
pub mod global;
pub mod job_opts;
pub mod keys;
pub mod models;
pub mod separate;
pub mod services;
pub mod top;
pub mod users;
pub mod webhooks;

#[cfg(test)]
mod metrics_tests;

use clap::Parser;

/// Parses `std::env::args`, runs the command, and returns the process exit code.
pub fn main_entry() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    stemq_telemetry::logging::init(args.log_format(), args.service_name());
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = rt.block_on(cli::run(args));
    stemq_telemetry::logging::flush();
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, `outer: cause: root`, like `{:#}`, but each
/// cause once: an error whose message already ends with its source's (a third-party
/// error that writes its source into its own message and returns it from `source()`
/// too) does not get the source's text a second time.
pub fn report(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.is_empty() {
            out = text;
        } else if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::report;

    /// An error that writes its source into its message and returns it as its source.
    #[derive(Debug, thiserror::Error)]
    #[error("cannot listen on 127.0.0.1:1: {0}")]
    struct Doubled(#[source] std::io::Error);

    #[test]
    fn each_cause_prints_once() {
        let io = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let e = anyhow::Error::new(Doubled(io)).context("starting the ingress");
        let text = report(&e);
        assert_eq!(
            text,
            format!("starting the ingress: cannot listen on 127.0.0.1:1: {}", std::io::ErrorKind::AddrInUse)
        );
        let plain = anyhow::anyhow!("root").context("middle").context("top");
        assert_eq!(report(&plain), "top: middle: root");
    }
}
