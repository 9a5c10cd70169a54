//! What `/openapi.json` says of each route: its summary, parameters, body, answers
//! and examples, one function per operation of the route table ([`crate::api::routes`]).

use axum::http::Method;
use serde_json::json;
use stemq_accounts::auth::Role;
use stemq_core::batch::BatchRequest;
use stemq_core::request::{Model, OutputFormat};
use stemq_core::{JobRequest, JobStatus};

use super::examples::*;
use crate::control::{CancelOutcome, CancelResponse};
use crate::credits::{AccountView, ModelUsage};
use crate::links::Job;
use crate::openapi::{Answer, Operation};
use crate::separations::{JobList, JobPath, ListQuery, Submitted};
use crate::session::{Can, Me, SigninRequest, SigninResponse};
use crate::uploads::UploadResponse;
use crate::webhooks::{Deliveries, EnableRequest, EnableResponse, ReplayQueued, ReplayState, WebhookSecret};
use crate::workers::{Fleet, ModelInfo, Models, Overview};
use crate::ErrorCode;

/// The `Prefer` request header of the routes that honour it.
fn prefer(op: Operation) -> Operation {
    op.header(
        "Prefer",
        "RFC 7240. `wait=N`: answer once the job has ended, or after N seconds with its current view (N is \
         capped at 60). Other preferences are ignored.",
        json!({"type": "string"}),
        json!("wait=10"),
    )
}

/// `Preference-Applied` and `Vary` on an answer of a route that honours `Prefer`.
fn applied(a: Answer) -> Answer {
    a.header(
        "Preference-Applied",
        "`wait=N` (the N waited, capped at 60) when a `Prefer: wait` was honoured",
        false,
        json!({"type": "string", "pattern": "^wait=[0-9]+$"}),
    )
    .header("Vary", "`prefer`", true, json!({"type": "string"}))
}

/// `Location`, the job's URL.
fn location(a: Answer) -> Answer {
    a.header("Location", "The job's absolute URL (`urls.get`)", true, json!({"type": "string", "format": "uri"}))
}

/// The answers of a limit of the caller's key (429).
fn limited(description: &str, codes: &[ErrorCode]) -> Answer {
    Answer::error(description, codes)
        .header("Retry-After", "Seconds until the limit lets a request through", true, json!({"type": "integer"}))
        .header(
            "RateLimit-Policy",
            "The limit (draft-ietf-httpapi-ratelimit-headers): `\"rate\";q=60;w=60`",
            true,
            json!({"type": "string"}),
        )
        .header("RateLimit", "What is left of it: `\"rate\";r=0;t=3`", true, json!({"type": "string"}))
}

/// The links from an answer carrying a job id at `pointer` to the routes of that job.
fn job_links(op: Operation, statuses: &[u16], pointer: &str) -> Operation {
    let id = format!("$response.body#{pointer}");
    let mut op = op;
    for &s in statuses {
        for (name, target) in [
            ("getSeparation", "getSeparation"),
            ("cancelSeparation", "cancelSeparation"),
            ("retrySeparation", "retrySeparation"),
            ("streamSeparationEvents", "streamSeparationEvents"),
            ("listDeliveries", "listDeliveries"),
        ] {
            op = op.link(s, name, target, json!({"path.id": id}), None);
        }
    }
    op
}

