//! The job routes of `/v1/separations`: submit, read one, list. Cancel and retry are
//! [`crate::control`], the event stream [`crate::events`].

use axum::extract::{Extension, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use stemq_accounts::auth::Caller;
use stemq_core::JobStatus;
use stemq_nats::read::Cursor;
use tracing::Instrument;

use crate::links::{Job, Links};
use crate::pipeline::submit_as;
use crate::rejection::{Bytes, Path, Query};
use crate::submit::{Dependency, NoAnswer, SubmitError, SubmitResponse};
use crate::{control, prefer, ApiError, AppState, ErrorCode};

/// Longest an HTTP submit takes before answering 503: the publish's own budget (at
/// most 10 s, [`crate::availability`]) and the checks before it. The submit is idempotent, so
/// the client's retry is safe even if the event got through.
const SUBMIT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(12);

/// The answer of `POST /v1/separations`: the submit answer, or with `Prefer: wait` the
/// job itself.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum Submitted {
    /// Without `Prefer: wait`: the job's id, status and links.
    Queued(SubmitResponse),
    /// With `Prefer: wait=N`: the job (its view with its `urls`), ended or after N s.
    Job(Box<Job>),
}

/// `POST /v1/separations`.
pub(crate) async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    links: Links,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let incoming = headers.get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string);
    let span = tracing::info_span!("http.submit", trace_id = tracing::field::Empty, owner = %caller.owner);
    stemq_telemetry::logging::set_parent(&span, incoming.as_deref());
    let result = {
        // The job's trace continues from this span (or from the caller's, when tracing
        // is off here).
        let traceparent = span.in_scope(stemq_telemetry::logging::current_traceparent).or(incoming);
        let work = submit_as(&state, &caller, &body, traceparent).instrument(span);
        match tokio::time::timeout(SUBMIT_TIMEOUT, work).await {
            Ok(r) => r,
            Err(_) => Err(SubmitError::unavailable(Dependency::Queue, NoAnswer(SUBMIT_TIMEOUT))),
        }
    };
    state.metrics.observe_submit(&result);
    let (mut resp, _remaining) = match result {
        Err(SubmitError::Limited(l)) => return Ok(l.into_response()),
        r => r?,
    };
    let urls = links.of(&resp.job_id);
    let location = urls.get.clone();
    if let Some(secs) = prefer::wait(&headers) {
        // The job's view instead of the submit answer: the caller's own job, read as any
        // read is (right after the publish it comes from the log if the view lags).
        if let Some(view) = state.view_for(&caller, &resp.job_id).await? {
            let waited = prefer::until_ended(&state, &caller, view, secs).await?;
            let code = if waited.view.status.is_terminal() { StatusCode::OK } else { StatusCode::ACCEPTED };
            let job = Submitted::Job(Box::new(links.job(waited.view)));
            let mut out = (code, [(header::LOCATION, location)], Json(job)).into_response();
            prefer::mark(&mut out, waited.honoured.then_some(secs));
            return Ok(out);
        }
    }
    resp.urls = Some(urls);
    let mut out = if resp.cached {
        if let Ok(Some(v)) = state.view(&resp.job_id).await {
            resp.status = v.status;
        }
        (StatusCode::OK, [(header::LOCATION, location)], Json(Submitted::Queued(resp))).into_response()
    } else {
        (StatusCode::ACCEPTED, [(header::LOCATION, location)], Json(Submitted::Queued(resp))).into_response()
    };
    prefer::mark(&mut out, None);
    Ok(out)
}

/// The `{id}` of a job's routes.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct JobPath {
    /// The job id: 64 lowercase hex digits (the SHA-256 of the canonical request). Any
    /// other value is no job (404).
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub id: String,
}

/// `GET /v1/separations/{id}`.
pub(crate) async fn status(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    links: Links,
    Path(JobPath { id }): Path<JobPath>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let view = control::view_or_404(&state, &caller, &id).await?;
    let (view, applied) = match prefer::wait(&headers) {
        Some(secs) => {
            let waited = prefer::until_ended(&state, &caller, view, secs).await?;
            (waited.view, waited.honoured.then_some(secs))
        }
        None => (view, None),
    };
    let mut resp = Json(links.job(view)).into_response();
    prefer::mark(&mut resp, applied);
    Ok(resp)
}

/// The list's query. Each value is read as a string, so a bad one is a 422 naming its
/// parameter; the schema says what each takes.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ListQuery {
    /// Only the jobs in this status.
    #[schemars(with = "Option<JobStatus>")]
    status: Option<String>,
    /// Jobs per page, 1 to 1000; default 50.
    #[schemars(with = "Option<u16>", range(min = 1, max = 1000))]
    limit: Option<String>,
    /// Where the page starts: the `next_cursor` of the previous page.
    #[schemars(regex(pattern = r"^-?(1[0-9]{18}|[0-9]{1,18})\.[0-9a-f]{64}$"))]
    cursor: Option<String>,
}

/// A page of `GET /v1/separations`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct JobList {
    /// The jobs, newest first.
    pub jobs: Vec<Job>,
    /// The `cursor` of the next page; null on the last one.
    pub next_cursor: Option<String>,
    /// False while the ingress is still reading the status view at start (the list may
    /// miss jobs then).
    pub complete: bool,
}

/// `GET /v1/separations`.
pub(crate) async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    links: Links,
    Query(q): Query<ListQuery>,
) -> Result<Json<JobList>, ApiError> {
    let bad =
        |field: &str, message: String| ApiError { code: ErrorCode::InvalidRequest, message, field: Some(field.into()) };
    let status = match q.status.as_deref() {
        None => None,
        Some(s) => Some(JobStatus::parse(s).ok_or_else(|| bad("status", format!("unknown status `{s}`")))?),
    };
    let limit = match q.limit.as_deref() {
        None => 50,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| bad("limit", format!("`{l}` is not a number between 1 and 1000")))?,
    };
    let cursor = match q.cursor.as_deref() {
        None => None,
        Some(c) => Some(Cursor::decode(c).ok_or_else(|| bad("cursor", "malformed cursor".into()))?),
    };
    // An operator sees every owner's jobs; anyone else only their own.
    let owner = (!caller.role.allows(stemq_accounts::auth::Permission::Operate)).then_some(caller.owner.as_str());
    let page = state.index.page_of(owner, status, limit, cursor.as_ref());
    let views = futures::future::join_all(page.iter().map(|(id, _)| state.view_for(&caller, id))).await;
    let jobs: Vec<Job> = views.into_iter().filter_map(|v| v.ok().flatten()).map(|v| links.job(v)).collect();
    let next_cursor = (page.len() == limit)
        .then(|| page.last().map(|(id, ms)| Cursor { created_ns: *ms, id: id.clone() }.encode()))
        .flatten();
    Ok(Json(JobList { jobs, next_cursor, complete: state.index.caught_up() }))
}
