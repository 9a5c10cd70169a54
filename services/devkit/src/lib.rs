//! stemq-devkit: what `stemq dev`, the tests and the benchmarks stand up around stemq,
//! and never a production service.
//!
//! - [`nats_server`]: a local `nats-server` process (users, TLS, a cluster node);
//! - [`nats_cluster`]: a three-node JetStream cluster of such processes on loopback, for
//!   the cluster fault tests and the R3 benchmark;
//! - [`promtool`]: runs Prometheus's promtool on `/metrics` bodies and the alert rules,
//!   for the tests that check them.

pub mod nats_cluster;
pub mod nats_server;
pub mod promtool;

/// Runs `f` (a start that waits for processes to come up) off the async runtime's worker
/// threads; a panic in it goes on in the caller.
async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}
