//! JSON Schemas of the contracts, generated from the Rust types.
//!
//! This module owns `schemas/`: [`all`] produces every schema; a test fails when the
//! checked-in files differ (regenerate with `stemq schemas --write` or
//! `STEMQ_WRITE_SCHEMAS=1 cargo test -p stemq-core schema`).

use schemars::{schema_for, JsonSchema};
use serde_json::Value;

use crate::batch::{BatchEvent, BatchRequest, BatchSubmitted, BatchView};
use crate::event::{
    CancelRequested, Cancelled, DeadLettered, DeliveryAttempted, DeliveryReplayRequested, Event, Expired, Failed,
    Progress, Rejected, Requested, Retried, Started, Succeeded, WebhookBody,
};
use crate::request::JobRequest;
use crate::view::JobView;

/// The schema of `T`, its definitions under `$defs`.
pub fn one<T: JsonSchema>() -> Value {
    serde_json::to_value(schema_for!(T)).expect("schemas serialise")
}

/// Every schema as (file name, schema).
pub fn all() -> Vec<(&'static str, Value)> {
    vec![
        ("job-request.json", one::<JobRequest>()),
        ("job-view.json", one::<JobView>()),
        ("event.json", one::<Event>()),
        ("event-requested.v1.json", one::<Requested>()),
        ("event-started.v1.json", one::<Started>()),
        ("event-progress.v1.json", one::<Progress>()),
        ("event-succeeded.v1.json", one::<Succeeded>()),
        ("event-failed.v1.json", one::<Failed>()),
        ("event-dead_lettered.v1.json", one::<DeadLettered>()),
        ("event-rejected.v1.json", one::<Rejected>()),
        ("event-retried.v1.json", one::<Retried>()),
        ("event-cancel_requested.v1.json", one::<CancelRequested>()),
        ("event-cancelled.v1.json", one::<Cancelled>()),
        ("event-expired.v1.json", one::<Expired>()),
        ("event-delivery_attempted.v1.json", one::<DeliveryAttempted>()),
        ("event-delivery_replay_requested.v1.json", one::<DeliveryReplayRequested>()),
        ("batch-request.json", one::<BatchRequest>()),
        ("batch-view.json", one::<BatchView>()),
        ("batch-event.json", one::<BatchEvent>()),
        ("batch-event-submitted.v1.json", one::<BatchSubmitted>()),
        ("webhook-job.json", one::<WebhookBody<JobView>>()),
        ("webhook-batch.json", one::<WebhookBody<BatchView>>()),
    ]
}

/// Pretty text of a schema as checked in.
pub fn render(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).expect("schemas serialise");
    s.push('\n');
    s
}

/// Writes `schemas` into `dir`.
pub fn write(dir: &std::path::Path, schemas: &[(&str, Value)]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, v) in schemas {
        std::fs::write(dir.join(name), render(v))?;
    }
    Ok(())
}

/// Writes every schema into `dir`.
pub fn write_all(dir: &std::path::Path) -> std::io::Result<()> {
    write(dir, &all())
}

/// The text of `schemas/<name>` as checked in (empty when there is none), for the tests
/// that compare it with what the code makes now, `text`; with `STEMQ_WRITE_SCHEMAS` set,
/// `text` is written there first (how those tests regenerate the folder).
pub fn checked_in(name: &str, text: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../schemas").join(name);
    if std::env::var_os("STEMQ_WRITE_SCHEMAS").is_some() {
        let _ = std::fs::write(&path, text);
    }
    std::fs::read_to_string(&path).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemas_are_current() {
        for (name, v) in all() {
            let text = render(&v);
            assert!(
                checked_in(name, &text) == text,
                "schemas/{name} is stale: run `STEMQ_WRITE_SCHEMAS=1 cargo test -p stemq-core schema` and commit"
            );
        }
    }
}