pub(crate) fn separations_create() -> Operation {
    let op = Operation::new(Method::POST, "/v1/separations", "createSeparation")
        .tag("separations")
        .summary("Submit a separation job (idempotent: the job id is the hash of the request)")
        .description(
            "Without `Prefer: wait` the answer is a SubmitResponse: 202 for a new job, 200 for an existing one \
             (`cached: true`). With `Prefer: wait=N` it is the Job (the view with its `urls`) once the job has \
             ended (200) or, after N seconds, as it is then (202). The `audio_uri` must name an upload of the \
             caller (`POST /v1/uploads`) or an object in the store; one that does not exist is 422.",
        );
    let op = prefer(op)
        .json_body::<JobRequest, 2>([
            ("dsp", "An upload, separated by the built-in engine", request()),
            (
                "two_stems",
                "Vocals and the rest, as FLAC, in the batch lane",
                serde_json::from_value(json!({"audio_uri": upload_uri(), "model": "htdemucs", "two_stems": "vocals",
                    "output_format": "flac", "priority": "batch"}))
                .expect("an example request"),
            ),
        ])
        .answer(
            202,
            location(applied(Answer::json_examples::<Submitted, 2>(
                "A new job was queued (SubmitResponse), or with `Prefer: wait` the job has not ended yet (Job)",
                [
                    ("queued", "A new job", Submitted::Queued(submitted(false, JobStatus::Queued))),
                    (
                        "waited",
                        "With `Prefer: wait=N`: still running after N s",
                        Submitted::Job(Box::new(job(JobStatus::Running))),
                    ),
                ],
            ))),
        )
        .answer(
            200,
            location(applied(Answer::json_examples::<Submitted, 2>(
                "The same job already exists (SubmitResponse, `cached: true`), or with `Prefer: wait` the job has \
                 ended (Job)",
                [
                    ("cached", "The job existed", Submitted::Queued(submitted(true, JobStatus::Succeeded))),
                    (
                        "ended",
                        "With `Prefer: wait=N`: it ended within N s",
                        Submitted::Job(Box::new(job(JobStatus::Succeeded))),
                    ),
                ],
            ))),
        )
        .answer(
            402,
            Answer::error(
                "The owner's credits cannot pay the job (where credits are on and the upload's length is known); \
                 nothing was queued",
                &[ErrorCode::InsufficientCredits],
            ),
        )
        .answer(
            422,
            Answer::invalid(
                "Invalid request, an `audio_uri` that names no upload of the caller, or a model no worker serves \
                 (`stemq dev`); `field` names the offending field",
                &[ErrorCode::InvalidRequest, ErrorCode::ModelNotServed],
                "audio_uri",
                "invalid `audio_uri`: must not be empty",
            ),
        )
        .answer(
            429,
            limited(
                "Over the key's rate or jobs-in-flight limit; nothing was queued",
                &[ErrorCode::RateLimited, ErrorCode::TooManyInFlight],
            ),
        );
    job_links(op, &[200, 202], "/job_id")
}

pub(crate) fn separations_list() -> Operation {
    let page = JobList {
        jobs: vec![job(JobStatus::Succeeded)],
        next_cursor: Some(format!("1767607200000000000.{EXAMPLE_ID}")),
        complete: true,
    };
    let op = Operation::new(Method::GET, "/v1/separations", "listSeparations")
        .tag("separations")
        .summary("List jobs, newest first (the caller's own; every owner's for operator keys)")
        .query::<ListQuery>(json!({"status": "succeeded", "limit": 20}))
        .answer(200, Answer::json("A page of jobs", page))
        .answer(
            422,
            Answer::invalid(
                "Invalid query; `field` names the parameter",
                &[ErrorCode::InvalidRequest],
                "limit",
                "`lots` is not a number between 1 and 1000",
            ),
        );
    job_links(op, &[200], "/jobs/0/job_id").link(
        200,
        "getStem",
        "getStem",
        json!({"path.id": "$response.body#/jobs/0/job_id", "path.stem": "$response.body#/jobs/0/outputs/0/stem"}),
        None,
    )
}

pub(crate) fn separations_get() -> Operation {
    let op = Operation::new(Method::GET, "/v1/separations/{id}", "getSeparation")
        .tag("separations")
        .summary("The status view of one job, with its `urls`; `Prefer: wait=N` waits up to N seconds for its end")
        .description(
            "With the read-time fields: `waiting`, and while the job is queued or running its `queue_position` \
             (0 = next in its pool and lane) and `eta` / `eta_seconds` (when it should finish; absent when \
             unknown). See docs/events.md, \"Queue position and ETA\".",
        )
        .path_params::<JobPath>(json!({"id": EXAMPLE_ID}));
    prefer(op)
        .answer(
            200,
            applied(Answer::json_examples::<Job, 3>(
                "The job (ended, or as it is once the wait is over)",
                [
                    ("queued", "Queued, next in its lane", job(JobStatus::Queued)),
                    ("running", "Running", job(JobStatus::Running)),
                    ("succeeded", "Succeeded, with its stems' links", job(JobStatus::Succeeded)),
                ],
            )),
        )
        .link(
            200,
            "getStem",
            "getStem",
            json!({"path.id": "$response.body#/job_id", "path.stem": "$response.body#/outputs/0/stem"}),
            None,
        )
}

