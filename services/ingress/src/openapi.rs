//! The OpenAPI 3.1 document served at `/openapi.json`.
//!
//! This module owns the HTTP API description. Paths are written out here; the request
//! and view schemas come from the same Rust types as `schemas/` (JSON Schema 2020-12 is
//! OpenAPI 3.1's schema dialect), so they cannot drift: `Job` is [`crate::links::Job`],
//! the view with its `urls`, as every route answers a job. The `Prefer: wait=N` header
//! and its `Preference-Applied` answer ([`crate::prefer`]) are written on the two routes
//! that honour it, and the framework's refusals ([`crate::errors`]) where they occur.

use serde_json::{json, Value};

fn schema<T: schemars::JsonSchema>() -> Value {
    let mut v = serde_json::to_value(schemars::schema_for!(T)).expect("schema");
    // Component schemas refer to each other through #/components/schemas.
    let defs = v.as_object_mut().and_then(|o| o.remove("$defs")).unwrap_or(json!({}));
    let text = serde_json::to_string(&v).expect("json").replace("#/$defs/", "#/components/schemas/");
    let mut v: Value = serde_json::from_str(&text).expect("json");
    v.as_object_mut().map(|o| o.remove("$schema"));
    v["x-defs"] = defs;
    v
}

/// The document.
pub fn document() -> Value {
    let mut components = serde_json::Map::new();
    for (name, mut s) in [
        ("JobRequest", schema::<stemq_core::JobRequest>()),
        ("JobView", schema::<stemq_core::JobView>()),
        ("Job", schema::<crate::links::Job>()),
        ("JobUrls", schema::<crate::links::JobUrls>()),
        ("BatchRequest", schema::<stemq_core::batch::BatchRequest>()),
        ("BatchView", schema::<stemq_core::batch::BatchView>()),
        ("SubmitResponse", schema::<crate::submit::SubmitResponse>()),
        ("UploadResponse", schema::<crate::uploads::UploadResponse>()),
        ("DeliveryAttempted", schema::<stemq_core::event::DeliveryAttempted>()),
        ("Fleet", schema::<crate::workers::Fleet>()),
        ("Overview", schema::<crate::workers::Overview>()),
        ("Models", schema::<crate::workers::Models>()),
        ("Me", schema::<crate::session::Me>()),
        ("SigninRequest", schema::<crate::session::SigninRequest>()),
        ("SigninResponse", schema::<crate::session::SigninResponse>()),
    ] {
        if let Some(defs) = s.as_object_mut().and_then(|o| o.remove("x-defs")) {
            let text = serde_json::to_string(&defs).expect("json").replace("#/$defs/", "#/components/schemas/");
            if let Ok(Value::Object(d)) = serde_json::from_str::<Value>(&text) {
                components.extend(d);
            }
        }
        components.insert(name.to_string(), s);
    }
    components.insert(
        "Error".into(),
        json!({"type": "object", "required": ["error"], "properties": {"error": {"type": "object",
            "required": ["code", "message"], "properties": {
                "code": {"type": "string"}, "message": {"type": "string"},
                "field": {"type": "string", "description": "The offending request field (422 only)."}}}}}),
    );
    let id_param = json!({"name": "id", "in": "path", "required": true, "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}});
    let cancel_body = json!({"type": "object", "properties": {"job_id": {"type": "string"},
        "status": {"type": "string", "enum": ["cancelled", "cancelling"]},
        "outcome": {"type": "string", "enum": ["cancelled", "cancelling", "already_cancelled"]}}});
    let secret_body = json!({"type": "object", "required": ["secret"], "properties": {
        "secret": {"type": "string", "description": "`whsec_` + base64"},
        "previous": {"type": ["string", "null"], "description": "The previous secret, still signing during the grace period"},
        "previous_valid_until": {"type": ["string", "null"], "format": "date-time"},
        "disabled_urls": {"type": "array", "items": {"type": "string"}, "description": "Receivers that answered 410 Gone"}}});
    let err = |d: &str| json!({"description": d, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let ok = |d: &str, s: &str| json!({"description": d, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{s}")}}}});
    let prefer = json!({"name": "Prefer", "in": "header", "schema": {"type": "string", "examples": ["wait=30"]},
        "description": "RFC 7240. `wait=N`: answer once the job has ended, or after N seconds with its current view \
                        (N is capped at 60). Other preferences are ignored."});
    let applied = json!({"Preference-Applied": {"description": "`wait=N` (the N waited, capped at 60) when a `Prefer: wait` was honoured",
        "schema": {"type": "string"}}, "Vary": {"description": "`Prefer`", "schema": {"type": "string"}}});
    let location =
        json!({"description": "The job's absolute URL (`urls.get`)", "schema": {"type": "string", "format": "uri"}});
    let with_headers = |mut r: Value, h: &Value| {
        r["headers"] = h.clone();
        r
    };
    let submitted = |d: &str| {
        json!({"description": d, "content": {"application/json": {"schema": {"oneOf": [
            {"$ref": "#/components/schemas/SubmitResponse"}, {"$ref": "#/components/schemas/Job"}]}}}})
    };
    let mut submit_headers = applied.clone();
    submit_headers["Location"] = location.clone();
    let mut doc = json!({
        "openapi": "3.1.0",
        "info": {"title": "stemq", "version": env!("CARGO_PKG_VERSION"),
                 "description": "Music source separation as a service: submit a song, get stems. \
                    Every error answers `{\"error\": {\"code\", \"message\"}}` (the Error schema), the framework's own too: \
                    an unknown route is 404 `not_found`, a known route asked with another method 405 `method_not_allowed` \
                    (with `Allow`), a body over the limit 413 `too_large`, a path or query that does not parse 400 `bad_request`."},
        "paths": {
            "/v1/separations": {
                "post": {
                    "summary": "Submit a separation job (idempotent: the job id is the hash of the request)",
                    "description": "Without `Prefer: wait` the answer is a SubmitResponse: 202 for a new job, 200 for an \
                        existing one (`cached: true`). With `Prefer: wait=N` it is the Job (the view with its `urls`) once \
                        the job has ended (200) or, after N seconds, as it is then (202).",
                    "parameters": [prefer.clone()],
                    "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobRequest"}}}},
                    "responses": {
                        "202": with_headers(submitted("A new job was queued (SubmitResponse), or with `Prefer: wait` the job has not ended yet (Job)"), &submit_headers),
                        "200": with_headers(submitted("The same job already exists (SubmitResponse, cached: true), or with `Prefer: wait` the job has ended (Job)"), &submit_headers),
                        "413": err("The body is larger than 2 MiB"),
                        "422": err("Invalid request; `field` names the offending field"),
                        "503": err("Could not queue now; retrying is safe"),
                    }
                },
                "get": {
                    "summary": "List jobs, newest first",
                    "parameters": [
                        {"name": "status", "in": "query", "schema": {"type": "string", "enum": ["queued","running","succeeded","failed","dead_lettered","rejected","cancelled","expired"]}},
                        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 50}},
                        {"name": "cursor", "in": "query", "schema": {"type": "string"}, "description": "next_cursor of the previous page"}
                    ],
                    "responses": {
                        "200": {"description": "A page of jobs", "content": {"application/json": {"schema": {"type": "object",
                            "properties": {"jobs": {"type": "array", "items": {"$ref": "#/components/schemas/Job"}},
                                           "next_cursor": {"type": ["string", "null"]},
                                           "complete": {"type": "boolean"}}}}}},
                        "400": err("A query string that does not parse"),
                        "422": err("Invalid query; `field` names the parameter"),
                    }
                }
            },
            "/v1/separations/{id}": {
                "get": {
                    "summary": "The status view of one job, with its `urls`; `Prefer: wait=N` waits up to N seconds for its end",
                    "description": "With the read-time fields: `waiting`, and while the job is queued or running its \
                        `queue_position` (0 = next in its pool and lane) and `eta` / `eta_seconds` (when it should finish; \
                        absent when unknown). See docs/events.md, \"Queue position and ETA\".",
                    "parameters": [id_param.clone(), prefer],
                    "responses": {"200": with_headers(ok("The job (ended, or as it is once the wait is over)", "Job"), &applied), "404": err("No such job")}
                }
            },
            "/v1/separations/{id}/stems/{stem}": {
                "get": {
                    "summary": "Download one stem of a succeeded job (single-range HTTP Range supported; S3 stores redirect to a presigned URL)",
                    "parameters": [
                        {"name": "id", "in": "path", "required": true, "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
                        {"name": "stem", "in": "path", "required": true, "schema": {"type": "string"}, "description": "`vocals`, `no_vocals` (`--other-method add`), `minus_vocals` (`minus`), ..."},
                        {"name": "Range", "in": "header", "schema": {"type": "string"}, "description": "`bytes=a-b`, `bytes=a-` or `bytes=-n`"}
                    ],
                    "responses": {
                        "200": {"description": "The whole stem", "content": {"audio/wav": {}, "audio/flac": {}, "audio/mpeg": {}}},
                        "206": {"description": "The requested byte range (`Content-Range`)", "content": {"audio/wav": {}, "audio/flac": {}, "audio/mpeg": {}}},
                        "307": {"description": "Redirect to a short-lived presigned URL (S3 stores)"},
                        "404": err("No such job or stem"),
                        "409": err("The job has not succeeded"),
                        "416": {"description": "Range not satisfiable (`Content-Range: bytes */size`)"},
                        "503": err("No object store configured, or the store is unavailable"),
                    }
                }
            },
            "/v1/uploads": {
                "post": {
                    "summary": "Upload a song (streamed, content-addressed); use the returned audio_uri (`upload:<sha256>.<ext>`) in a separation request",
                    "parameters": [{"name": "filename", "in": "query", "schema": {"type": "string"},
                                    "description": "Original file name; its extension is kept (else it comes from Content-Type)"}],
                    "requestBody": {"required": true, "content": {"application/octet-stream": {}, "audio/*": {}}},
                    "responses": {
                        "201": ok("Stored", "UploadResponse"),
                        "400": err("The upload was interrupted"),
                        "413": err("Larger than the configured limit (default 1 GiB)"),
                        "422": err("Empty upload or bad file name"),
                        "503": err("No object store configured, or the store is unavailable"),
                    }
                }
            },
            "/v1/separations/{id}/cancel": {
                "post": {
                    "summary": "Cancel a job: a queued job never starts; a running job stops within about a second and keeps no outputs (status `cancelled`)",
                    "parameters": [id_param.clone()],
                    "responses": {
                        "200": {"description": "Cancelled (it was queued, or already cancelled)", "content": {"application/json": {"schema": cancel_body.clone()}}},
                        "202": {"description": "Running: its worker stops it shortly", "content": {"application/json": {"schema": cancel_body.clone()}}},
                        "404": err("No such job"),
                        "409": err("The job has already finished"),
                    }
                }
            },
            "/v1/separations/{id}/retry": {
                "post": {
                    "summary": "Re-run a failed, dead-lettered, cancelled or expired job as a new job (`retry_of` / `retried_by` link both); the old job is unchanged",
                    "parameters": [id_param.clone()],
                    "responses": {
                        "202": ok("The new job was queued", "SubmitResponse"),
                        "200": ok("This job was already retried: the same new job (cached: true)", "SubmitResponse"),
                        "404": err("No such job"),
                        "409": err("The job is not failed, dead-lettered, cancelled or expired"),
                    }
                }
            },
            "/v1/separations/{id}/events": {
                "get": {
                    "summary": "Live status as Server-Sent Events: one message per change of the status view (event `status` when the status changed, `progress` otherwise; data = Job, the view with its `urls`; id = KV revision). Running jobs send at least one message every 2 s. Ends after the terminal status.",
                    "description": "Every message carries the read-time fields of GET /v1/separations/{id} (`waiting`, \
                        `queue_position`, `eta`, `eta_seconds`). While the job is queued, the view is sent again (event \
                        `progress`, no `id`) when its `queue_position` or `eta` moves, looked at every second.",
                    "parameters": [id_param.clone(),
                        {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}, "description": "Resume: only revisions newer than this id are sent"}],
                    "responses": {
                        "200": {"description": "The event stream", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                        "404": err("No such job"),
                    }
                }
            },
            "/v1/separations/{id}/deliveries": {
                "get": {
                    "summary": "Webhook deliveries of a job and every attempt (attempt, status code, latency, result)",
                    "parameters": [id_param.clone()],
                    "responses": {
                        "200": {"description": "Deliveries, numbered from 1 in order of first attempt", "content": {"application/json": {"schema": {"type": "object",
                            "properties": {"job_id": {"type": "string"}, "deliveries": {"type": "array", "items": {"type": "object", "properties": {
                                "n": {"type": "integer"}, "webhook_id": {"type": "string"}, "event_type": {"type": "string"}, "url": {"type": "string"},
                                "result": {"type": "string", "enum": ["delivered", "retrying", "failed", "disabled"]},
                                "attempts": {"type": "array", "items": {"$ref": "#/components/schemas/DeliveryAttempted"}}}}}}}}}},
                        "404": err("No such job"),
                    }
                }
            },
            "/v1/separations/{id}/deliveries/{n}/replay": {
                "post": {
                    "summary": "Send delivery n again (same webhook-id, the job's current status view)",
                    "parameters": [id_param.clone(), {"name": "n", "in": "path", "required": true, "schema": {"type": "integer", "minimum": 1}}],
                    "responses": {"202": {"description": "Queued for the relay"}, "400": err("`n` is not a number"), "404": err("No such job or delivery")}
                }
            },
            "/v1/webhooks/secret": {
                "get": {
                    "summary": "The owner's webhook signing secret (`whsec_...`, Standard Webhooks); created on first use",
                    "responses": {"200": {"description": "The secret", "content": {"application/json": {"schema": secret_body.clone()}}}}
                }
            },
            "/v1/webhooks/secret/rotate": {
                "post": {
                    "summary": "Rotate the signing secret; during the grace period (default 24 h) deliveries carry signatures with both the new and the previous secret",
                    "responses": {"200": {"description": "The new secret", "content": {"application/json": {"schema": secret_body}}}}
                }
            },
            "/v1/webhooks/enable": {
                "post": {
                    "summary": "Deliver to a receiver URL again after a 410 Gone disabled it (the same as `stemq webhooks enable URL`)",
                    "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}}}}},
                    "responses": {
                        "200": {"description": "Enabled", "content": {"application/json": {"schema": {"type": "object", "properties": {
                            "url": {"type": "string"}, "was_disabled": {"type": "boolean"},
                            "disabled_urls": {"type": "array", "items": {"type": "string"}}}}}}},
                        "413": err("The body is larger than 2 MiB"),
                        "422": err("No `url` in the body"),
                    }
                }
            },
            "/v1/workers": {"get": {"summary": "The live workers (name, models, devices, heartbeat, free memory) and, per model's pool and lane, the jobs waiting and running (operator keys only)",
                "responses": {"200": ok("The fleet", "Fleet")}}},
            "/v1/overview": {"get": {"summary": "Job counts per status, the oldest unfinished request, the oldest queued job, projector lag, and jobs ended per minute over the last 15 minutes (operator keys only)",
                "responses": {"200": ok("The overview", "Overview")}}},
            "/v1/models": {"get": {"summary": "Every model, its stems, and whether a live worker serves it now; the output formats",
                "responses": {"200": ok("The models", "Models")}}},
            "/v1/me": {"get": {"summary": "The caller: owner, role, key id, and what the role allows",
                "responses": {"200": ok("The caller", "Me")}}},
            "/v1/signin": {"post": {"summary": "Exchange the one-time token of a sign-in link (`stemq dev` prints one) for the API key it stands for. Public; a token works once",
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SigninRequest"}}}},
                "responses": {"200": ok("The key", "SigninResponse"), "401": err("A wrong or used token"),
                              "404": err("This server has no sign-in links")}}},
            "/healthz": {"get": {"summary": "Liveness", "responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"summary": "Readiness: NATS connected and the job stream present",
                                 "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (operator keys only)", "responses": {"200": {"description": "Prometheus text format 0.0.4, or OpenMetrics 1.0.0 when the Accept header asks for application/openmetrics-text"}}}},
        },
        "components": {"schemas": components}
    });
    // Batches (a separate insert: one `json!` of every path is past the macro's recursion
    // limit).
    doc["paths"]["/v1/batches"] = json!({
        "post": {
            "summary": "Submit up to 1 000 separation requests as one batch. Items are taken in order; each gets a job (`submitted`) or its own error (`refused`: an invalid item does not stop the others). When a limit of the key (rate, jobs in flight, credits) or the queue refuses, the batch stops: the remaining items are `not_submitted` with the reason, and `Retry-After` says when to submit the same batch again, which goes on where it stopped (the batch id is the hash of the owner and the items' jobs, so the same items are the same batch; items already submitted are not submitted twice). A `webhook` is told once when the batch ends (`io.stemq.batch.ended.v1`)",
            "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/BatchRequest"}}}},
            "responses": {
                "202": ok("A new batch, or a round that queued new jobs: the batch (`Location: /v1/batches/{id}`; `Retry-After` when items were not submitted)", "BatchView"),
                "200": ok("The same batch, with nothing new to submit (or nothing submittable yet: see `stopped` and `Retry-After`)", "BatchView"),
                "422": err("Not a batch: no items, more than 1 000, unknown fields, a bad `webhook.url` (`field` says which); invalid items are refused one by one instead"),
                "503": err("The batch could not be recorded now; submitting it again is safe"),
            }
        }
    });
    doc["paths"]["/v1/batches/{id}"] = json!({
        "get": {
            "summary": "A batch: every item (its job and the job's status, its error, or why it waits for a resubmission), counts, and the batch's status (`running`, `stopped` when items wait for a resubmission and nothing runs, `ended`)",
            "parameters": [id_param.clone()],
            "responses": {"200": ok("The batch", "BatchView"), "404": err("No such batch, or another owner's")}
        }
    });
    secure(&mut doc);
    doc
}

