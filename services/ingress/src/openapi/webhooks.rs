//! The `webhooks` section of `/openapi.json` (OpenAPI 3.1): what the relay POSTs to a
//! receiver, one entry per event type, so that code generators make receivers.
//!
//! The job event types come from [`stemq_core::event::WEBHOOK_KINDS`] (the table the
//! relay decides by), the batch's end from its event type; each body is the schema of
//! [`WebhookBody`] (the type the relay sends) with its `type` fixed, and the headers are
//! Standard Webhooks'.

use schemars::generate::SchemaGenerator;
use serde_json::{json, Map, Value};
use stemq_core::batch::BatchView;
use stemq_core::event::{WebhookBody, WEBHOOK_KINDS};
use stemq_core::JobView;

/// The tag of the webhooks (the routes that manage them are tagged `webhooks`).
pub(super) const TAG: &str = "webhook events";

/// The batch's end, sent to a batch's `webhook`.
const BATCH_ENDED: &str = "io.stemq.batch.ended.v1";

/// The event type of a job event kind.
fn job_type(kind: &str) -> String {
    format!("io.stemq.job.{kind}.v1")
}

/// `io.stemq.job.dead_lettered.v1` → `JobDeadLettered`.
fn schema_name(event_type: &str) -> String {
    let words = event_type.trim_start_matches("io.stemq.").trim_end_matches(".v1");
    words
        .split(['.', '_'])
        .map(|w| {
            let mut c = w.chars();
            c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
        })
        .collect()
}

/// The three Standard Webhooks headers.
fn headers() -> Value {
    let header = |name: &str, description: &str, schema: Value| json!({"name": name, "in": "header", "required": true, "description": description, "schema": schema});
    json!([
        header(
            "webhook-id",
            "`msg_<event id>`: the same for every retry and replay of one delivery; de-duplicate on it",
            json!({"type": "string", "pattern": "^msg_"}),
        ),
        header(
            "webhook-timestamp",
            "When this attempt was signed, in Unix seconds; refuse one more than 5 minutes off",
            json!({"type": "string", "pattern": "^[0-9]+$"}),
        ),
        header(
            "webhook-signature",
            "`v1,<base64 HMAC-SHA256(secret, \"{webhook-id}.{webhook-timestamp}.{body}\")>`, space-separated \
             when more than one secret is active (a rotation's grace period); the secret is the owner's \
             (`GET /v1/webhooks/secret`)",
            json!({"type": "string", "pattern": "^v1,"}),
        ),
    ])
}

/// One webhook: its operation and the payload schema it names (`body`, the schema of
/// the [`WebhookBody`] it sends, with its `type` fixed).
fn webhook(event_type: &str, when: &str, body: &Value, schemas: &mut Map<String, Value>) -> Value {
    let name = format!("Webhook{}", schema_name(event_type));
    schemas.insert(
        name.clone(),
        json!({
            "description": format!("The body of a `{event_type}` webhook."),
            "allOf": [body],
            "properties": {"type": {"type": "string", "const": event_type}},
        }),
    );
    json!({"post": {
        "operationId": format!("webhook{}", schema_name(event_type)),
        "summary": format!("`{event_type}`: {when}"),
        "description": "Sent by the webhook relay to the receiver URL, signed with Standard Webhooks (docs/events.md, \
            Webhooks). A 2xx is success; timeouts, connection errors, 5xx and 429 are retried (a `Retry-After` is \
            honoured); other 4xx and 3xx are final; 410 disables the URL for the owner.",
        "tags": [TAG],
        "security": [],
        "parameters": headers(),
        "requestBody": {"required": true, "content": {"application/json": {
            "schema": {"$ref": format!("#/components/schemas/{name}")},
        }}},
        "responses": {
            "2XX": {"description": "Received; nothing more is sent for this delivery."},
            "410": {"description": "Gone: the relay sends nothing more to this URL for the owner until \
                `POST /v1/webhooks/enable` turns it on again."},
        },
    }})
}

/// When each class of job webhook is sent.
fn when(class: &str) -> &'static str {
    match class {
        "started" => "a worker started the job (the request's `webhook.events` holds `started`)",
        "progress" => "the job's progress changed by a percent or more (`webhook.events` holds `progress`)",
        _ => "the job ended (`webhook.events` holds `completed`)",
    }
}

/// The `webhooks` section, and the payload schemas it names (to merge into
/// `components/schemas`). `g` is the generator of the answers' schemas.
pub(super) fn section(g: &mut SchemaGenerator) -> (Value, Map<String, Value>) {
    let mut hooks = Map::new();
    let mut schemas = Map::new();
    let job = g.subschema_for::<WebhookBody<JobView>>().to_value();
    for (kind, class) in WEBHOOK_KINDS {
        let t = job_type(kind);
        hooks.insert(t.clone(), webhook(&t, when(class), &job, &mut schemas));
    }
    let batch = g.subschema_for::<WebhookBody<BatchView>>().to_value();
    hooks.insert(
        BATCH_ENDED.into(),
        webhook(BATCH_ENDED, "a batch ended (every job in it ended; the batch's `webhook`)", &batch, &mut schemas),
    );
    (Value::Object(hooks), schemas)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_pascal_case() {
        assert_eq!(schema_name("io.stemq.job.dead_lettered.v1"), "JobDeadLettered");
        assert_eq!(schema_name(BATCH_ENDED), "BatchEnded");
    }

    #[test]
    fn the_document_lists_every_webhook_with_its_schema_and_unique_tags() {
        let doc = crate::openapi::document();
        let hooks = doc["webhooks"].as_object().unwrap();
        assert_eq!(hooks.len(), WEBHOOK_KINDS.len() + 1);
        for (t, hook) in hooks {
            let post = &hook["post"];
            let r = post["requestBody"]["content"]["application/json"]["schema"]["$ref"].as_str().unwrap();
            let schema = &doc["components"]["schemas"][r.trim_start_matches("#/components/schemas/")];
            assert_eq!(schema["properties"]["type"]["const"], json!(t), "{t}");
            let headers: Vec<&str> =
                post["parameters"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
            assert_eq!(headers, ["webhook-id", "webhook-timestamp", "webhook-signature"]);
        }
        let tags: Vec<&str> = doc["tags"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
        let mut unique = tags.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), tags.len(), "{tags:?}");
    }

    #[test]
    fn every_job_webhook_is_an_event_type() {
        let event = serde_json::to_value(schemars::schema_for!(stemq_core::Event)).unwrap();
        let text = event.to_string();
        for (kind, _) in WEBHOOK_KINDS {
            assert!(text.contains(&format!("\"{}\"", job_type(kind))), "{kind} is not an event type");
        }
        let batch = serde_json::to_value(schemars::schema_for!(stemq_core::batch::BatchEvent)).unwrap();
        assert!(batch.to_string().contains(&format!("\"{BATCH_ENDED}\"")));
    }
}
