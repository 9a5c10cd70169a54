//! The one error type for a failed JetStream call in the service crates.
//!
//! This module owns how a service says "a call to NATS failed": which step failed
//! ([`JetStreamError::what`], a fixed phrase such as `"open bucket"`), a kind to match
//! on ([`JetStreamErrorKind`]), and the client's error kept as the source, never flattened
//! into a string. It follows async-nats's own `Error<Kind>`: the kind is small and
//! `Copy`, the message reads `<what>: <source>`, and [`std::error::Error::source`] hands
//! back the original error.
//!
//! ```
//! use stemq_nats::error::{JetStreamError, JetStreamErrorKind};
//! let e = JetStreamError::open("open bucket")(std::io::Error::other("timed out"));
//! assert_eq!(e.kind(), JetStreamErrorKind::Open);
//! assert_eq!(e.to_string(), "open bucket: timed out");
//! ```

use std::error::Error as StdError;
use std::fmt;

/// The boxed error of the NATS client (or of whatever else failed underneath).
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// What kind of JetStream call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum JetStreamErrorKind {
    /// Opening a stream, consumer or bucket, or subscribing, at start.
    Open,
    /// Reading: a KV get, a direct get, stream or consumer info.
    Read,
    /// Writing: a publish or a KV write.
    Write,
}

impl JetStreamErrorKind {
    /// A low-cardinality name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            JetStreamErrorKind::Open => "open",
            JetStreamErrorKind::Read => "read",
            JetStreamErrorKind::Write => "write",
        }
    }
}

/// A JetStream call that failed: which one, its kind, and the client's error.
#[derive(Debug)]
pub struct JetStreamError {
    kind: JetStreamErrorKind,
    what: &'static str,
    source: BoxError,
}

impl JetStreamError {
    /// `what` failed with `source`.
    pub fn new(kind: JetStreamErrorKind, what: &'static str, source: impl Into<BoxError>) -> JetStreamError {
        JetStreamError { kind, what, source: source.into() }
    }

    /// For `map_err`: opening `what` failed.
    pub fn open<E: Into<BoxError>>(what: &'static str) -> impl FnOnce(E) -> JetStreamError {
        move |e| JetStreamError::new(JetStreamErrorKind::Open, what, e)
    }

    /// For `map_err`: reading `what` failed.
    pub fn read<E: Into<BoxError>>(what: &'static str) -> impl FnOnce(E) -> JetStreamError {
        move |e| JetStreamError::new(JetStreamErrorKind::Read, what, e)
    }

    /// For `map_err`: writing `what` failed.
    pub fn write<E: Into<BoxError>>(what: &'static str) -> impl FnOnce(E) -> JetStreamError {
        move |e| JetStreamError::new(JetStreamErrorKind::Write, what, e)
    }

    /// The kind, to match on.
    pub fn kind(&self) -> JetStreamErrorKind {
        self.kind
    }

    /// Which call failed (a fixed phrase, e.g. `"open bucket"`).
    pub fn what(&self) -> &'static str {
        self.what
    }
}

impl fmt::Display for JetStreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.source)
    }
}

impl StdError for JetStreamError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

/// An error and its sources, `: `-separated, each said once (a source whose message
/// already ends the text is not repeated). For log lines.
pub fn report(e: &dyn StdError) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] JetStreamError);

    #[test]
    fn keeps_the_source_and_its_kind() {
        let e = JetStreamError::read("read view")(std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"));
        assert_eq!(e.kind(), JetStreamErrorKind::Read);
        assert_eq!(e.what(), "read view");
        let io = e.source().and_then(|s| s.downcast_ref::<std::io::Error>()).expect("the io error is the source");
        assert_eq!(io.kind(), std::io::ErrorKind::TimedOut);
    }

    #[test]
    fn report_says_each_cause_once() {
        let e = Outer(JetStreamError::write("publish outcome")(std::io::Error::other("no responders")));
        assert_eq!(report(&e), "outer: publish outcome: no responders");
    }
}