pub(crate) fn separations_cancel() -> Operation {
    let (_, queued) = CancelResponse::of(id(EXAMPLE_ID), CancelOutcome::Cancelled);
    let (_, again) = CancelResponse::of(id(EXAMPLE_ID), CancelOutcome::AlreadyCancelled);
    let (_, running) = CancelResponse::of(id(EXAMPLE_ID), CancelOutcome::Cancelling);
    Operation::new(Method::POST, "/v1/separations/{id}/cancel", "cancelSeparation")
        .tag("separations")
        .summary(
            "Cancel a job: a queued job never starts; a running job stops within about a second and keeps no \
             outputs (status `cancelled`)",
        )
        .path_params::<JobPath>(json!({"id": EXAMPLE_ID}))
        .answer(
            200,
            Answer::json_examples::<CancelResponse, 2>(
                "Cancelled: it was queued (`outcome: cancelled`), or had been cancelled already \
                 (`already_cancelled`)",
                [("queued", "It was queued", queued), ("again", "It was cancelled already", again)],
            ),
        )
        .answer(
            202,
            Answer::json::<CancelResponse>(
                "Running: its worker stops it shortly (`status` and `outcome`: `cancelling`)",
                running,
            ),
        )
        .answer(409, Answer::error("The job has already ended otherwise", &[ErrorCode::Conflict]))
        .link(200, "getSeparation", "getSeparation", json!({"path.id": "$response.body#/job_id"}), None)
        .link(202, "getSeparation", "getSeparation", json!({"path.id": "$response.body#/job_id"}), None)
}

pub(crate) fn separations_retry() -> Operation {
    let op = Operation::new(Method::POST, "/v1/separations/{id}/retry", "retrySeparation")
        .tag("separations")
        .summary(
            "Re-run a failed, dead-lettered, cancelled or expired job as a new job (`retry_of` / `retried_by` \
             link both); the old job is unchanged",
        )
        .path_params::<JobPath>(json!({"id": EXAMPLE_ID}))
        .answer(202, Answer::json("The new job was queued", retried(false)))
        .answer(200, Answer::json("This job was already retried: the same new job (`cached: true`)", retried(true)))
        .answer(
            409,
            Answer::error("The job is not failed, dead-lettered, cancelled or expired", &[ErrorCode::Conflict]),
        );
    op.link(200, "getSeparation", "getSeparation", json!({"path.id": "$response.body#/job_id"}), None).link(
        202,
        "getSeparation",
        "getSeparation",
        json!({"path.id": "$response.body#/job_id"}),
        None,
    )
}

pub(crate) fn separations_events() -> Operation {
    let data = serde_json::to_string(&job(JobStatus::Running)).expect("json");
    Operation::new(Method::GET, "/v1/separations/{id}/events", "streamSeparationEvents")
        .tag("separations")
        .summary(
            "Live status as Server-Sent Events: one message per change of the status view (event `status` when \
             the status changed, `progress` otherwise; data = Job, the view with its `urls`; id = KV revision). \
             Running jobs send at least one message every 2 s. Ends after the terminal status.",
        )
        .description(
            "Every message carries the read-time fields of GET /v1/separations/{id} (`waiting`, \
             `queue_position`, `eta`, `eta_seconds`). While the job is queued, the view is sent again (event \
             `progress`, no `id`) when its `queue_position` or `eta` moves, looked at every second.",
        )
        .path_params::<JobPath>(json!({"id": EXAMPLE_ID}))
        .header(
            "Last-Event-ID",
            "Resume: only revisions newer than this id are sent",
            json!({"type": "string"}),
            json!("3"),
        )
        .answer(
            200,
            Answer::events::<Job>(
                format!(
                    "The event stream (the schema is one event's: `data` is a Job), for example:\n\n```\nid: 3\n\
                     event: progress\ndata: {data}\n```"
                ),
                &["status", "progress"],
            ),
        )
}

