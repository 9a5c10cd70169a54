//! The API's answers as JSON Schemas, checked in under `schemas/` next to the contracts
//! of `stemq_core::schema` (the clients in `clients/` are generated from both): a
//! submit's answer over HTTP and its reply over NATS (the AsyncAPI document's,
//! [`crate::asyncapi`]), an upload's answer, and the error body.

use schemars::generate::SchemaSettings;
use serde_json::Value;
use stemq_core::schema::one;

use crate::submit::SubmitResponse;
use crate::uploads::UploadResponse;
use crate::ErrorBody;

/// Every schema as (file name, schema).
pub fn all() -> Vec<(&'static str, Value)> {
    vec![
        ("submit-response.json", one::<SubmitResponse>()),
        ("submit-reply.json", submit_reply()),
        ("upload-response.json", one::<UploadResponse>()),
        ("error.json", one::<ErrorBody>()),
    ]
}

/// The reply of `stemq.api.submit` as a document of its own (its definitions under `$defs`).
fn submit_reply() -> Value {
    let mut g = SchemaSettings::default().into_generator();
    let mut v = crate::asyncapi::submit_reply(&mut g);
    v["$schema"] = Value::from(g.settings().meta_schema.as_deref().unwrap_or_default());
    v["title"] = Value::from("SubmitReply");
    v["$defs"] = Value::Object(g.take_definitions(true));
    v
}

/// Writes every schema into `dir`.
pub fn write_all(dir: &std::path::Path) -> std::io::Result<()> {
    stemq_core::schema::write(dir, &all())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stemq_core::schema::{checked_in, render};

    #[test]
    fn the_checked_in_answers_are_current() {
        for (name, v) in all() {
            let text = render(&v);
            assert!(
                checked_in(name, &text) == text,
                "schemas/{name} is stale: run `STEMQ_WRITE_SCHEMAS=1 cargo test -p stemq-ingress schemas` and commit"
            );
        }
    }

    /// The reply's references resolve inside its own document.
    #[test]
    fn the_submit_reply_stands_alone() {
        let v = submit_reply();
        let text = v.to_string();
        for name in ["SubmitResponse", "Error"] {
            assert!(text.contains(&format!("\"#/$defs/{name}\"")), "{name} not referenced: {text}");
            assert!(v["$defs"][name].is_object(), "{name} not defined");
        }
    }
}
