//! The validation error of a request: which field, and why.

use schemars::JsonSchema;
use serde::Serialize;

/// A request that failed validation: which field, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, JsonSchema)]
#[error("invalid `{field}`: {message}")]
pub struct RequestError {
    /// The offending field (`body` when the whole document is wrong).
    pub field: String,
    /// What is wrong, for a person.
    pub message: String,
}

impl RequestError {
    pub(super) fn new(field: &str, message: impl Into<String>) -> Self {
        RequestError { field: field.to_string(), message: message.into() }
    }
}