pub(crate) fn batches_create() -> Operation {
    let items = vec![
        serde_json::to_value(request()).expect("json"),
        json!({"audio_uri": upload_uri(), "model": "htdemucs", "two_stems": "guitar"}),
    ];
    let body: BatchRequest = serde_json::from_value(json!({"items": items})).expect("an example batch request");
    let answer = |a: Answer| {
        a.header("Location", "The batch's path", true, json!({"type": "string", "format": "uri-reference"})).header(
            "Retry-After",
            "When items were not submitted: seconds until submitting the same batch again can go on",
            false,
            json!({"type": "integer"}),
        )
    };
    Operation::new(Method::POST, "/v1/batches", "createBatch")
        .tag("batches")
        .summary("Submit up to 1 000 separation requests as one batch")
        .description(
            "Items are taken in order; each gets a job (`submitted`) or its own error (`refused`: an invalid item \
             does not stop the others, so an item that is not a valid request is answered in the batch, not with \
             a 422). When a limit of the key (rate, jobs in flight, credits) or the queue refuses, the batch \
             stops: the remaining items are `not_submitted` with the reason, and `Retry-After` says when to submit \
             the same batch again, which goes on where it stopped (the batch id is the hash of the owner and the \
             items' jobs, so the same items are the same batch; items already submitted are not submitted twice). \
             A `webhook` (a public https URL) is told once when the batch ends (`io.stemq.batch.ended.v1`).",
        )
        .json_body::<BatchRequest, 1>([("two", "Two songs, the second refused (no guitar in htdemucs)", body)])
        .answer(
            202,
            answer(Answer::json(
                "A new batch, or a round that queued new jobs: the batch (`Retry-After` when items were not \
                 submitted)",
                batch(),
            )),
        )
        .answer(
            200,
            answer(Answer::json(
                "The same batch, with nothing new to submit (or nothing submittable yet: see `stopped` and \
                 `Retry-After`)",
                batch(),
            )),
        )
        .answer(
            422,
            Answer::invalid(
                "Not a batch: no items, more than 1 000, unknown fields, `metadata` not an object, a `webhook.url` \
                 that is not a public https URL (`field` says which); invalid items are refused one by one instead",
                &[ErrorCode::InvalidRequest],
                "items",
                "holds no item; a batch has 1 to 1000",
            ),
        )
        .link(202, "getBatch", "getBatch", json!({"path.id": "$response.body#/batch_id"}), None)
        .link(200, "getBatch", "getBatch", json!({"path.id": "$response.body#/batch_id"}), None)
        .link(202, "getSeparation", "getSeparation", json!({"path.id": "$response.body#/items/0/job_id"}), None)
}

pub(crate) fn batches_get() -> Operation {
    Operation::new(Method::GET, "/v1/batches/{id}", "getBatch")
        .tag("batches")
        .summary(
            "A batch: every item (its job and the job's status, its error, or why it waits for a resubmission), \
             counts, and the batch's status (`running`, `stopped` when items wait for a resubmission and nothing \
             runs, `ended`)",
        )
        .path_params::<crate::batches::BatchPath>(json!({"id": EXAMPLE_RETRY_ID}))
        .answer(200, Answer::json("The batch", batch()))
        .answer(
            404,
            Answer::error(
                "No such batch, or another owner's batch (the two are not told apart)",
                &[ErrorCode::NotFound],
            ),
        )
        .link(200, "getSeparation", "getSeparation", json!({"path.id": "$response.body#/items/0/job_id"}), None)
}

