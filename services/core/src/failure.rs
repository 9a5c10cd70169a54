//! Failure codes: the stable, machine-readable reason of every way a job can fail.
//!
//! This module owns the list. A code is recorded in `failed.code`, `rejected.code` and
//! `dead_lettered.reason`, shown in the status view's `error.code`, and listed (with its
//! class and who records it) in `docs/events.md`; the schemas' enum is generated from
//! [`FailureCode::KNOWN`]. The JSON form is the snake_case string (`"time_limit"`).
//!
//! Readers are lenient: a code this build does not know (written by a newer worker, or
//! an engine's own) reads as [`FailureCode::Other`] with the string kept, and is written
//! back unchanged, so an unknown code never makes an event unreadable.

use std::borrow::Cow;
use std::fmt;

use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

macro_rules! failure_codes {
    ($( $(#[doc = $doc:literal])+ $variant:ident = $code:literal, )+) => {
        /// Why a job failed (or was rejected, or set aside). See the module docs.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum FailureCode {
            $( $(#[doc = $doc])+ $variant, )+
            /// A code this build does not know, kept as written.
            Other(String),
        }

        impl FailureCode {
            /// Every code this build knows, in the order of the docs' table.
            pub const KNOWN: &'static [FailureCode] = &[$(FailureCode::$variant),+];

            /// The JSON form (`"time_limit"`).
            pub fn as_str(&self) -> &str {
                match self {
                    $(FailureCode::$variant => $code,)+
                    FailureCode::Other(s) => s,
                }
            }

            /// What the code means, for people (the schema's description).
            pub fn meaning(&self) -> &'static str {
                match self {
                    $(FailureCode::$variant => concat!($($doc),+).trim_ascii(),)+
                    FailureCode::Other(_) => "a code this build does not know",
                }
            }
        }

        impl From<&str> for FailureCode {
            fn from(s: &str) -> FailureCode {
                match s {
                    $($code => FailureCode::$variant,)+
                    other => FailureCode::Other(other.to_string()),
                }
            }
        }
    };
}

failure_codes! {
    /// The input is not audio stemq can read (engine).
    InvalidAudio = "invalid_audio",
    /// The input is damaged: a corrupt frame (engine).
    CorruptAudio = "corrupt_audio",
    /// The input's codec is not supported (engine).
    UnsupportedCodec = "unsupported_codec",
    /// The input has no audio samples (engine).
    EmptyAudio = "empty_audio",
    /// The input is longer than the engine's maximum (engine).
    TooLong = "too_long",
    /// The requested stem does not exist in this engine (engine).
    InvalidStem = "invalid_stem",
    /// The engine refused an argument of the request (engine).
    InvalidArgument = "invalid_argument",
    /// The model is not installed on this worker (engine).
    ModelUnavailable = "model_unavailable",
    /// The device the worker chose is not available to the engine (engine).
    DeviceUnavailable = "device_unavailable",
    /// The fake engine's script in `metadata.fake` is invalid (fake engine).
    BadFakeScript = "bad_fake_script",
    /// The engine failed: transient when it said so, permanent for its own bugs (engine).
    EngineError = "engine_error",
    /// The process running the attempt died (isolated engines).
    EngineCrashed = "engine_crashed",
    /// The engine panicked on its thread (worker).
    EnginePanic = "engine_panic",
    /// Out of memory at every rung of the ladder (worker).
    OutOfMemory = "out_of_memory",
    /// Over the memory budget at every rung of the ladder: it never fits (worker).
    OverMemoryBudget = "over_memory_budget",
    /// The attempt ran past its time limit (worker).
    TimeLimit = "time_limit",
    /// The attempt was stopped from outside as it finished (worker).
    Cancelled = "cancelled",
    /// Local scratch space failed (worker).
    Scratch = "scratch",
    /// The object store failed (worker).
    Storage = "storage",
    /// The input URI names no object, or its URL answered 404 or 410 (worker).
    InputNotFound = "input_not_found",
    /// The input URI is outside the configured store, or an input URL (or a redirect) is
    /// refused by the address policy (worker).
    InputNotAllowed = "input_not_allowed",
    /// Fetching an input URL failed: refused with a 4xx (permanent), or a 5xx, timeout or
    /// connection error (transient) (worker).
    InputFetch = "input_fetch",
    /// The input is larger than the input size limit (worker).
    InputTooLarge = "input_too_large",
    /// The request message is not a stemq `requested` event (worker, rejected).
    InvalidEvent = "invalid_event",
    /// The request does not hash to the job id it claims (worker, rejected).
    IdMismatch = "id_mismatch",
    /// The request names another owner than the owner token of the subject it was published on (worker, rejected).
    OwnerMismatch = "owner_mismatch",
    /// The request was published on the routed subject of another model or lane than it names (worker, rejected).
    RouteMismatch = "route_mismatch",
    /// The request is invalid or not in normalised form (worker, rejected).
    InvalidRequest = "invalid_request",
    /// Transient failures on every delivery (worker, dead-letter handler).
    MaxDeliveries = "max_deliveries",
    /// Every delivery ended without a word: the job kills its worker (dead-letter handler).
    CrashLoop = "crash_loop",
    /// The owner's available credits cannot pay the job (worker, before the engine starts).
    InsufficientCredits = "insufficient_credits",
    /// The credits ledger could not be read or written (worker; retried).
    CreditsUnavailable = "credits_unavailable",
    /// The job was not started before its `start_before` (projector; the view's code only).
    Expired = "expired",
}

impl fmt::Display for FailureCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<String> for FailureCode {
    fn from(s: String) -> FailureCode {
        match FailureCode::from(s.as_str()) {
            FailureCode::Other(_) => FailureCode::Other(s),
            known => known,
        }
    }
}

impl PartialEq<str> for FailureCode {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for FailureCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl Serialize for FailureCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for FailureCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<FailureCode, D::Error> {
        Ok(FailureCode::from(String::deserialize(d)?))
    }
}

impl JsonSchema for FailureCode {
    fn schema_name() -> Cow<'static, str> {
        "FailureCode".into()
    }

    /// The known codes, one `const` each with its meaning. Readers accept other strings
    /// too (see the module docs); writers use only these.
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let one_of: Vec<serde_json::Value> = FailureCode::KNOWN
            .iter()
            .map(|c| serde_json::json!({"const": c.as_str(), "description": c.meaning(), "type": "string"}))
            .collect();
        Schema::try_from(serde_json::json!({
            "description": "Why a job failed: a stable machine-readable code (see `docs/events.md`, \"Failure codes\"). \
                            Readers accept codes they do not know.",
            "oneOf": one_of,
        }))
        .expect("an object is a schema")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_each_known_code_when_written_and_read_then_it_is_the_same_snake_case_string() {
        for c in FailureCode::KNOWN {
            let json = serde_json::to_value(c).unwrap();
            assert_eq!(json, serde_json::Value::String(c.as_str().to_string()));
            assert!(c.as_str().chars().all(|ch| ch.is_ascii_lowercase() || ch == '_'), "{c}");
            let back: FailureCode = serde_json::from_value(json).unwrap();
            assert_eq!(&back, c);
            assert!(!matches!(back, FailureCode::Other(_)), "{c} read back as unknown");
        }
        assert_eq!(serde_json::to_string(&FailureCode::TimeLimit).unwrap(), r#""time_limit""#);
    }

    #[test]
    fn given_an_unknown_code_when_read_then_it_is_kept_and_written_back_unchanged() {
        let c: FailureCode = serde_json::from_str(r#""gpu_on_fire""#).unwrap();
        assert_eq!(c, FailureCode::Other("gpu_on_fire".into()));
        assert_eq!(serde_json::to_string(&c).unwrap(), r#""gpu_on_fire""#);
        assert_eq!(c, "gpu_on_fire");
    }

    #[test]
    fn given_the_known_codes_then_they_are_unique_and_each_has_a_meaning() {
        let mut seen = std::collections::HashSet::new();
        for c in FailureCode::KNOWN {
            assert!(seen.insert(c.as_str()), "{c} listed twice");
            assert!(!c.meaning().is_empty() && !c.meaning().starts_with(' '), "{c}");
        }
    }

    #[test]
    fn every_code_is_in_the_docs_table() {
        let docs = include_str!("../../../docs/events.md");
        let table = docs.split("## Failure codes").nth(1).expect("docs/events.md has a `## Failure codes` section");
        for c in FailureCode::KNOWN {
            assert!(table.contains(&format!("| `{c}` |")), "docs/events.md: `{c}` is missing from the table");
        }
    }

    #[test]
    fn the_schema_lists_every_known_code() {
        let s = serde_json::to_value(schemars::schema_for!(FailureCode)).unwrap();
        let consts: Vec<&str> = s["oneOf"].as_array().unwrap().iter().map(|v| v["const"].as_str().unwrap()).collect();
        let known: Vec<&str> = FailureCode::KNOWN.iter().map(FailureCode::as_str).collect();
        assert_eq!(consts, known);
    }
}