/// The security scheme, and the answers of [`crate::access`] on every operation that
/// needs a key (the same table decides: [`crate::access::permission`]).
fn secure(doc: &mut Value) {
    doc["components"]["securitySchemes"] = json!({"bearerAuth": {
        "type": "http", "scheme": "bearer", "bearerFormat": "sk_<key id>_<secret>",
        "description": "An API key from `stemq keys create` (or `<data-dir>/admin.key` of `stemq dev`), \
                        as `Authorization: Bearer <key>`. Never in a URL: a key in the query string is refused (400)."}});
    doc["security"] = json!([{"bearerAuth": []}]);
    let err = |d: &str| json!({"description": d, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let Some(paths) = doc["paths"].as_object_mut() else { return };
    for (path, item) in paths.iter_mut() {
        let Some(ops) = item.as_object_mut() else { continue };
        for (method, op) in ops.iter_mut() {
            let Ok(m) = method.to_ascii_uppercase().parse::<axum::http::Method>() else { continue };
            let Some(needed) = crate::access::permission(&m, path) else {
                op["security"] = json!([]);
                continue;
            };
            let role = match needed {
                stemq_core::auth::Permission::Read => "any role",
                stemq_core::auth::Permission::Write => "`submit`, `admin` or `operator`",
                stemq_core::auth::Permission::WebhookAdmin => "`admin` or `operator`",
                stemq_core::auth::Permission::Operate => "`operator`",
            };
            op["x-stemq-roles"] = json!(role);
            let responses = &mut op["responses"];
            responses["401"] = err("No key, or a malformed, unknown or revoked key (`WWW-Authenticate: Bearer`)");
            responses["403"] = err(&format!("The key's role does not allow this; it needs {role}"));
            if path.starts_with("/v1/batches/") {
                responses["404"] = err("No such batch, or another owner's batch (the two are not told apart)");
            } else if path.contains("{id}") {
                responses["404"] = err("No such job, or another owner's job (the two are not told apart)");
            }
            if (method == "post" && path == "/v1/separations") || path.ends_with("/replay") {
                responses["429"] =
                    err("Over the key's rate or jobs-in-flight limit (or a delivery replayed too often); \
                    `Retry-After`, `RateLimit-Policy` and `RateLimit` say when to retry; nothing was queued");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_are_documented_with_their_links() {
        let doc = document();
        let schemas = &doc["components"]["schemas"];
        let job = &schemas["Job"];
        for field in ["job_id", "status", "outputs", "urls"] {
            assert!(job["properties"][field].is_object(), "Job lacks {field}: {job}");
        }
        let urls = serde_json::to_string(&job["properties"]["urls"]).unwrap();
        assert!(urls.contains("JobUrls"), "{urls}");
        for field in ["get", "cancel", "events", "stems"] {
            assert!(schemas["JobUrls"]["properties"][field].is_object(), "JobUrls lacks {field}");
        }
        assert!(schemas["SubmitResponse"]["properties"]["urls"].is_object());
        let one = &doc["paths"]["/v1/separations/{id}"]["get"];
        assert_eq!(
            one["responses"]["200"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/Job"
        );
        let list = &doc["paths"]["/v1/separations"]["get"]["responses"]["200"]["content"]["application/json"]["schema"];
        assert_eq!(list["properties"]["jobs"]["items"]["$ref"], "#/components/schemas/Job");
    }

    #[test]
    fn prefer_wait_is_documented_where_it_is_honoured() {
        let doc = document();
        for (path, method, answer) in [
            ("/v1/separations", "post", "202"),
            ("/v1/separations", "post", "200"),
            ("/v1/separations/{id}", "get", "200"),
        ] {
            let op = &doc["paths"][path][method];
            let params = op["parameters"].as_array().unwrap();
            assert!(params.iter().any(|p| p["name"] == "Prefer" && p["in"] == "header"), "{method} {path}");
            assert!(op["responses"][answer]["headers"]["Preference-Applied"].is_object(), "{method} {path} {answer}");
        }
        let submit = &doc["paths"]["/v1/separations"]["post"]["responses"];
        assert!(submit["202"]["headers"]["Location"].is_object());
        assert!(submit["413"].is_object(), "a body over the limit");
    }
}
