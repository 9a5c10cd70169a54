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
