//! The example values of `/openapi.json`: one job, upload, batch and delivery, each a
//! value of the type the API answers with, so an example cannot drift from its schema.

use serde_json::json;
use stemq_core::batch::BatchView;
use stemq_core::event::DeliveryResult;
use stemq_core::{JobId, JobRequest, JobStatus, JobView};

use crate::links::{Job, Links};
use crate::submit::SubmitResponse;
use crate::webhooks::{Delivery, DeliveryAttempt};

/// An example job id (any 64 lowercase hex digits is the form).
pub(super) const EXAMPLE_ID: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
/// The job an example retry made.
pub(super) const EXAMPLE_RETRY_ID: &str = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752";
/// An example upload's SHA-256.
pub(super) const EXAMPLE_SHA: &str = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";

pub(super) fn time(s: &str) -> chrono::DateTime<chrono::Utc> {
    s.parse().expect("example times are RFC 3339")
}

pub(super) fn id(s: &str) -> JobId {
    JobId::parse(s).expect("example ids are ids")
}

pub(super) fn links() -> Links {
    Links::under(&"https://stemq.example.com".parse().expect("a public URL"))
}

pub(super) fn upload_uri() -> String {
    format!("upload:{EXAMPLE_SHA}.wav")
}

/// An example request.
pub(super) fn request() -> JobRequest {
    serde_json::from_value(json!({"audio_uri": upload_uri(), "model": "dsp"})).expect("an example request")
}

/// An example view in `status`.
pub(super) fn view(status: JobStatus) -> JobView {
    let mut v = json!({
        "job_id": EXAMPLE_ID,
        "status": status,
        "request": {"audio_uri": format!("s3://stemq/uploads/acme/{EXAMPLE_SHA}.wav"), "model": "dsp",
                    "output_format": "wav", "encoding": "s16", "clip_mode": "rescale", "overlap": 0.25,
                    "shifts": 0, "owner": "acme"},
        "created_at": "2026-01-05T10:00:00Z",
        "updated_at": "2026-01-05T10:00:00Z",
        "attempt": 0, "retries": 0, "degraded": false, "last_seq": 1, "progress_seq": 0,
    });
    match status {
        JobStatus::Queued => {
            v["queue_position"] = json!(0);
            v["eta"] = json!("2026-01-05T10:00:12Z");
            v["eta_seconds"] = json!(12);
        }
        JobStatus::Running => {
            v["attempt"] = json!(1);
            v["started_at"] = json!("2026-01-05T10:00:01Z");
            v["updated_at"] = json!("2026-01-05T10:00:04Z");
            v["worker"] = json!("worker-7f3a");
            v["device"] = json!("cpu");
            v["progress"] = json!({"percent": 40.0, "stage": "separating"});
            v["last_seq"] = json!(2);
            v["eta"] = json!("2026-01-05T10:00:09Z");
            v["eta_seconds"] = json!(5);
        }
        _ => {
            v["attempt"] = json!(1);
            v["started_at"] = json!("2026-01-05T10:00:01Z");
            v["finished_at"] = json!("2026-01-05T10:00:09Z");
            v["updated_at"] = json!("2026-01-05T10:00:09Z");
            v["worker"] = json!("worker-7f3a");
            v["device"] = json!("cpu");
            v["last_seq"] = json!(3);
            v["outputs"] = json!(["drums", "bass", "other", "vocals"].map(|stem| json!({
                "stem": stem, "uri": format!("s3://stemq/jobs/{EXAMPLE_ID}/{stem}.wav"),
                "bytes": 1_764_044, "sha256": EXAMPLE_SHA,
            })));
        }
    }
    serde_json::from_value(v).expect("an example view")
}

pub(super) fn job(status: JobStatus) -> Job {
    links().job(view(status))
}

pub(super) fn submitted(cached: bool, status: JobStatus) -> SubmitResponse {
    SubmitResponse {
        job_id: id(EXAMPLE_ID),
        status,
        cached,
        status_url: format!("/v1/separations/{EXAMPLE_ID}"),
        urls: Some(links().of(&id(EXAMPLE_ID))),
    }
}

pub(super) fn retried(cached: bool) -> SubmitResponse {
    SubmitResponse {
        job_id: id(EXAMPLE_RETRY_ID),
        status: JobStatus::Queued,
        cached,
        status_url: format!("/v1/separations/{EXAMPLE_RETRY_ID}"),
        urls: Some(links().of(&id(EXAMPLE_RETRY_ID))),
    }
}

pub(super) fn delivery() -> Delivery {
    let attempt = |n: u32, code: u16, result: DeliveryResult, retry: Option<u64>| DeliveryAttempt {
        attempt: n,
        status_code: Some(code),
        latency_ms: 42,
        result,
        error: None,
        retry_in_ms: retry,
        replay: false,
        time: time(&format!("2026-01-05T10:00:1{n}Z")),
    };
    Delivery {
        n: 1,
        webhook_id: format!("msg_{EXAMPLE_ID}_succeeded"),
        event_type: "io.stemq.job.succeeded.v1".into(),
        url: "https://hooks.example.com/stemq".into(),
        result: DeliveryResult::Delivered,
        attempts: vec![
            attempt(1, 503, DeliveryResult::Retrying, Some(1000)),
            attempt(2, 200, DeliveryResult::Delivered, None),
        ],
    }
}

/// An example batch of two songs, one refused.
pub(super) fn batch() -> BatchView {
    serde_json::from_value(json!({
        "batch_id": EXAMPLE_RETRY_ID, "owner": "acme", "status": "running",
        "counts": {"items": 2, "submitted": 1, "refused": 1, "not_submitted": 0, "queued": 0, "running": 1,
                   "succeeded": 0, "failed": 0, "dead_lettered": 0, "rejected": 0, "cancelled": 0, "expired": 0},
        "created_at": "2026-01-05T10:00:00Z", "updated_at": "2026-01-05T10:00:00Z", "rounds": 1,
        "items": [
            {"index": 0, "state": "submitted", "job_id": EXAMPLE_ID, "status": "running"},
            {"index": 1, "state": "refused", "error": {"code": "invalid_request", "field": "two_stems",
             "message": "`guitar` is not a source of htdemucs; expected one of drums, bass, other, vocals"}},
        ],
    }))
    .expect("an example batch")
}

/// An example webhook secret.
pub(super) const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
