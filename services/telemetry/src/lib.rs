//! stemq-telemetry: how a stemq process reports on itself.
//!
//! - [`logging`]: logs and OpenTelemetry traces, set up once per binary, and the trace
//!   context carried across processes;
//! - [`metrics`]: the Prometheus registry, the exposition formats, and the queue figures
//!   read from NATS at scrape time;
//! - [`readiness`]: what a process must have done before `/readyz` answers 200.

pub mod logging;
pub mod metrics;
pub mod readiness;
