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
use serde_json::{json, Value};
use stemq_core::auth::Caller;
use stemq_core::event::{DeliveryAttempted, DeliveryReplayRequested, EventBody};
use stemq_core::nats::{self as names, job_subject, SubjectKind};
use stemq_core::publish::publish;
use stemq_core::webhook::{self, OwnerWebhooks};
use stemq_core::{Event, JobId};

use crate::control::view_or_404;
use crate::errors::{Bytes, Path};
use crate::{internal, ApiError, AppState};

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

fn secret_body(o: &OwnerWebhooks) -> Value {
    json!({
        "secret": o.secret,
        "previous": o.previous_until.filter(|u| *u > chrono::Utc::now()).and(o.previous.clone()),
        "previous_valid_until": o.previous_until.filter(|u| *u > chrono::Utc::now()),
        "disabled_urls": o.disabled,
    })
}

/// `GET /v1/webhooks/secret`.
pub(crate) async fn get_secret(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Value>, ApiError> {
    let (o, _) = webhook::owner_webhooks(&bucket(&state).await?, &caller.owner).await.map_err(internal)?;
    Ok(Json(secret_body(&o)))
}

/// `POST /v1/webhooks/secret/rotate`.
pub(crate) async fn rotate_secret(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Value>, ApiError> {
    let o = webhook::rotate(&bucket(&state).await?, &caller.owner, grace()).await.map_err(internal)?;
    Ok(Json(secret_body(&o)))
}

/// `POST /v1/webhooks/enable` with `{"url": "…"}`: 200 with `was_disabled` and the
/// URLs still disabled; 422 without a `url`.
pub(crate) async fn enable(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let url = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("url").and_then(Value::as_str).map(str::to_string))
        .filter(|u| !u.is_empty())
        .ok_or_else(|| ApiError {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            code: "invalid_request",
            message: "the body must be a JSON object with a `url` string".into(),
            field: Some("url".into()),
        })?;
    let (o, was_disabled) = webhook::enable(&bucket(&state).await?, &caller.owner, &url).await.map_err(internal)?;
    Ok(Json(json!({"url": url, "was_disabled": was_disabled, "disabled_urls": o.disabled})))
}

/// Every `delivery_attempted` event of a job, in log order.
pub async fn attempts(
    js: &jetstream::Context,
    id: &JobId,
) -> Result<Vec<(Event, DeliveryAttempted)>, webhook::RecordError> {
    let all = webhook::delivery_attempts(js, id, 0).await?;
    Ok(all.into_iter().map(|r| (r.event, r.attempt)).collect())
}

/// Groups attempts by delivery (`webhook-id`), numbered from 1.
pub fn group(attempts: &[(Event, DeliveryAttempted)]) -> Vec<Value> {
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
            json!({
                "n": i + 1,
                "webhook_id": wid,
                "event_type": last.event_type,
                "url": last.url,
                "result": last.result,
                "attempts": mine.iter().map(|(e, a)| json!({
                    "attempt": a.attempt, "status_code": a.status_code, "latency_ms": a.latency_ms,
                    "result": a.result, "error": a.error, "retry_in_ms": a.retry_in_ms,
                    "replay": a.replay, "time": e.time,
                })).collect::<Vec<_>>(),
            })
        })
        .collect()
}

/// `GET /v1/separations/{id}/deliveries`.
pub(crate) async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let view = view_or_404(&state, &caller, &id).await?;
    let all = attempts(&state.js, &view.job_id).await.map_err(internal)?;
    Ok(Json(json!({"job_id": view.job_id, "deliveries": group(&all)})))
}

/// `POST /v1/separations/{id}/deliveries/{n}/replay`.
pub(crate) async fn replay(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((id, n)): Path<(String, usize)>,
) -> Result<Response, ApiError> {
    let view = view_or_404(&state, &caller, &id).await?;
    let all = attempts(&state.js, &view.job_id).await.map_err(internal)?;
    let groups = group(&all);
    let Some(d) = n.checked_sub(1).and_then(|i| groups.get(i)) else {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            code: "not_found",
            message: format!("job {id} has no delivery {n}"),
            field: None,
        });
    };
    // One delivery cannot be replayed in a loop: each replay is a signed POST to the
    // receiver.
    if let Err(l) = crate::limits::replay(&state.limits, &view.job_id, n).await.map_err(internal)? {
        return Ok(l.into_response());
    }
    let ev = Event::new(
        &view.job_id,
        "/stemq/ingress",
        EventBody::DeliveryReplayRequested(DeliveryReplayRequested {
            webhook_id: d["webhook_id"].as_str().unwrap_or_default().to_string(),
            event_type: d["event_type"].as_str().unwrap_or_default().to_string(),
        }),
    );
    publish(&state.js, &job_subject(&view.job_id, SubjectKind::DeliveryReplay), &ev, None).await.map_err(internal)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"job_id": view.job_id, "n": n, "webhook_id": d["webhook_id"], "replay": "queued"})),
    )
        .into_response())
}