pub(crate) fn stems_get() -> Operation {
    let bytes = json!({"type": "string", "contentMediaType": "application/octet-stream"});
    Operation::new(Method::GET, "/v1/separations/{id}/stems/{stem}", "getStem")
        .tag("separations")
        .summary(
            "Download one stem of a succeeded job (single-range HTTP Range supported; S3 stores redirect to a \
             presigned URL)",
        )
        .path_params::<crate::stems::StemPath>(json!({"id": EXAMPLE_ID, "stem": "vocals"}))
        .header(
            "Range",
            "`bytes=a-b`, `bytes=a-` or `bytes=-n` (anything else: the whole stem)",
            json!({"type": "string"}),
            json!("bytes=0-1023"),
        )
        .answer(
            200,
            Answer::media(
                "The whole stem",
                &["audio/wav", "audio/flac", "audio/mpeg", "application/octet-stream"],
                bytes.clone(),
            )
            .header("ETag", "The stem's SHA-256, quoted", true, json!({"type": "string"}))
            .header("Accept-Ranges", "`bytes`", true, json!({"type": "string"})),
        )
        .answer(
            206,
            Answer::media(
                "The requested byte range",
                &["audio/wav", "audio/flac", "audio/mpeg", "application/octet-stream"],
                bytes,
            )
            .header("Content-Range", "`bytes a-b/size`", true, json!({"type": "string"})),
        )
        .answer(
            307,
            Answer::empty("Redirect to a short-lived presigned URL (S3 stores)").header(
                "Location",
                "The presigned URL",
                true,
                json!({"type": "string", "format": "uri"}),
            ),
        )
        .answer(404, Answer::error("No such job or stem (another owner's job included)", &[ErrorCode::NotFound]))
        .answer(409, Answer::error("The job has not succeeded", &[ErrorCode::NotReady]))
        .answer(
            416,
            Answer::empty("Range not satisfiable").header(
                "Content-Range",
                "`bytes */size`",
                true,
                json!({"type": "string"}),
            ),
        )
        .answer(
            503,
            Answer::error(
                "No object store configured, or the store is unavailable",
                &[ErrorCode::NoStore, ErrorCode::Unavailable],
            )
            .header("Retry-After", "Seconds to wait before retrying", true, json!({"type": "integer"})),
        )
}

pub(crate) fn uploads_create() -> Operation {
    let answer = UploadResponse {
        audio_uri: upload_uri(),
        bytes: 1_764_044,
        sha256: EXAMPLE_SHA.into(),
        duration_ms: Some(10_000),
    };
    Operation::new(Method::POST, "/v1/uploads", "createUpload")
        .tag("uploads")
        .summary(
            "Upload a song (streamed, content-addressed); use the returned `audio_uri` \
             (`upload:<sha256>.<ext>`) in a separation request",
        )
        .query::<crate::uploads::UploadQuery>(json!({"filename": "song.wav"}))
        .raw_body(
            &[
                "application/octet-stream",
                "audio/wav",
                "audio/flac",
                "audio/mpeg",
                "audio/ogg",
                "audio/opus",
                "audio/mp4",
                "audio/x-m4a",
                "audio/webm",
                "audio/aiff",
                "audio/x-caf",
            ],
            json!({"type": "string", "contentMediaType": "application/octet-stream", "minLength": 1}),
        )
        .answer(201, Answer::json("Stored", answer))
        .answer(
            400,
            Answer::error(
                "The upload was interrupted, or a query that does not parse",
                &[ErrorCode::UploadInterrupted, ErrorCode::BadRequest, ErrorCode::KeyInQuery],
            ),
        )
        .answer(413, Answer::error("Larger than the configured limit (default 1 GiB)", &[ErrorCode::TooLarge]))
        .answer(
            422,
            Answer::invalid(
                "An empty upload, or a file name with no plain extension",
                &[ErrorCode::EmptyUpload, ErrorCode::InvalidRequest],
                "filename",
                "the extension of `a.?` is not a plain extension",
            ),
        )
        .answer(
            503,
            Answer::error(
                "No object store configured, or the store is unavailable",
                &[ErrorCode::NoStore, ErrorCode::Unavailable],
            )
            .header("Retry-After", "Seconds to wait before retrying", true, json!({"type": "integer"})),
        )
        .link(
            201,
            "createSeparation",
            "createSeparation",
            json!({}),
            Some(json!({"audio_uri": "$response.body#/audio_uri", "model": "dsp"})),
        )
}

