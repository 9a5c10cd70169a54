//! The job request: what a client asks for, how it is validated, and how the job id is
//! derived from it.
//!
//! This module owns the *identity* of a job. The job id is the lowercase hex SHA-256 of
//! the RFC 8785 (JCS) canonical JSON of the [`NormalizedRequest`]: every default filled
//! in, `webhook`, `metadata` and the deadlines (`start_before`, `max_runtime`) left out
//! — they say when and how to tell, not what to compute — the owner included. Two requests that differ
//! only in key order, whitespace or an explicitly given default share one id; anything
//! the output depends on changes it. `docs/job-id.md` describes the algorithm for
//! implementers in other languages.
//!
//! | module | owns |
//! |---|---|
//! | `options` | the enum-valued options ([`Model`], [`OutputFormat`], [`Encoding`], [`ClipMode`], [`OtherMethod`]) and their wire names |
//! | `job` | [`JobRequest`] as a client sends it, its field-by-field validation, and [`NormalizedRequest`], its canonical form |
//! | `id` | [`JobId`], the hash of the canonical form, only ever built by hashing or [`JobId::parse`] |
//! | `error` | [`RequestError`], naming the offending field |

mod error;
mod id;
mod job;
mod options;

pub use error::RequestError;
pub use id::JobId;
pub use job::{request_json, JobRequest, NormalizedRequest, Webhook};
pub use options::{ClipMode, Encoding, Model, OtherMethod, OutputFormat};

/// Longest accepted `audio_uri`, in bytes.
pub const MAX_URI_LEN: usize = 2048;
/// Largest accepted `metadata` object, serialised, in bytes.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;
/// Most random shifts a request may ask for (Demucs's own CLI has no cap; each shift
/// costs a full extra pass).
pub const MAX_SHIFTS: u32 = 20;
/// Largest accepted `max_runtime`, in seconds (a day).
pub const MAX_RUNTIME_S: u64 = 86_400;
/// The owner of jobs `stemq separate` runs locally (no queue, no API keys).
pub const ANONYMOUS: &str = "anonymous";
