//! Stopping and re-running jobs on purpose: cancel and retry. Shared by HTTP and the CLI.
//!
//! This module owns the two control writes:
//! - [`cancel`] records `cancel_requested` on `stemq.jobs.<id>.cancel_requested` (the
//!   worker running the job listens there and stops at its next chunk; a worker about to
//!   start it finds the request in the log and never starts). A job that is still queued
//!   is also ended at once with `cancelled` on its outcome subject (first terminal event
//!   wins, so a worker that started it concurrently simply loses the race).
//! - [`retry`] re-runs a failed, dead-lettered, cancelled or expired job as a new job
//!   (`retry_of` in its request, hence a new id; retrying the same job twice gives the
//!   same new job) and links the old one with `retried`. `stemq dlq replay` uses it too.
//!
//! HTTP: `POST /v1/separations/{id}/cancel`, `POST /v1/separations/{id}/retry`.

use async_nats::jetstream;
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::Json;
use schemars::JsonSchema;
use serde::Serialize;
use stemq_accounts::auth::Caller;
use stemq_core::event::{CancelRequested, Cancelled, EventBody, Retried};
use stemq_core::{Event, JobId, JobStatus, JobView};
use stemq_nats::publish::{publish, publish_once, publish_request, Once};
use stemq_nats::{job_subject, SubjectKind};

use crate::error::internal;
use crate::links::Links;
use crate::rejection::Path;
use crate::separations::JobPath;
use crate::submit::SubmitResponse;
use crate::{ApiError, AppState, ErrorCode};

/// Why a control operation was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The job is in a state the operation does not apply to (409).
    #[error("job {id} is {}: {why}", status.as_str())]
    Conflict {
        /// The job.
        id: JobId,
        /// Its status.
        status: JobStatus,
        /// What would have been needed.
        why: &'static str,
    },
    /// The view has no recorded request (cannot re-run).
    #[error("job {0} has no recorded request")]
    NoRequest(JobId),
    /// NATS did not take the event (503); retrying is safe.
    #[error(transparent)]
    Publish(#[from] stemq_nats::publish::PublishError),
}

/// What a cancel did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CancelOutcome {
    /// The job was queued and is now `cancelled`; it never runs.
    Cancelled,
    /// The job is running; its worker stops it within about a second.
    Cancelling,
    /// It was already cancelled (nothing new recorded).
    AlreadyCancelled,
}

/// Cancels the job whose current view is `view`; `by` is recorded (`http`, `cli`).
pub async fn cancel(js: &jetstream::Context, view: &JobView, by: &str) -> Result<CancelOutcome, ControlError> {
    let id = &view.job_id;
    match view.status {
        JobStatus::Cancelled => return Ok(CancelOutcome::AlreadyCancelled),
        s if s.is_terminal() => {
            return Err(ControlError::Conflict {
                id: id.clone(),
                status: s,
                why: "only queued or running jobs can be cancelled",
            })
        }
        _ => {}
    }
    let source = format!("/stemq/{by}");
    let asked = Event::new(id, &source, EventBody::CancelRequested(CancelRequested { by: Some(by.into()) }));
    publish(js, &job_subject(id, SubjectKind::CancelRequested), &asked, Some(&format!("{id}.cancel_requested")))
        .await?;
    if view.status == JobStatus::Queued {
        let done =
            Event::new(id, &source, EventBody::Cancelled(Cancelled { attempt: view.attempt, interrupted: false }));
        publish_once(js, &job_subject(id, SubjectKind::Outcome), &done, &format!("{id}.outcome")).await?;
        return Ok(CancelOutcome::Cancelled);
    }
    Ok(CancelOutcome::Cancelling)
}