pub(crate) fn deliveries_list() -> Operation {
    let example = Deliveries { job_id: id(EXAMPLE_ID), deliveries: vec![delivery()] };
    Operation::new(Method::GET, "/v1/separations/{id}/deliveries", "listDeliveries")
        .tag("webhooks")
        .summary("Webhook deliveries of a job and every attempt (attempt, status code, latency, result)")
        .path_params::<JobPath>(json!({"id": EXAMPLE_ID}))
        .answer(200, Answer::json("Deliveries, numbered from 1 in order of first attempt", example))
        .link(
            200,
            "replayDelivery",
            "replayDelivery",
            json!({"path.id": "$response.body#/job_id", "path.n": "$response.body#/deliveries/0/n"}),
            None,
        )
}

pub(crate) fn deliveries_replay() -> Operation {
    let example = ReplayQueued {
        job_id: id(EXAMPLE_ID),
        n: 1,
        webhook_id: format!("msg_{EXAMPLE_ID}_succeeded"),
        replay: ReplayState::Queued,
    };
    Operation::new(Method::POST, "/v1/separations/{id}/deliveries/{n}/replay", "replayDelivery")
        .tag("webhooks")
        .summary("Send delivery n again (same webhook-id, the job's current status view)")
        .path_params::<crate::webhooks::ReplayPath>(json!({"id": EXAMPLE_ID, "n": 1}))
        .answer(202, Answer::json("Queued for the relay", example))
        .answer(
            400,
            Answer::error(
                "`n` is not a number, or a query that does not parse",
                &[ErrorCode::BadRequest, ErrorCode::KeyInQuery],
            ),
        )
        .answer(404, Answer::error("No such job or delivery", &[ErrorCode::NotFound]))
        .answer(429, limited("This delivery was replayed too often lately", &[ErrorCode::RateLimited]))
}

pub(crate) fn webhook_secret_get() -> Operation {
    Operation::new(Method::GET, "/v1/webhooks/secret", "getWebhookSecret")
        .tag("webhooks")
        .summary("The owner's webhook signing secret (`whsec_...`, Standard Webhooks); created on first use")
        .answer(
            200,
            Answer::json(
                "The secret",
                WebhookSecret {
                    secret: SECRET.into(),
                    previous: None,
                    previous_valid_until: None,
                    disabled_urls: vec![],
                },
            ),
        )
}

pub(crate) fn webhook_secret_rotate() -> Operation {
    let rotated = WebhookSecret {
        secret: "whsec_5y7iWHoM1mVn0ypJ8Tq8KGd4vSdHsL2P".into(),
        previous: Some(SECRET.into()),
        previous_valid_until: Some(time("2026-01-06T10:00:00Z")),
        disabled_urls: vec![],
    };
    Operation::new(Method::POST, "/v1/webhooks/secret/rotate", "rotateWebhookSecret")
        .tag("webhooks")
        .summary(
            "Rotate the signing secret; during the grace period (default 24 h) deliveries carry signatures with \
             both the new and the previous secret",
        )
        .answer(200, Answer::json("The new secret", rotated))
}

pub(crate) fn webhook_enable() -> Operation {
    let url = "https://hooks.example.com/stemq".to_string();
    Operation::new(Method::POST, "/v1/webhooks/enable", "enableWebhookUrl")
        .tag("webhooks")
        .summary(
            "Deliver to a receiver URL again after a 410 Gone disabled it (the same as `stemq webhooks enable URL`)",
        )
        .json_body::<EnableRequest, 1>([("url", "A receiver", EnableRequest { url: url.clone() })])
        .answer(200, Answer::json("Enabled", EnableResponse { url, was_disabled: true, disabled_urls: Vec::new() }))
        .answer(
            422,
            Answer::invalid(
                "No `url` string in the body",
                &[ErrorCode::InvalidRequest],
                "url",
                "the body must be a JSON object with a `url` string",
            ),
        )
}

