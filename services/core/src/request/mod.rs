//! The job request: what a client asks for, how it is validated, and how the job id is
//! derived from it.
//!
//! This module owns the *identity* of a job. The job id is the lowercase hex SHA-256 of
//! the RFC 8785 (JCS) canonical JSON of the [`NormalizedRequest`]: every default filled
//! in, `webhook`, `metadata`, the `priority` lane and the deadlines (`start_before`,
//! `max_runtime`) left out
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
//! | [`canonical`] | the RFC 8785 canonical JSON writer the ids hash |

pub mod canonical;
mod error;
mod id;
mod job;
mod options;

pub use error::RequestError;
pub use id::JobId;
pub use job::{request_json, JobRequest, NormalizedRequest, Webhook};
pub use options::{
    ClipMode, Encoding, Model, OtherMethod, OutputFormat, Priority, DEFAULT_MP3_BITRATE, DEFAULT_MP3_PRESET,
    MP3_BITRATES, MP3_PRESETS,
};

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

/// The owner as one token that is safe everywhere an owner names something: a NATS
/// subject token (`stemq.jobs.<id>.requested.<token>`, which a `publisher` user's
/// permissions bind to its owner), a KV key (`stemq_webhooks`) and a file name (its
/// credentials). An owner of ASCII letters, digits, `-`, `_` and `=` (at most 64 bytes)
/// is its own token; any other owner is `h-` and the hex SHA-256 of its bytes. An owner
/// that itself starts with `h-` is hashed too, so no owner can take another's hashed
/// token as its plain name.
pub fn owner_token(owner: &str) -> String {
    use sha2::{Digest, Sha256};
    let plain = !owner.is_empty()
        && owner.len() <= 64
        && !owner.starts_with("h-")
        && owner.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_=".contains(&b));
    if plain {
        owner.to_string()
    } else {
        format!("h-{}", hex::encode(Sha256::digest(owner.as_bytes())))
    }
}

#[cfg(test)]
mod owner_token_tests {
    use super::owner_token;

    #[test]
    fn plain_owners_are_their_own_token_and_others_are_hashed() {
        assert_eq!(owner_token("anonymous"), "anonymous");
        assert_eq!(owner_token("acme-2_x="), "acme-2_x=");
        for odd in ["a b/c", "acme.eu", "a*", "a>", "", "h-plain"] {
            let t = owner_token(odd);
            assert!(t.starts_with("h-") && t.len() == 66, "{odd:?} -> {t}");
        }
        // A hashed token cannot be claimed by an owner spelling it out.
        let hashed = owner_token("a b");
        assert_ne!(owner_token(&hashed), hashed);
        assert_eq!(owner_token(&"x".repeat(65)).len(), 66);
    }
}
