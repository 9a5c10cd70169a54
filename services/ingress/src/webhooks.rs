//! Webhook endpoints of the API: the owner's signing secret and the delivery record.
//!
//! This module owns the HTTP side of webhooks (the relay delivers them):
//! - `GET /v1/webhooks/secret` → the owner's `whsec_` secret (created on first use);
//! - `POST /v1/webhooks/secret/rotate` → a new secret; the old one keeps signing (a
//!   second `v1,` signature) for the grace period (`STEMQ_WEBHOOK_ROTATION_GRACE_S`,
//!   default a day);
//! - `POST /v1/webhooks/enable` `{"url": …}` → deliveries to a URL that a `410 Gone`
//!   disabled are made again (the same [`webhook::enable`] as `stemq webhooks enable`);
//! - `GET /v1/separations/{id}/deliveries` → every attempt the relay recorded, grouped
//!   by delivery (`n` from 1, in order of first attempt);
//! - `POST /v1/separations/{id}/deliveries/{n}/replay` → asks the relay to send
//!   delivery `n` again (same `webhook-id`, the job's current view).

use std::time::Duration;

use async_nats::jetstream;
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use stemq_accounts::auth::Caller;
use stemq_core::event::{DeliveryAttempted, DeliveryReplayRequested, DeliveryResult, EventBody};
use stemq_core::{Event, JobId};
use stemq_nats::publish::publish;
use stemq_nats::{self as names, job_subject, SubjectKind};
use stemq_webhook::{self as webhook, OwnerWebhooks};

use crate::control::view_or_404;
use crate::error::internal;
use crate::rejection::{Bytes, Path};
use crate::separations::JobPath;
use crate::{ApiError, AppState, ErrorCode};

fn grace() -> Duration {
    std::env::var("STEMQ_WEBHOOK_ROTATION_GRACE_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(86_400))
}

async fn bucket(state: &AppState) -> Result<jetstream::kv::Store, ApiError> {
    state.js.get_key_value(names::WEBHOOKS_BUCKET).await.map_err(internal)
}

/// The owner's webhook signing secrets (`GET /v1/webhooks/secret`, and the rotation's
/// answer).
#[derive(Debug, Serialize, JsonSchema)]
pub struct WebhookSecret {
    /// The signing secret: `whsec_` and base64 (Standard Webhooks).
    #[schemars(regex(pattern = r"^whsec_[A-Za-z0-9+/=]+$"))]
    pub secret: String,
    /// The previous secret, which still signs deliveries (a second `v1,` signature)
    /// until `previous_valid_until`.
    pub previous: Option<String>,
    /// The end of the rotation's grace period.
    pub previous_valid_until: Option<DateTime<Utc>>,
    /// Receiver URLs that answered 410 Gone: nothing more is sent to them until enabled
    /// again.
    pub disabled_urls: Vec<String>,
}

impl WebhookSecret {
    fn of(o: &OwnerWebhooks) -> WebhookSecret {
        let until = o.previous_until.filter(|u| *u > Utc::now());
        WebhookSecret {
            secret: o.secret.clone(),
            previous: until.and(o.previous.clone()),
            previous_valid_until: until,
            disabled_urls: o.disabled.clone(),
        }
    }
}

/// `GET /v1/webhooks/secret`.
pub(crate) async fn get_secret(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<crate::session::NoStore<WebhookSecret>, ApiError> {
    let (o, _) = webhook::owner_webhooks(&bucket(&state).await?, &caller.owner).await.map_err(internal)?;
    Ok(crate::session::NoStore(WebhookSecret::of(&o)))
}

/// `POST /v1/webhooks/secret/rotate`.
pub(crate) async fn rotate_secret(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<crate::session::NoStore<WebhookSecret>, ApiError> {
    let o = webhook::rotate(&bucket(&state).await?, &caller.owner, grace()).await.map_err(internal)?;
    Ok(crate::session::NoStore(WebhookSecret::of(&o)))
}

/// The body of `POST /v1/webhooks/enable`.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct EnableRequest {
    /// The receiver URL to deliver to again, exactly as the webhooks name it.
    #[schemars(length(min = 1))]
    pub url: String,
}

/// The answer of `POST /v1/webhooks/enable`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct EnableResponse {
    /// The URL, enabled.
    pub url: String,
    /// Whether a 410 Gone had disabled it.
    pub was_disabled: bool,
    /// The owner's receiver URLs still disabled.
    pub disabled_urls: Vec<String>,
}

/// `POST /v1/webhooks/enable` with `{"url": "…"}`: 200 with `was_disabled` and the
/// URLs still disabled; 422 without a `url`.
pub(crate) async fn enable(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Bytes,
) -> Result<Json<EnableResponse>, ApiError> {
    let url = serde_json::from_slice::<EnableRequest>(&body).ok().map(|r| r.url).filter(|u| !u.is_empty()).ok_or_else(
        || ApiError {
            code: ErrorCode::InvalidRequest,
            message: "the body must be a JSON object with a `url` string".into(),
            field: Some("url".into()),
        },
    )?;
    let (o, was_disabled) = webhook::enable(&bucket(&state).await?, &caller.owner, &url).await.map_err(internal)?;
    Ok(Json(EnableResponse { url, was_disabled, disabled_urls: o.disabled }))
}

/// Every `delivery_attempted` event of a job, in log order.
pub async fn attempts(
    js: &jetstream::Context,
    id: &JobId,
) -> Result<Vec<(Event, DeliveryAttempted)>, webhook::RecordError> {
    let all = webhook::delivery_attempts(js, id, 0).await?;
    Ok(all.into_iter().map(|r| (r.event, r.attempt)).collect())
}

/// The webhook deliveries of a job (`GET /v1/separations/{id}/deliveries`).
#[derive(Debug, Serialize, JsonSchema)]
pub struct Deliveries {
    /// The job.
    pub job_id: JobId,
    /// Its deliveries, numbered from 1 in order of first attempt.
    pub deliveries: Vec<Delivery>,
}

/// One delivery (one `webhook-id`) and every attempt at it.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Delivery {
    /// Its number within the job, from 1 (`POST …/deliveries/{n}/replay`).
    pub n: usize,
    /// The `webhook-id` header, the same for every attempt and replay.
    pub webhook_id: String,
    /// The event type it reports (`io.stemq.job.succeeded.v1`, ...).
    pub event_type: String,
    /// The receiver.
    pub url: String,
    /// Where it stands: the last attempt's result.
    pub result: DeliveryResult,
    /// Every attempt, in order.
    pub attempts: Vec<DeliveryAttempt>,
}

