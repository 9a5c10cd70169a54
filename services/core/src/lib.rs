//! stemq-core: the contracts every stemq service shares.
//!
//! - [`request`]: the job request, its validation and the job id;
//! - [`event`]: the CloudEvents the pipeline records;
//! - [`upcast`]: the upcasters that bring events of older types to the current shape;
//! - [`view`]: the status view and the pure state machine `apply(view, event)`;
//! - [`read`]: the read side — one job's view (the KV view, else the request from the
//!   log), the list index and its cursor; what every reader of the view uses;
//! - [`error`]: the one error type of a failed JetStream call in the services;
//! - [`metrics`]: the Prometheus metrics every process shares;
//! - [`nats`]: subjects, streams, consumers and the KV bucket, applied from `nats/`;
//! - [`publish`]: publishing events once (request, outcome) or plainly;
//! - [`pull`]: the pull loop of every long-running consumer (resubscribes when its stream ends);
//! - [`nats_server`]: a local `nats-server` process for `stemq dev` and tests;
//! - [`engine`]: the separation engine seam and the fake engine;
//! - [`storage`]: object storage for inputs and outputs (local files, S3);
//! - [`uri`]: which input URIs may be read (only objects inside the configured stores);
//! - [`schema`]: JSON Schemas generated from these types;
//! - [`telemetry`]: logging set-up shared by the binaries;
//! - [`webhook`]: webhook signing, per-owner secrets and the SSRF policy for receivers.

pub mod engine;
pub mod error;
pub mod event;
pub mod metrics;
pub mod nats;
pub mod nats_server;
pub mod publish;
pub mod pull;
pub mod read;
pub mod request;
pub mod schema;
pub mod storage;
pub mod telemetry;
pub mod upcast;
pub mod uri;
pub mod view;
pub mod webhook;

pub use event::{Event, EventBody};
pub use request::{JobId, JobRequest, NormalizedRequest};
pub use view::{apply, JobStatus, JobView, Position};
