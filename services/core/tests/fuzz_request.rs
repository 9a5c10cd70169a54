//! Fuzz target: the request parser and normaliser (`JobRequest::from_slice`, then
//! `normalize` and the job id), as the ingress runs them on every body it receives.
//!
//! Properties: never panics, never hangs; an accepted request normalises for any
//! owner, its canonical JSON parses back to the same request and the same id.
//! Corpus: `tests/corpus/request/`. See `fuzz_harness/mod.rs` for the knobs.

#[path = "fuzz_harness/mod.rs"]
mod fuzz_harness;

use std::path::Path;

use fuzz_harness::{fuzz, Target};
use stemq_core::request::{JobId, JobRequest, NormalizedRequest, ANONYMOUS};

const DICTIONARY: &[&[u8]] = &[
    b"\"audio_uri\"",
    b"\"model\"",
    b"\"two_stems\"",
    b"\"other_method\"",
    b"\"output_format\"",
    b"\"encoding\"",
    b"\"clip_mode\"",
    b"\"segment\"",
    b"\"overlap\"",
    b"\"shifts\"",
    b"\"webhook\"",
    b"\"metadata\"",
    b"\"start_before\"",
    b"\"max_runtime\"",
    b"\"htdemucs_6s\"",
    b"\"dsp\"",
    b"\"vocals\"",
    b"\"minus\"",
    b"\"flac\"",
    b"\"f32\"",
    b"1e308",
    b"-0",
    b"1e-400",
    b"18446744073709551616",
    b"-1",
    b"0.9999999999999999",
    b"null",
    b"true",
    b"[]",
    b"{}",
    b"[[[[[[[[[[[[[[[[",
    b"\"\\ud800\"",
    b"\"\\u0000\"",
    b"\"file:///\"",
    b"\"s3://b/k\"",
    b"\"http://[::1]:99999/\"",
    b"\"9999-12-31T23:59:60Z\"",
    b"\"+275760-09-13T00:00:00Z\"",
    b"\"1970-01-01T00:00:00-23:59\"",
];

#[test]
fn fuzz_request() {
    let target = Target {
        name: "request",
        corpus: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/request"),
        dictionary: DICTIONARY,
        max_len: 8 * 1024,
    };
    fuzz(target, |input| {
        let Ok(req) = JobRequest::from_slice(input) else {
            return false;
        };
        for owner in [ANONYMOUS, "tenant-\u{1F3B5}", "\0"] {
            let n = req.normalize(owner).expect("an accepted request normalises for any owner");
            let id = n.job_id();
            assert!(JobId::parse(id.as_str()).is_some(), "{id}");
            let back: NormalizedRequest =
                serde_json::from_slice(&n.canonical_json()).expect("the canonical form parses back");
            assert_eq!(back, n);
            assert_eq!(back.job_id(), id);
            assert!(!n.stems().is_empty());
        }
        assert!(req.normalize("").is_err());
        true
    });
}
