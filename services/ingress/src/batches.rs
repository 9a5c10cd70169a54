//! Batches over HTTP: `POST /v1/batches` submits up to 1 000 separation requests as one,
//! `GET /v1/batches/{id}` shows where each item is.
//!
//! This module owns a submission round of a batch (the contract is
//! [`stemq_core::batch`], the log [`stemq_nats::batch_log`]):
//!
//! 1. the body's shape is checked (1 to 1 000 items, a `webhook` URL under the address
//!    policy), then the batch id is derived from the owner and the items' job ids
//!    ([`batch_id`]; an `upload:` name counts as its store URI, as in a job id): the same
//!    batch submitted again is the same batch;
//! 2. the batch's latest round is read; items it already settled (submitted, or refused
//!    as invalid) are kept as they are, so a resubmission spends nothing on them;
//! 3. every other item, in order, goes the way of a single submit, validation first
//!    ([`crate::pipeline::prepare_as`]), then the rate, the cap on jobs in flight and the publish
//!    ([`crate::pipeline::spend_rate`], [`crate::pipeline::admit_and_queue`]). An invalid item is refused
//!    alone and the batch goes on; a refusal about the caller's budget (rate, jobs in
//!    flight, and any such limit a submit gains: [`SubmitError::stops_batch`]) or a queue
//!    that took nothing stops the batch: every later valid item is `not_submitted` with
//!    that reason. Submitting the batch again (after `Retry-After`) goes on from there;
//! 4. the round is recorded, merged with any round that landed meanwhile
//!    ([`record_round`]), and the batch's view is the answer: 202 when this round queued
//!    a new job or created the batch, 200 when it changed nothing; `Retry-After` when
//!    items wait for a resubmission.
//!
//! Another owner's batch is a 404, as a job is.

use axum::extract::{Extension, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use stemq_accounts::auth::Caller;
use stemq_core::batch::{batch_id, BatchId, BatchRequest, BatchSubmitted, BatchView, ItemError, ItemState};
use stemq_core::{JobId, JobStatus};
use stemq_nats::batch_log::{record_round, Read, Recorded, WriteError};
use tracing::{info, warn};

use crate::rejection::{Bytes, Path};
use crate::submit::SubmitError;
use crate::{ApiError, AppState, ErrorCode};

/// The `{id}` of `GET /v1/batches/{id}`.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub struct BatchPath {
    /// The batch id: 64 lowercase hex digits. Any other value is no batch (404).
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub id: String,
}

/// Views read at once when a batch's view is built.
const VIEW_READS: usize = 32;

/// Who records the rounds.
const SOURCE: &str = "/stemq/ingress";

fn invalid(e: stemq_core::request::RequestError) -> ApiError {
    ApiError { code: ErrorCode::InvalidRequest, message: e.to_string(), field: Some(e.field) }
}

