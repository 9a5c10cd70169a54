//! Logging set-up shared by every stemq binary.
//!
//! This module owns the log format: JSON lines (one object per event, span fields such
//! as `job_id` included) for services, human-readable text for `stemq dev` on a
//! terminal. `RUST_LOG` filters as usual; the default is `info`.

use tracing_subscriber::{fmt, EnvFilter};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// For people at a terminal.
    Text,
}

/// Installs the global subscriber (once; later calls are ignored).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,async_nats=warn"));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(false).try_init(),
        LogFormat::Text => {
            use std::io::IsTerminal;
            builder.compact().with_ansi(std::io::stderr().is_terminal()).try_init()
        }
    };
}
