//! stemq-nats: how stemq lives in NATS JetStream.
//!
//! The crate root holds the layout (subjects, stream, consumer and bucket names), how a
//! process connects ([`connect_with`], [`ConnectAuth`]) and the definitions applied from
//! the repository's `nats/` folder ([`apply`], [`ensure`]). The modules:
//!
//! - [`asyncapi`]: the AsyncAPI document of what stemq publishes and reads in NATS;
//! - [`publish`]: publishing events once (request, outcome) or plainly;
//! - [`pull`]: the pull loop of every long-running consumer (resubscribes when its stream ends);
//! - [`read`]: the read side: one job's view (the KV view, else the request from the
//!   log), the list index and its cursor, a job's outcome;
//! - [`queue_figures`]: the backlog per pool consumer and lane, and who serves it, read
//!   in one go (the queue exporter's gauges, `stemq top`);
//! - [`registry`]: the worker registry (`stemq_workers`): who lives and what each serves;
//! - [`batch_log`]: the batch log (`STEMQ_BATCHES`): a batch's rounds, its jobs, its end;
//! - [`users`]: NATS users and their permissions (`nats/users.json`), the server's
//!   `authorization` block;
//! - [`credentials`]: a user's nkey seed and its file, what a process connects with;
//! - [`error`]: the one error type of a failed JetStream call in the services.

mod connect;
mod definitions;
mod subjects;

pub mod asyncapi;
pub mod batch_log;
pub mod credentials;
pub mod error;
pub mod publish;
pub mod pull;
pub mod queue_figures;
pub mod read;
pub mod registry;
pub mod users;

pub use connect::*;
pub use definitions::*;
pub use subjects::*;