/// One attempt of a delivery.
#[derive(Debug, Serialize, JsonSchema)]
pub struct DeliveryAttempt {
    /// Attempt number within the delivery, from 1 (a replay starts again at 1).
    pub attempt: u32,
    /// The receiver's HTTP status, when an answer came.
    pub status_code: Option<u16>,
    /// Time to the answer (or the error), in milliseconds.
    pub latency_ms: u64,
    /// What it means.
    pub result: DeliveryResult,
    /// The transport error or refusal reason, if any.
    pub error: Option<String>,
    /// When the next attempt is due, in milliseconds (`retrying` only).
    pub retry_in_ms: Option<u64>,
    /// True when the attempt belongs to a replay.
    pub replay: bool,
    /// When it was made.
    pub time: DateTime<Utc>,
}

/// Groups attempts by delivery (`webhook-id`), numbered from 1.
pub fn group(attempts: &[(Event, DeliveryAttempted)]) -> Vec<Delivery> {
    let mut order: Vec<String> = Vec::new();
    for (_, a) in attempts {
        if !order.contains(&a.webhook_id) {
            order.push(a.webhook_id.clone());
        }
    }
    order
        .iter()
        .enumerate()
        .map(|(i, wid)| {
            let mine: Vec<&(Event, DeliveryAttempted)> =
                attempts.iter().filter(|(_, a)| &a.webhook_id == wid).collect();
            let last = &mine.last().expect("at least one").1;
            Delivery {
                n: i + 1,
                webhook_id: wid.clone(),
                event_type: last.event_type.clone(),
                url: last.url.clone(),
                result: last.result,
                attempts: mine
                    .iter()
                    .map(|(e, a)| DeliveryAttempt {
                        attempt: a.attempt,
                        status_code: a.status_code,
                        latency_ms: a.latency_ms,
                        result: a.result,
                        error: a.error.clone(),
                        retry_in_ms: a.retry_in_ms,
                        replay: a.replay,
                        time: e.time,
                    })
                    .collect(),
            }
        })
        .collect()
}

/// `GET /v1/separations/{id}/deliveries`.
pub(crate) async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(JobPath { id }): Path<JobPath>,
) -> Result<Json<Deliveries>, ApiError> {
    let view = view_or_404(&state, &caller, &id).await?;
    let all = attempts(&state.js, &view.job_id).await.map_err(internal)?;
    Ok(Json(Deliveries { job_id: view.job_id, deliveries: group(&all) }))
}

/// The path of `POST /v1/separations/{id}/deliveries/{n}/replay`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ReplayPath {
    /// The job id.
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub id: String,
    /// The delivery's number (`n` of the deliveries list).
    #[schemars(range(min = 1, max = u32::MAX))]
    pub n: u32,
}

/// The answer of a replay.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ReplayQueued {
    /// The job.
    pub job_id: JobId,
    /// The delivery.
    pub n: u32,
    /// Its `webhook-id`, which the replay's attempts carry again.
    pub webhook_id: String,
    /// `queued`: the relay sends it shortly.
    pub replay: ReplayState,
}

/// Where a replay is.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReplayState {
    /// Recorded for the relay, which sends it shortly.
    Queued,
}

/// `POST /v1/separations/{id}/deliveries/{n}/replay`.
pub(crate) async fn replay(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(ReplayPath { id, n }): Path<ReplayPath>,
) -> Result<Response, ApiError> {
    let view = view_or_404(&state, &caller, &id).await?;
    let all = attempts(&state.js, &view.job_id).await.map_err(internal)?;
    let groups = group(&all);
    let Some(d) = (n as usize).checked_sub(1).and_then(|i| groups.get(i)) else {
        return Err(ApiError {
            code: ErrorCode::NotFound,
            message: format!("job {id} has no delivery {n}"),
            field: None,
        });
    };
    // One delivery cannot be replayed in a loop: each replay is a signed POST to the
    // receiver.
    if let Err(l) = crate::limits::replay(&state.limits, &view.job_id, n as usize).await.map_err(internal)? {
        return Ok(l.into_response());
    }
    let ev = Event::new(
        &view.job_id,
        "/stemq/ingress",
        EventBody::DeliveryReplayRequested(DeliveryReplayRequested {
            webhook_id: d.webhook_id.clone(),
            event_type: d.event_type.clone(),
        }),
    );
    publish(&state.js, &job_subject(&view.job_id, SubjectKind::DeliveryReplay), &ev, None).await.map_err(internal)?;
    let answer = ReplayQueued { job_id: view.job_id, n, webhook_id: d.webhook_id.clone(), replay: ReplayState::Queued };
    Ok((StatusCode::ACCEPTED, Json(answer)).into_response())
}
