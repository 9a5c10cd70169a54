//! Every error code the API answers, once: [`ErrorCode`].
//!
//! This module owns the list. Each code has its HTTP status, its wire name (the
//! `error.code` of every error body, over HTTP and over NATS), a line for the docs (the
//! OpenAPI `Error` schema), and where the page has them, the words it shows a person.
//! [`crate::ApiError`] takes its status from the code, the OpenAPI answers list codes
//! of this type, and the page's table of words (`web/words.js`, between its
//! `ErrorCode` markers) is generated from it: a test fails when the file is stale.

use std::borrow::Cow;
use std::fmt;

use axum::http::StatusCode;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Serialize, Serializer};

macro_rules! error_codes {
    ($( $(#[doc = $doc:literal])+ $variant:ident = ($code:literal, $status:literal, $words:expr), )+) => {
        /// What went wrong, stable and matchable (see the module docs).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $( $(#[doc = $doc])+ $variant, )+
        }

        impl ErrorCode {
            /// Every code, by status.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant),+];

            /// The wire name (`"rate_limited"`).
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $code,)+
                }
            }

            /// The HTTP status it is answered with (over NATS, the reply's `http_status`).
            pub fn status(self) -> StatusCode {
                let status = match self {
                    $(ErrorCode::$variant => $status,)+
                };
                StatusCode::from_u16(status).expect("every status of the list is valid")
            }

            /// When it is answered, for the docs.
            pub fn doc(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => concat!($($doc),+).trim_ascii(),)+
                }
            }

            /// What the page says to a person, where it has its own words (otherwise it
            /// shows the answer's message).
            pub fn words(self) -> Option<&'static str> {
                match self {
                    $(ErrorCode::$variant => $words,)+
                }
            }
        }
    };
}

error_codes! {
    /// A path or query string that does not parse, or more than one `Authorization` header.
    BadRequest = ("bad_request", 400, None),
    /// An API key in the URL.
    KeyInQuery = ("key_in_query", 400, Some("Keys are never sent in a link. Sign in with the key instead.")),
    /// An upload whose body did not arrive whole.
    UploadInterrupted = ("upload_interrupted", 400, Some("The upload stopped before the end. Try again.")),
    /// No key, or a malformed, unknown or revoked one (`WWW-Authenticate: Bearer`).
    Unauthorized = (
        "unauthorized",
        401,
        Some("That API key was not accepted. Check it for typos, or ask for a new one (stemq keys create).")
    ),
    /// The owner's credits cannot pay the job; nothing was queued.
    InsufficientCredits = (
        "insufficient_credits",
        402,
        Some("You are out of credits. Ask your operator to add credits, then try again.")
    ),
    /// The key's role does not allow the route.
    Forbidden = (
        "forbidden",
        403,
        Some("This key is not allowed to do that. Ask an operator for a key with the right role.")
    ),
    /// An unknown route, or no such job, batch or delivery (another owner's included).
    NotFound = ("not_found", 404, Some("That job does not exist, or this key cannot see it.")),
    /// A known route asked with another method (`Allow` lists those there are).
    MethodNotAllowed = ("method_not_allowed", 405, None),
    /// A request body that stalled too long or came too slowly (`Connection: close`).
    RequestTimeout = ("request_timeout", 408, None),
    /// The job's state does not allow it.
    Conflict = ("conflict", 409, None),
    /// The job has not succeeded (yet): it has no stems to serve.
    NotReady = ("not_ready", 409, None),
    /// A body over the limit, or an upload over the store's limit.
    TooLarge = (
        "too_large",
        413,
        Some("This file is too large to upload. Trim it, or send a compressed format (FLAC or MP3).")
    ),
    /// A body of another media type than the route takes.
    UnsupportedMediaType = ("unsupported_media_type", 415, None),
    /// An invalid request; `field` says which part.
    InvalidRequest = ("invalid_request", 422, None),
    /// No live worker serves the model, and this ingress refuses rather than queues.
    ModelNotServed = (
        "model_not_served",
        422,
        Some("No worker runs that model right now. Pick another model, or start a worker that serves it.")
    ),
    /// An upload without a byte.
    EmptyUpload = ("empty_upload", 422, None),
    /// Over the key's rate (`Retry-After`, `RateLimit-Policy`, `RateLimit`).
    RateLimited = ("rate_limited", 429, Some("Too many requests from this key.")),
    /// Over the key's jobs queued or running (`Retry-After`, `RateLimit-Policy`, `RateLimit`).
    TooManyInFlight = (
        "too_many_in_flight",
        429,
        Some("This key already has as many jobs running as it may. Wait for one to finish.")
    ),
    /// The server failed to handle the request; it logged why.
    Internal = ("internal", 500, None),
    /// NATS or the store did not answer (`Retry-After`); retrying is safe.
    Unavailable = (
        "unavailable",
        503,
        Some("stemq is busy or restarting. Nothing was lost; try again in a moment.")
    ),
    /// No object store is configured for uploads and stems.
    NoStore = (
        "no_store",
        503,
        Some("This server has nowhere to keep uploads. Ask its operator to configure a store.")
    ),
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl JsonSchema for ErrorCode {
    fn schema_name() -> Cow<'static, str> {
        "ErrorCode".into()
    }

    /// Every code, one `const` each with its status and when it is answered.
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let one_of: Vec<serde_json::Value> = ErrorCode::ALL
            .iter()
            .map(|c| {
                let description = format!("{} — {}", c.status().as_u16(), c.doc());
                serde_json::json!({"const": c.as_str(), "description": description, "type": "string"})
            })
            .collect();
        Schema::try_from(serde_json::json!({
            "description": "Stable and matchable; the status it comes with is fixed per code.",
            "oneOf": one_of,
        }))
        .expect("an object is a schema")
    }
}

