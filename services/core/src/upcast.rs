//! Reading old event versions: the upcaster table.
//!
//! This module owns the one place where an event written with an older `type`
//! (`io.stemq.job.<kind>.v<N>`) is turned into the current shape before it is
//! deserialised. An [`Upcaster`] rewrites the `data` of one type into the `data` of the
//! next version; [`UPCASTERS`] lists them all, and [`crate::Event::from_slice`] walks
//! the chain for a type (`v0 → v1 → v2`, one step at a time) until no upcaster starts
//! at the type reached, then reads the current struct.
//!
//! The common path pays nothing: [`crate::Event::from_slice`] parses the current shape
//! directly and only on failure reads the envelope generically to look for an
//! upcaster. An event whose type has no upcaster fails with the direct parse's error.
//!
//! When a type changes incompatibly: the Rust type takes the new name (`.v2`), and an
//! upcaster from the old name (`.v1`) is added here with a test that reads a stored
//! old event. The table is empty today: no older version was ever written.

use serde_json::{Map, Value};

/// One step from an older event version to the next.
#[derive(Debug, Clone, Copy)]
pub struct Upcaster {
    /// The older CloudEvents `type`, e.g. `io.stemq.job.started.v1`.
    pub from: &'static str,
    /// The type it becomes, e.g. `io.stemq.job.started.v2` (same kind, a later version).
    pub to: &'static str,
    /// Rewrites the old `data` into the new `data`; the error says what was missing.
    pub upcast: fn(Value) -> Result<Value, String>,
}

/// Every upcaster in production; [`crate::Event::from_slice`] reads through it.
pub const UPCASTERS: &[Upcaster] = &[];

/// Why an old event could not be brought to the current shape.
#[derive(Debug, thiserror::Error)]
pub enum UpcastError {
    /// The body is not a JSON object with a string `type`.
    #[error("the event is not a JSON object with a `type`")]
    NotAnEvent(#[source] Option<serde_json::Error>),
    /// An upcaster refused the old `data`.
    #[error("cannot upcast {from} to {to}: {message}")]
    Step {
        /// The type being upcast.
        from: &'static str,
        /// The type it was to become.
        to: &'static str,
        /// The upcaster's reason.
        message: String,
    },
    /// The table loops (a bug in the table, caught by its test).
    #[error("the upcasters of {0} form a loop")]
    Loop(String),
}

/// Brings the JSON of an event of an older type to the current type with `table`.
/// `Ok(None)` when no upcaster starts at its type (nothing to do here; the caller's
/// own error stands).
pub fn upcast(body: &[u8], table: &[Upcaster]) -> Result<Option<Value>, UpcastError> {
    let mut event: Map<String, Value> = match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return Err(UpcastError::NotAnEvent(None)),
        Err(e) => return Err(UpcastError::NotAnEvent(Some(e))),
    };
    let Some(Value::String(original)) = event.get("type") else {
        return Err(UpcastError::NotAnEvent(None));
    };
    let original = original.clone();
    let Some(mut step) = next(table, &original) else {
        return Ok(None);
    };
    let mut data = event.remove("data").unwrap_or(Value::Null);
    // Each step moves to a later version, so a chain is at most the table long.
    for _ in 0..=table.len() {
        data = (step.upcast)(data).map_err(|message| UpcastError::Step { from: step.from, to: step.to, message })?;
        match next(table, step.to) {
            Some(s) => step = s,
            None => {
                event.insert("type".into(), Value::String(step.to.to_string()));
                event.insert("data".into(), data);
                return Ok(Some(Value::Object(event)));
            }
        }
    }
    Err(UpcastError::Loop(original))
}

fn next<'t>(table: &'t [Upcaster], ty: &str) -> Option<&'t Upcaster> {
    table.iter().find(|u| u.from == ty)
}

/// `(kind, version)` of `io.stemq.job.<kind>.v<N>`.
fn version(ty: &str) -> Option<(&str, u32)> {
    let (kind, v) = ty.rsplit_once(".v")?;
    Some((kind, v.parse().ok()?))
}

