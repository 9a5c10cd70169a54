//! The read side: how anyone reads the status view the projector writes.
//!
//! This module owns the read model, so that readers (the ingress, the relay, the
//! command line) depend on the contracts and never on the writer (the projector):
//!
//! - [`view`]: one job's view — [`get_view`] as stored in the `stemq_jobs` bucket, and
//!   [`current_view`] / [`Views::current`], the stored view else the job's `requested`
//!   event folded from the log, so a job that exists is never "not found";
//! - [`index`]: the [`ListIndex`] of ids newest first per status, fed by a watch on the
//!   bucket, and the [`Cursor`] of a page; it also holds what a job's place in its
//!   queue needs ([`ListIndex::place`]);
//! - [`queue`]: the arithmetic of that place — `queue_position`, and the `eta` from the
//!   slots of the live workers and the model's typical run time;
//! - [`outcome`]: a job's one outcome, read the same way by every service.
//!
//! The projector writes with [`stored_view`]'s revision (compare-and-set); nothing here
//! writes.

pub mod index;
pub mod outcome;
pub mod queue;
pub mod view;

pub use index::{Cursor, ListIndex, MinuteCount};
pub use queue::Place;
pub use view::{current_view, get_view, request_of, stored_view, watch_view, Stored, ViewError, Views};