fn unavailable(e: impl std::fmt::Display) -> ApiError {
    warn!(error = %e, "batch log unavailable");
    ApiError {
        code: ErrorCode::Unavailable,
        message: "the batch could not be read or recorded right now; submitting it again is safe".into(),
        field: None,
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError { code: ErrorCode::NotFound, message: format!("no batch {id}"), field: None }
}

/// What an item's refusal says: the error the same request would get alone from
/// `POST /v1/separations`.
fn item_error(e: SubmitError) -> ItemError {
    let retry_after = e.retry_after();
    let api = ApiError::from(e);
    ItemError { field: api.field.clone(), retry_after, ..ItemError::new(api.code.as_str(), api.message) }
}

/// `POST /v1/batches`.
pub(crate) async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req = BatchRequest::from_slice(&body).map_err(invalid)?;
    if let Some(w) = &req.webhook {
        let allow = stemq_webhook::allowlist_from_env();
        if let Err(e) = stemq_webhook::check_url(&w.url, &allow).await {
            return Err(ApiError {
                code: ErrorCode::InvalidRequest,
                message: e.to_string(),
                field: Some("webhook.url".into()),
            });
        }
    }
    // The id hashes the items' jobs: an upload's name stands for its store URI there, as
    // it does in a job id.
    let keyed: Vec<serde_json::Value> =
        req.items.iter().map(|i| with_upload_resolved(i, &caller.owner, &state)).collect();
    let (id, _) = batch_id(&caller.owner, &keyed);
    let traceparent = headers.get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string);
    // One round of a batch at a time in this process (rounds from elsewhere are merged).
    let _turn = state.key_locks.lock(&format!("batch.{id}")).await;
    let stored = state.batches.record(&id, Read::Leader).await.map_err(unavailable)?;
    let settled = |i: usize| stored.as_ref().and_then(|r| r.state.items.get(i)).filter(|s| s.is_settled()).cloned();
    let mut items = Vec::with_capacity(req.items.len());
    let mut new_jobs: Vec<JobId> = Vec::new();
    let mut queued_now = 0usize;
    let mut stop: Option<ItemError> = None;
    for (i, item) in req.items.iter().enumerate() {
        if let Some(s) = settled(i) {
            items.push(s);
            continue;
        }
        let bytes = serde_json::to_vec(item).expect("JSON values serialise");
        let event = match crate::pipeline::prepare_as(&state, &caller, &bytes, traceparent.clone()).await {
            Ok(event) => event,
            Err(e) => {
                let failed: Result<(crate::submit::SubmitResponse, ()), SubmitError> = Err(e);
                state.metrics.observe_submit(&failed);
                let Err(e) = failed else { unreachable!("an error") };
                items.push(refusal(e, &mut stop));
                continue;
            }
        };
        if let Some(reason) = &stop {
            items.push(ItemState::NotSubmitted { reason: reason.clone() });
            continue;
        }
        let result = async {
            crate::pipeline::spend_rate(&state, &caller).await?;
            crate::pipeline::admit_and_queue(&state, &caller, event).await
        }
        .await
        .map(|r| (r, ()));
        state.metrics.observe_submit(&result);
        match result {
            Ok((resp, ())) => {
                queued_now += usize::from(!resp.cached);
                new_jobs.push(resp.job_id.clone());
                items.push(ItemState::Submitted { job_id: resp.job_id });
            }
            Err(e) => items.push(refusal(e, &mut stop)),
        }
    }
    let round = BatchSubmitted {
        owner: caller.owner.clone(),
        items,
        webhook: req.webhook,
        metadata: req.metadata,
        created_at: chrono::Utc::now(),
        rounds: 1,
    };
    let recorded =
        record_round(&state.js, &state.batches, &id, round, &new_jobs, SOURCE).await.map_err(|e| match e {
            WriteError::Contended(_) => unavailable(e),
            e => unavailable(stemq_nats::error::report(&e)),
        })?;
    let view = view_of(&state, &id, &recorded).await?;
    info!(
        batch_id = %id,
        owner = %caller.owner,
        items = view.counts.items,
        queued_now,
        not_submitted = view.counts.not_submitted,
        refused = view.counts.refused,
        "batch submitted"
    );
    let code = if stored.is_none() || queued_now > 0 { StatusCode::ACCEPTED } else { StatusCode::OK };
    let mut resp = (code, Json(&view)).into_response();
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&format!("/v1/batches/{id}")) {
        h.insert("location", v);
    }
    if let Some(after) = view.stopped.as_ref().and_then(|s| s.retry_after) {
        h.insert("retry-after", HeaderValue::from(after.max(1)));
    }
    Ok(resp)
}

/// `item` with an `upload:` `audio_uri` replaced by the store URI of the owner's upload
/// ([`crate::uploads::resolve`]); any other item as it is.
fn with_upload_resolved(item: &serde_json::Value, owner: &str, state: &AppState) -> serde_json::Value {
    let Some(uri) = item.get("audio_uri").and_then(|u| u.as_str()) else { return item.clone() };
    match crate::uploads::resolve(uri, owner, state.stores()) {
        Ok(Some(upload)) => {
            let mut resolved = item.clone();
            resolved["audio_uri"] = serde_json::Value::String(upload.uri);
            resolved
        }
        _ => item.clone(),
    }
}

/// The state of an item whose submit failed with `e`, and the batch's stop when `e`
/// stops it (the first reason stays).
fn refusal(e: SubmitError, stop: &mut Option<ItemError>) -> ItemState {
    if e.stops_batch() {
        let reason = item_error(e);
        stop.get_or_insert_with(|| reason.clone());
        ItemState::NotSubmitted { reason }
    } else {
        ItemState::Refused { error: item_error(e) }
    }
}

/// `GET /v1/batches/{id}`.
pub(crate) async fn status(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(BatchPath { id }): Path<BatchPath>,
) -> Result<Json<BatchView>, ApiError> {
    let batch = BatchId::parse(&id).ok_or_else(|| not_found(&id))?;
    let recorded = state.batches.record(&batch, Read::Any).await.map_err(unavailable)?;
    let recorded = recorded.filter(|r| caller.sees(&r.state.owner)).ok_or_else(|| not_found(&id))?;
    Ok(Json(view_of(&state, &batch, &recorded).await?))
}

/// The batch's view: its record, its jobs' statuses (the read side's current views) and
/// its end, once recorded.
async fn view_of(state: &AppState, id: &BatchId, recorded: &Recorded) -> Result<BatchView, ApiError> {
    let jobs = recorded.state.jobs();
    let reads = futures::stream::iter(jobs.into_iter().map(|job| async move {
        let status = state.view(&job).await.map(|v| v.map(|v| v.status));
        (job, status)
    }))
    .buffer_unordered(VIEW_READS)
    .collect::<Vec<_>>()
    .await;
    let mut statuses: std::collections::HashMap<JobId, JobStatus> = std::collections::HashMap::new();
    for (job, status) in reads {
        if let Some(s) = status? {
            statuses.insert(job, s);
        }
    }
    let mut view = BatchView::build(id, &recorded.state, recorded.time, |j| statuses.get(j).copied());
    if let Some(ended) = state.batches.ended(id, Read::Any).await.map_err(unavailable)? {
        view.ended_at = Some(ended.time);
    }
    Ok(view)
}