/// Checks a table: each step stays within one kind and moves to a later version (so
/// chains end), and no type has two upcasters.
pub fn check_table(table: &[Upcaster]) -> Result<(), String> {
    for (i, u) in table.iter().enumerate() {
        match (version(u.from), version(u.to)) {
            (Some((fk, fv)), Some((tk, tv))) if fk == tk && tv > fv => {}
            _ => return Err(format!("{} -> {}: not a later version of the same kind", u.from, u.to)),
        }
        if table[..i].iter().any(|o| o.from == u.from) {
            return Err(format!("two upcasters start at {}", u.from));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, EventBody, Started};
    use serde_json::json;

    const JOB: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    /// A synthetic history of `started`: v0 had no `device` (v1, the current one,
    /// added it; v0 workers only ran on the CPU).
    fn started_v0_to_v1(mut data: Value) -> Result<Value, String> {
        let m = data.as_object_mut().ok_or("`data` is not an object")?;
        if !m.contains_key("worker") {
            return Err("no `worker`".into());
        }
        m.insert("device".into(), json!("cpu"));
        Ok(data)
    }
    /// A synthetic future step: v2 calls the worker `host`.
    fn started_v1_to_v2(mut data: Value) -> Result<Value, String> {
        let worker = data.as_object_mut().and_then(|m| m.remove("worker")).ok_or("no `worker`")?;
        data["host"] = worker;
        Ok(data)
    }
    const TEST_TABLE: &[Upcaster] =
        &[Upcaster { from: "io.stemq.job.started.v0", to: "io.stemq.job.started.v1", upcast: started_v0_to_v1 }];

    fn envelope(ty: &str, data: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "specversion": "1.0", "id": "e1", "source": "/stemq/worker/w", "subject": JOB,
            "time": "2026-01-02T03:04:05Z", "datacontenttype": "application/json",
            "type": ty, "data": data,
        }))
        .unwrap()
    }

    fn started(e: &Event) -> &Started {
        match &e.body {
            EventBody::Started(s) => s,
            other => panic!("not started: {other:?}"),
        }
    }

    #[test]
    fn an_old_version_is_read_through_the_chain() {
        let v0 = envelope("io.stemq.job.started.v0", json!({"attempt": 2, "worker": "w0"}));
        let e = Event::read(&v0, TEST_TABLE).unwrap();
        assert_eq!(started(&e), &Started { attempt: 2, worker: "w0".into(), device: "cpu".into() });
        assert_eq!(e.event_type(), "io.stemq.job.started.v1");
        assert_eq!(e.id, "e1");
        assert_eq!(e.subject.as_str(), JOB);
    }

    #[test]
    fn a_chain_runs_step_by_step_in_any_table_order() {
        let table = [
            Upcaster { from: "io.stemq.job.started.v1", to: "io.stemq.job.started.v2", upcast: started_v1_to_v2 },
            TEST_TABLE[0],
        ];
        check_table(&table).unwrap();
        let v0 = envelope("io.stemq.job.started.v0", json!({"attempt": 3, "worker": "h"}));
        let v2 = upcast(&v0, &table).unwrap().expect("v0 has an upcaster");
        assert_eq!(v2["type"], "io.stemq.job.started.v2");
        assert_eq!(v2["data"], json!({"attempt": 3, "host": "h", "device": "cpu"}));
        assert_eq!(v2["id"], "e1");
        // a type with no upcaster is left to the caller
        let v2_body = serde_json::to_vec(&v2).unwrap();
        assert!(upcast(&v2_body, &table).unwrap().is_none());
    }

    #[test]
    fn without_an_upcaster_an_old_version_is_refused() {
        let v0 = envelope("io.stemq.job.started.v0", json!({"attempt": 2, "worker": "w0"}));
        let err = Event::from_slice(&v0).unwrap_err();
        assert!(err.to_string().contains("io.stemq.job.started.v0"), "{err}");
        let unknown = envelope("io.stemq.job.exploded.v1", json!({}));
        assert!(Event::read(&unknown, TEST_TABLE).is_err());
    }

    #[test]
    fn a_refused_step_says_which() {
        let bad = envelope("io.stemq.job.started.v0", json!({"attempt": 1}));
        let err = Event::read(&bad, TEST_TABLE).unwrap_err().to_string();
        assert!(err.contains("io.stemq.job.started.v0") && err.contains("no `worker`"), "{err}");
    }

    #[test]
    fn current_events_never_reach_the_table() {
        fn boom(_: Value) -> Result<Value, String> {
            panic!("a current event went through an upcaster")
        }
        let trap = [Upcaster { from: "io.stemq.job.started.v1", to: "io.stemq.job.started.v2", upcast: boom }];
        let v1 = envelope("io.stemq.job.started.v1", json!({"attempt": 1, "worker": "w", "device": "cpu"}));
        let e = Event::read(&v1, &trap).unwrap();
        assert_eq!(started(&e).device, "cpu");
    }

    #[test]
    fn tables_are_checked() {
        check_table(UPCASTERS).unwrap();
        check_table(TEST_TABLE).unwrap();
        fn id(v: Value) -> Result<Value, String> {
            Ok(v)
        }
        let back = [Upcaster { from: "io.stemq.job.started.v1", to: "io.stemq.job.started.v0", upcast: id }];
        assert!(check_table(&back).is_err());
        let other_kind = [Upcaster { from: "io.stemq.job.started.v0", to: "io.stemq.job.failed.v1", upcast: id }];
        assert!(check_table(&other_kind).is_err());
        let twice = [TEST_TABLE[0], TEST_TABLE[0]];
        assert!(check_table(&twice).is_err());
        // a loop that slipped past the check is still caught when reading
        let looped = [
            Upcaster { from: "io.stemq.job.started.v7", to: "io.stemq.job.started.v8", upcast: id },
            Upcaster { from: "io.stemq.job.started.v8", to: "io.stemq.job.started.v7", upcast: id },
        ];
        let v7 = envelope("io.stemq.job.started.v7", json!({}));
        assert!(matches!(upcast(&v7, &looped), Err(UpcastError::Loop(_))));
    }
}
