//! stemq-core: the contracts every stemq crate shares.
//!
//! Types and pure functions, no I/O: the engine crates (`stemq-audio`, `stemq-demucs`)
//! build against this crate and never compile the queue, the object store or the
//! telemetry exporters. The feature `resolve` adds [`netpolicy::check_url`] (one DNS
//! lookup through tokio); the feature `fake` adds `engine::FakeEngine`, the scripted
//! engine of tests and benchmarks. What runs these contracts lives in the crates next to
//! this one (the README's crate table): `stemq-nats`, `stemq-accounts`,
//! `stemq-telemetry`, `stemq-storage`, `stemq-webhook`, `stemq-devkit`.
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

pub use event::{Event, EventBody};
pub use request::{JobId, JobRequest, NormalizedRequest};
pub use view::{apply, JobStatus, JobView, Position};