pub(crate) fn models_list() -> Operation {
    let example = Models {
        models: Model::ALL
            .iter()
            .map(|m| ModelInfo {
                name: *m,
                stems: m.sources().to_vec(),
                served: Some(*m == Model::Dsp),
                workers: usize::from(*m == Model::Dsp),
            })
            .collect(),
        output_formats: OutputFormat::ALL.iter().map(|f| f.as_str()).collect(),
    };
    Operation::new(Method::GET, "/v1/models", "listModels")
        .tag("account")
        .summary("Every model, its stems, and whether a live worker serves it now; the output formats")
        .answer(200, Answer::json("The models", example))
}

pub(crate) fn me_get() -> Operation {
    let me = Me {
        owner: "acme".into(),
        role: Role::Submit,
        key_id: "k7f3a9c2e".into(),
        can: Can { read: true, write: true, webhooks: false, operate: false },
    };
    Operation::new(Method::GET, "/v1/me", "getMe")
        .tag("account")
        .summary("The caller: owner, role, key id, and what the role allows")
        .answer(200, Answer::json("The caller", me))
}

pub(crate) fn account_get() -> Operation {
    let example = AccountView {
        owner: "acme".into(),
        credits_on: true,
        enforced: true,
        unit: "credit".into(),
        prices: [("dsp".to_string(), 0.1), ("htdemucs".to_string(), 1.0)].into(),
        balance: 95.5,
        reserved: 1.0,
        available: 94.5,
        granted: 100.0,
        charged: 4.5,
        refunded: 0.0,
        open_jobs: 1,
        from: time("2025-12-06T10:00:00Z"),
        to: time("2026-01-05T10:00:00Z"),
        usage: vec![ModelUsage {
            model: "htdemucs".into(),
            jobs: 2,
            audio_seconds: 270.0,
            engine_seconds: 61.2,
            credits: 4.5,
        }],
    };
    Operation::new(Method::GET, "/v1/account", "getAccount")
        .tag("account")
        .summary("Credits: balance, reserved, and usage per model over a period (docs/credits.md)")
        .query::<crate::credits::AccountQuery>(json!({"from": "2025-12-06T10:00:00Z"}))
        .answer(200, Answer::json("The account", example))
        .answer(
            422,
            Answer::invalid(
                "A time that is not RFC 3339, or a malformed owner",
                &[ErrorCode::InvalidRequest],
                "from",
                "`from` must be an RFC 3339 time, got `yesterday`",
            ),
        )
}

pub(crate) fn signin() -> Operation {
    Operation::new(Method::POST, "/v1/signin", "signIn")
        .tag("account")
        .summary(
            "Exchange the one-time token of a sign-in link (`stemq dev` prints one) for a new session key that \
             expires (12 h; `stemq keys list` shows it, `stemq keys revoke` ends it). Public; a token works once; \
             the answer is `Cache-Control: no-store`",
        )
        .json_body::<SigninRequest, 1>([("token", "The link's token", SigninRequest { token: "5f".repeat(32) })])
        .answer(
            200,
            Answer::json(
                "The session key",
                SigninResponse {
                    key: format!("sk_1f2e3d4c5b6a7988_{}", "0123456789abcdef".repeat(4)),
                    key_id: "1f2e3d4c5b6a7988".into(),
                    expires_at: "2026-01-05T22:00:00Z".parse().expect("a time"),
                },
            ),
        )
        .answer(
            401,
            Answer::error("A wrong or spent token (every token but the link's one, once)", &[ErrorCode::Unauthorized]),
        )
        .answer(404, Answer::error("This server has no sign-in links", &[ErrorCode::NotFound]))
}

