//! stemq-core: the contracts every stemq service shares, and the runtime they share.
//!
//! The contracts need serde and little else: an engine crate depends on this crate
//! with `default-features = false` and never compiles the queue, the object store or the
//! telemetry exporters. The feature `runtime` (on by default) adds the modules that talk
//! to NATS, object storage and the outside world; the feature `fake` adds
//! `engine::FakeEngine`, the scripted engine of tests and benchmarks.
//!
//! Contracts (always built):
//!
//! - [`request`]: the job request, its validation and the job id;
//! - [`batch`]: batches of requests, their content-derived id, item states and view;
//! - [`event`]: the CloudEvents the pipeline records;
//! - [`failure`]: failure codes, the stable reasons recorded when a job fails;
//! - [`device`]: devices engines run on (`cpu`, `cuda:0`, ...) as a type;
//! - [`upcast`]: the upcasters that bring events of older types to the current shape;
//! - [`view`]: the status view and the pure state machine `apply(view, event)`;
//! - [`engine`]: the separation engine seam (and, with `fake`, the fake engine);
//! - [`uri`]: which input URIs may be read (objects inside the configured stores, and
//!   http(s) URLs only where the operator allows them);
//! - [`netpolicy`]: the address policy of every URL stemq connects to (special-purpose
//!   ranges, allow-lists, the check that pins the resolved address);
//! - [`schema`]: JSON Schemas generated from these types.
//!
//! Runtime (feature `runtime`):
//!
//! - `batch_log`: the batch log (`STEMQ_BATCHES`): a batch's rounds, its jobs, its end;
//! - `auth`: API keys, roles and the `stemq_keys` bucket; who a caller is;
//! - `read`: the read side — one job's view (the KV view, else the request from the
//!   log), the list index and its cursor; what every reader of the view uses;
//! - `error`: the one error type of a failed JetStream call in the services;
//! - `metrics`: the Prometheus metrics every process shares, the queue figures and the
//!   exposition formats;
//! - `promtool`: test support that runs Prometheus's promtool on bodies and rules;
//! - `nats`: subjects, streams, consumers and the KV bucket, applied from `nats/`;
//! - `publish`: publishing events once (request, outcome) or plainly;
//! - `pull`: the pull loop of every long-running consumer (resubscribes when its stream ends);
//! - `nats_users`: NATS users and their permissions (`nats/users.json`), nkey
//!   credentials, the server's `authorization` block;
//! - `nats_server`: a local `nats-server` process (users, TLS, a cluster node) for
//!   `stemq dev` and tests;
//! - `nats_cluster`: a three-node JetStream cluster of such processes on loopback, for
//!   the cluster fault tests and the R3 benchmark;
//! - `readiness`: what a process must have done before `/readyz` answers 200;
//! - `registry`: the worker registry (`stemq_workers`): who lives and what each serves;
//! - `storage`: object storage for inputs and outputs (local files, S3);
//! - `telemetry`: logging set-up shared by the binaries;
//! - `webhook`: webhook signing, per-owner secrets and the SSRF policy for receivers.

// The contracts: what an engine crate builds against.
pub mod batch;
pub mod device;
pub mod engine;
pub mod event;
pub mod failure;
pub mod netpolicy;
pub mod request;
pub mod schema;
pub mod upcast;
pub mod uri;
pub mod view;

// The runtime: NATS, storage, telemetry, metrics, webhooks.
#[cfg(feature = "runtime")]
pub mod asyncapi;
#[cfg(feature = "runtime")]
pub mod auth;
#[cfg(feature = "runtime")]
pub mod batch_log;
#[cfg(feature = "runtime")]
pub mod error;
#[cfg(feature = "runtime")]
pub mod ledger;
#[cfg(feature = "runtime")]
pub mod metrics;
#[cfg(feature = "runtime")]
pub mod nats;
#[cfg(feature = "runtime")]
pub mod nats_cluster;
#[cfg(feature = "runtime")]
pub mod nats_server;
#[cfg(feature = "runtime")]
pub mod nats_users;
#[cfg(feature = "runtime")]
pub mod promtool;
#[cfg(feature = "runtime")]
pub mod publish;
#[cfg(feature = "runtime")]
pub mod pull;
#[cfg(feature = "runtime")]
pub mod read;
#[cfg(feature = "runtime")]
pub mod readiness;
#[cfg(feature = "runtime")]
pub mod registry;
#[cfg(feature = "runtime")]
pub mod storage;
#[cfg(feature = "runtime")]
pub mod telemetry;
#[cfg(feature = "runtime")]
pub mod webhook;

pub use event::{Event, EventBody};
pub use request::{JobId, JobRequest, NormalizedRequest};
pub use view::{apply, JobStatus, JobView, Position};