/// Re-runs a finished job as a new one; returns the new id and whether it was created
/// now (false: this job had already been re-run, the same new job is returned).
pub async fn retry(js: &jetstream::Context, view: &JobView, source: &str) -> Result<(JobId, bool), ControlError> {
    let id = &view.job_id;
    if !matches!(view.status, JobStatus::Failed | JobStatus::DeadLettered | JobStatus::Cancelled | JobStatus::Expired) {
        return Err(ControlError::Conflict {
            id: id.clone(),
            status: view.status,
            why: "only failed, dead-lettered, cancelled or expired jobs can be retried",
        });
    }
    let mut request = view.request.clone().ok_or_else(|| ControlError::NoRequest(id.clone()))?;
    request.retry_of = Some(id.clone());
    let mut ev = Event::requested(request, view.webhook.clone(), view.metadata.clone(), source);
    // The time limit and the lane carry over; a start deadline does not (it has usually
    // passed).
    if let EventBody::Requested(r) = &mut ev.body {
        r.max_runtime = view.max_runtime;
        r.priority = view.priority;
    }
    let new_id = ev.subject.clone();
    let created = publish_request(js, &new_id, &ev).await?;
    let link = Event::new(id, source, EventBody::Retried(Retried { retried_by: new_id.clone() }));
    publish(js, &job_subject(id, SubjectKind::Retried), &link, Some(&format!("{id}.retried.{new_id}"))).await?;
    Ok((new_id, matches!(created, Once::Stored(_))))
}

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> ApiError {
        match e {
            ControlError::Conflict { .. } => {
                ApiError { code: ErrorCode::Conflict, message: e.to_string(), field: None }
            }
            ControlError::NoRequest(_) => ApiError { code: ErrorCode::Conflict, message: e.to_string(), field: None },
            ControlError::Publish(p) => internal(p),
        }
    }
}

/// The view of `id` if `caller` may see it, or 404 (another owner's job included).
pub(crate) async fn view_or_404(state: &AppState, caller: &Caller, id: &str) -> Result<JobView, ApiError> {
    let not_found = || ApiError { code: ErrorCode::NotFound, message: format!("no job {id}"), field: None };
    let job_id = JobId::parse(id).ok_or_else(not_found)?;
    state.view_for(caller, &job_id).await?.ok_or_else(not_found)
}

/// The job's status as a cancel leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CancelStatus {
    /// Ended: it never runs (it was queued, or had been cancelled already). HTTP 200.
    Cancelled,
    /// Running: its worker stops it within about a second, keeping no outputs; the job
    /// then reads `cancelled`. HTTP 202.
    Cancelling,
}

/// The answer of `POST /v1/separations/{id}/cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
pub struct CancelResponse {
    /// The job.
    pub job_id: JobId,
    /// Where the cancel leaves it.
    pub status: CancelStatus,
    /// What this cancel did.
    pub outcome: CancelOutcome,
}

impl CancelResponse {
    /// The answer for `outcome` of job `job_id`, and its HTTP status.
    pub fn of(job_id: JobId, outcome: CancelOutcome) -> (StatusCode, CancelResponse) {
        let (code, status) = match outcome {
            CancelOutcome::Cancelling => (StatusCode::ACCEPTED, CancelStatus::Cancelling),
            CancelOutcome::Cancelled | CancelOutcome::AlreadyCancelled => (StatusCode::OK, CancelStatus::Cancelled),
        };
        (code, CancelResponse { job_id, status, outcome })
    }
}

/// `POST /v1/separations/{id}/cancel`.
pub(crate) async fn cancel_http(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(JobPath { id }): Path<JobPath>,
) -> Result<(StatusCode, Json<CancelResponse>), ApiError> {
    let view = view_or_404(&state, &caller, &id).await?;
    let outcome = cancel(&state.js, &view, "http").await?;
    let (code, resp) = CancelResponse::of(view.job_id, outcome);
    Ok((code, Json(resp)))
}

/// `POST /v1/separations/{id}/retry`.
pub(crate) async fn retry_http(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    links: Links,
    Path(JobPath { id }): Path<JobPath>,
) -> Result<(StatusCode, Json<SubmitResponse>), ApiError> {
    let view = view_or_404(&state, &caller, &id).await?;
    let (new_id, created) = retry(&state.js, &view, "/stemq/ingress").await?;
    let status = match created {
        true => JobStatus::Queued,
        false => state.view(&new_id).await.ok().flatten().map(|v| v.status).unwrap_or(JobStatus::Queued),
    };
    let resp = SubmitResponse {
        status_url: format!("/v1/separations/{new_id}"),
        urls: Some(links.of(&new_id)),
        job_id: new_id,
        status,
        cached: !created,
    };
    let code = if created { StatusCode::ACCEPTED } else { StatusCode::OK };
    Ok((code, Json(resp)))
}