pub(crate) fn workers_list() -> Operation {
    Operation::new(Method::GET, "/v1/workers", "listWorkers")
        .tag("operations")
        .summary(
            "The live workers (name, models, devices, heartbeat, free memory) and, per model's pool and lane, the \
             jobs waiting and running (operator keys only)",
        )
        .answer(200, Answer::json_type::<Fleet>("The fleet"))
}

pub(crate) fn overview_get() -> Operation {
    Operation::new(Method::GET, "/v1/overview", "getOverview")
        .tag("operations")
        .summary(
            "Job counts per status, the oldest unfinished request, the oldest queued job, projector lag, and jobs \
             ended per minute over the last 15 minutes (operator keys only)",
        )
        .answer(200, Answer::json_type::<Overview>("The overview"))
}

pub(crate) fn metrics_get() -> Operation {
    Operation::new(Method::GET, "/metrics", "getMetrics")
        .tag("operations")
        .summary("Prometheus metrics (operator keys only)")
        .answer(
            200,
            Answer::media(
                "Prometheus text format 0.0.4, or OpenMetrics 1.0.0 when the Accept header asks for \
                 application/openmetrics-text",
                &["text/plain", "application/openmetrics-text"],
                json!({"type": "string"}),
            ),
        )
}

pub(crate) fn health_get() -> Operation {
    Operation::new(Method::GET, "/healthz", "getHealth")
        .tag("operations")
        .summary("Liveness: the process answers")
        .answer(200, Answer::media("Alive (`ok`)", &["text/plain"], json!({"type": "string", "const": "ok"})))
}

pub(crate) fn ready_get() -> Operation {
    Operation::new(Method::GET, "/readyz", "getReadiness")
        .tag("operations")
        .summary("Readiness: NATS connected, the job stream present, the worker registry read, and (in `stemq dev`) every part started")
        .answer(200, Answer::media("Ready", &["text/plain"], json!({"type": "string"})))
        .answer(
            503,
            Answer::media("Not ready (a probe's answer, in plain text)", &["text/plain"], json!({"type": "string"})),
        )
}

pub(crate) fn openapi_get() -> Operation {
    Operation::new(Method::GET, "/openapi.json", "getOpenApi")
        .tag("operations")
        .summary("This document (OpenAPI 3.1)")
        .answer(
            200,
            Answer::media(
                "The document",
                &["application/json"],
                json!({"type": "object", "required": ["openapi", "paths"]}),
            ),
        )
}

pub(crate) fn asyncapi_get() -> Operation {
    Operation::new(Method::GET, "/asyncapi.json", "getAsyncApi")
        .tag("operations")
        .summary("The NATS side's contract (AsyncAPI 3.0): subjects, messages, headers, who may do what")
        .answer(
            200,
            Answer::media(
                "The document (also schemas/asyncapi.json)",
                &["application/json"],
                json!({"type": "object", "required": ["asyncapi", "channels", "operations"]}),
            ),
        )
}

pub(crate) fn page_get() -> Operation {
    Operation::new(Method::GET, "/", "getPage")
        .tag("page")
        .summary("The page for people: upload, separate, play and download stems; the operations view")
        .answer(200, Answer::media("The page", &["text/html"], json!({"type": "string"})))
}

pub(crate) fn page_file() -> Operation {
    let mut media: Vec<&'static str> =
        crate::web::assets().map(|(_, mime)| mime.split(';').next().unwrap_or(mime)).collect();
    media.sort_unstable();
    media.dedup();
    Operation::new(Method::GET, "/app/{file}", "getPageFile")
        .tag("page")
        .summary("One of the page's files (scripts, style, icon)")
        .path_params::<crate::web::FilePath>(json!({"file": "app.js"}))
        .answer(200, Answer::media("The file", &media, json!({"type": "string"})))
        .answer(404, Answer::error("No such file", &[ErrorCode::NotFound]))
}

pub(crate) fn favicon_get() -> Operation {
    Operation::new(Method::GET, "/favicon.ico", "getFavicon")
        .tag("page")
        .summary("The page's icon (browsers ask for it whatever the page links)")
        .answer(200, Answer::media("The icon", &["image/svg+xml"], json!({"type": "string"})))
}
