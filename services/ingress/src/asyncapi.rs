//! The NATS side's AsyncAPI document as the ingress serves it (`/asyncapi.json`) and
//! `schemas/asyncapi.json` holds it: [`stemq_nats::asyncapi`]'s document with the
//! submit endpoint's reply typed by the ingress's own answers.
//!
//! The reply of `stemq.api.submit` is either the HTTP answer of a submit
//! ([`SubmitResponse`]) or the HTTP error body ([`ErrorBody`]), each with the status the
//! same request gets over HTTP (`http_status`); the errors are those of
//! [`crate::nats_api::ERRORS`].

use schemars::generate::SchemaGenerator;
use serde_json::{json, Value};

use crate::nats_api::ERRORS;
use crate::submit::SubmitResponse;
use crate::ErrorBody;

/// The reply schema of `stemq.api.submit`, in `g`'s definitions.
pub(crate) fn submit_reply(g: &mut SchemaGenerator) -> Value {
    let answer = g.subschema_for::<SubmitResponse>().to_value();
    let error = g.subschema_for::<ErrorBody>().to_value();
    let mut statuses: Vec<u16> = ERRORS.iter().map(|c| c.status().as_u16()).collect();
    statuses.sort_unstable();
    statuses.dedup();
    let codes: Vec<&str> = ERRORS.iter().map(|c| c.as_str()).collect();
    json!({
        "oneOf": [
            {
                "title": "accepted",
                "description": "The job: 202 when this request queued it, 200 when it existed (`cached`).",
                "allOf": [answer],
                "type": "object",
                "required": ["http_status"],
                "properties": {"http_status": {"type": "integer", "enum": [200, 202]}},
            },
            {
                "title": "refused",
                "description": "Nothing was queued: the error the same request gets over HTTP.",
                "allOf": [error],
                "type": "object",
                "required": ["http_status"],
                "properties": {
                    "http_status": {"type": "integer", "enum": statuses},
                    "error": {"type": "object", "properties": {"code": {"type": "string", "enum": codes}}},
                    "retry_after": {
                        "type": "integer", "minimum": 0,
                        "description": "Seconds to wait before asking again (429 and 503), as HTTP's `Retry-After`.",
                    },
                },
            },
        ],
    })
}

/// The document.
pub fn document() -> Value {
    stemq_nats::asyncapi::document(submit_reply)
}

/// The document as checked in (`schemas/asyncapi.json`).
pub fn render() -> String {
    stemq_nats::asyncapi::render(submit_reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checked_in_document_is_current() {
        let text = render();
        assert!(
            stemq_core::schema::checked_in("asyncapi.json", &text) == text,
            "schemas/asyncapi.json is stale: run `STEMQ_WRITE_SCHEMAS=1 cargo test -p stemq-ingress asyncapi` and commit"
        );
    }

    /// The reply names the answer and the error schemas, and they are in the document.
    #[test]
    fn the_submit_reply_is_the_http_answer_or_error() {
        let doc = document();
        let reply = &doc["channels"]["submitReply"]["messages"]["submit.reply"]["payload"];
        let text = reply.to_string();
        for name in ["SubmitResponse", "Error"] {
            assert!(text.contains(&format!("#/components/schemas/{name}\"")), "{name} missing from {reply}");
            assert!(doc["components"]["schemas"][name].is_object(), "{name} is not in the document");
        }
        let refused = &reply["oneOf"][1]["properties"]["http_status"]["enum"];
        for s in [401, 403, 422, 429, 503] {
            assert!(refused.as_array().unwrap().contains(&json!(s)), "{s} missing from {refused}");
        }
    }
}
