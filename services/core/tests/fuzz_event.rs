//! Fuzz target: event decoding (`Event::from_slice`), as every consumer of the job log
//! runs it, and the status view's fold (`apply`) on whatever decodes.
//!
//! Properties: never panics, never hangs; a decoded event serialises again and its
//! fold into an empty or an existing view does not panic.
//! Corpus: `tests/corpus/event/`. See `fuzz_harness/mod.rs` for the knobs.

#[path = "fuzz_harness/mod.rs"]
mod fuzz_harness;

use std::path::Path;

use fuzz_harness::{fuzz, Target};
use stemq_core::{apply, Event, Position};

const DICTIONARY: &[&[u8]] = &[
    b"\"type\"",
    b"\"data\"",
    b"\"subject\"",
    b"\"time\"",
    b"\"io.stemq.job.requested.v1\"",
    b"\"io.stemq.job.started.v1\"",
    b"\"io.stemq.job.progress.v1\"",
    b"\"io.stemq.job.succeeded.v1\"",
    b"\"io.stemq.job.failed.v1\"",
    b"\"io.stemq.job.dead_lettered.v1\"",
    b"\"io.stemq.job.rejected.v1\"",
    b"\"io.stemq.job.retried.v1\"",
    b"\"io.stemq.job.cancel_requested.v1\"",
    b"\"io.stemq.job.cancelled.v1\"",
    b"\"io.stemq.job.expired.v1\"",
    b"\"io.stemq.job.delivery_attempted.v1\"",
    b"\"attempt\"",
    b"\"percent\"",
    b"4294967295",
    b"4294967296",
    b"1e39",
    b"-1e39",
    b"NaN",
    b"-0.0",
    b"null",
    b"\"\\ud800\"",
    b"\"9999-12-31T23:59:59.999999999Z\"",
    b"\"-262144-01-01T00:00:00Z\"",
    b"\"2024-02-30T25:61:61Z\"",
];

#[test]
fn fuzz_event() {
    let target = Target {
        name: "event",
        corpus: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/event"),
        dictionary: DICTIONARY,
        max_len: 8 * 1024,
    };
    fuzz(target, |input| {
        let Ok(event) = Event::from_slice(input) else {
            return false;
        };
        let _ = event.to_bytes();
        let _ = event.event_type();
        let _ = event.body.is_terminal();
        for pos in [Position::Log(1), Position::Progress(1)] {
            if let Some(view) = apply(None, pos, &event) {
                let _ = apply(Some(&view), Position::Log(2), &event);
                let _ = apply(Some(&view), Position::Progress(2), &event);
            }
        }
        true
    });
}