/// The page's file that holds the generated table.
pub const WORDS_JS: &str = include_str!("../web/words.js");
const BEGIN: &str = "// BEGIN ErrorCode (generated from services/ingress/src/error_code.rs; do not edit)\n";
const END: &str = "// END ErrorCode\n";

/// The page's table of API error codes: each code's status and, where the page has
/// them, its words.
pub fn words_table() -> String {
    let mut out = String::from("const API_ERRORS = {\n");
    for c in ErrorCode::ALL {
        let words = match c.words() {
            Some(w) => format!(", words: {}", serde_json::to_string(w).expect("a string")),
            None => String::new(),
        };
        out.push_str(&format!("  {}: {{ status: {}{words} }},\n", c.as_str(), c.status().as_u16()));
    }
    out.push_str("};\n");
    out
}

/// `text` (the page's `words.js`) with its generated table replaced by `table`; `None`
/// when the markers are missing.
pub fn with_table(text: &str, table: &str) -> Option<String> {
    let start = text.find(BEGIN)? + BEGIN.len();
    let end = start + text[start..].find(END)?;
    Some(format!("{}{table}{}", &text[..start], &text[end..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_snake_case_with_a_doc_and_an_error_status() {
        let mut seen = std::collections::HashSet::new();
        for c in ErrorCode::ALL {
            assert!(seen.insert(c.as_str()), "{c} listed twice");
            assert!(c.as_str().chars().all(|ch| ch.is_ascii_lowercase() || ch == '_'), "{c}");
            assert!(c.status().is_client_error() || c.status().is_server_error(), "{c}");
            assert!(!c.doc().is_empty(), "{c}");
            assert_eq!(serde_json::to_value(c).unwrap(), serde_json::Value::String(c.as_str().into()));
        }
        assert_eq!(ErrorCode::RateLimited.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(ErrorCode::NoStore.status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    /// `STEMQ_WRITE_WORDS=1 cargo test -p stemq-ingress error_code` rewrites the table.
    #[test]
    fn the_pages_words_are_generated_from_the_codes() {
        let expected = with_table(WORDS_JS, &words_table()).expect("web/words.js has the ErrorCode markers");
        if std::env::var_os("STEMQ_WRITE_WORDS").is_some() {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("web/words.js");
            std::fs::write(path, &expected).unwrap();
            return;
        }
        assert!(
            expected == WORDS_JS,
            "web/words.js is stale: run `STEMQ_WRITE_WORDS=1 cargo test -p stemq-ingress error_code` and commit"
        );
    }

    #[test]
    fn the_docs_table_lists_every_code_with_its_status() {
        let docs = include_str!("../../../docs/api.md");
        for c in ErrorCode::ALL {
            let status = c.status().as_u16();
            let row = docs.lines().find(|l| l.starts_with(&format!("| {status} |")) && l.contains(&format!("`{c}`")));
            assert!(row.is_some(), "docs/api.md: no row `| {status} | ... `{c}` ...` in the error table");
        }
    }
}
