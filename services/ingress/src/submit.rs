//! Submitting a job: validate, derive the id, publish once. Shared by HTTP and NATS.
//!
//! This module owns the ingress's only write. A new job is one publish of its
//! `requested` event to `stemq.jobs.<id>.requested.<owner token>.<model>.<lane>` (the
//! pool's lane it waits in) with `Nats-Msg-Id` = id and expected-last-subject-sequence 0
//! over every request subject of the job, so the same request — a retry, a concurrent
//! duplicate, or the same song a day later after the dedupe window — finds the existing
//! job instead of creating a second one. Nothing heavy happens here. The publish waits
//! out a leader election of the job stream and fails fast while the queue is known to
//! take nothing ([`crate::availability`]).

use async_nats::jetstream;
use serde::{Deserialize, Serialize};
use stemq_core::netpolicy::{self, HostPolicy};
use stemq_core::request::RequestError;
use stemq_core::{Event, JobId, JobRequest, JobStatus};
use stemq_nats::error::BoxError;
use stemq_nats::publish::{publish_request, request_subject_of, Once};
use stemq_storage::Store;
use tracing::Instrument;

use crate::availability::{Availability, ATTEMPT};

/// Between two publish attempts of a submit.
const PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Answer to a submit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SubmitResponse {
    /// The job id (sha256 of the canonical request).
    pub job_id: JobId,
    /// Current status.
    pub status: JobStatus,
    /// True when the job already existed (nothing new was queued).
    pub cached: bool,
    /// Where to read the status (a path; `urls.get` is the same, absolute).
    pub status_url: String,
    /// Absolute URLs of the job's resources (HTTP answers only; not over NATS, which
    /// has no address to name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub urls: Option<crate::links::JobUrls>,
}

/// Why a submit failed.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// Refused by a rule of the ingress with its own answer (402 `insufficient_credits`).
    #[error("{}", .0.message)]
    Refused(crate::ApiError),
    /// The request is invalid (422).
    #[error(transparent)]
    Invalid(#[from] RequestError),
    /// A limit of the caller's key refused it (429): nothing was queued.
    #[error("{}", .0.message)]
    Limited(crate::limits::Limited),
    /// No live worker serves the model, and this ingress refuses rather than queues
    /// (422): nothing was queued.
    #[error("{}", unserved_message(*.model, .served))]
    Unserved {
        /// The model asked for.
        model: stemq_core::request::Model,
        /// What the live workers serve.
        served: Vec<stemq_core::request::Model>,
    },
    /// Something the submit needs did not answer (503): nothing was queued; retrying is
    /// safe.
    #[error("the job could not be queued: {dependency} failed")]
    Unavailable {
        /// What did not answer.
        dependency: Dependency,
        /// Its error.
        #[source]
        source: BoxError,
    },
}

/// What a submit needs that can fail to answer ([`SubmitError::Unavailable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dependency {
    /// The job stream (the publish of the request).
    Queue,
    /// The `stemq_limits` bucket (the key's rate and jobs in flight).
    Limits,
    /// The object store (an upload named by the request).
    Store,
}

impl std::fmt::Display for Dependency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dependency::Queue => "the queue",
            Dependency::Limits => "the limits bucket",
            Dependency::Store => "the object store",
        })
    }
}

/// A step that got no answer within its time.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("no answer within {0:?}")]
pub struct NoAnswer(pub std::time::Duration);

impl SubmitError {
    /// `dependency` failed with `source`.
    pub fn unavailable(dependency: Dependency, source: impl Into<BoxError>) -> SubmitError {
        SubmitError::Unavailable { dependency, source: source.into() }
    }
}

impl From<crate::limits::LimitsError> for SubmitError {
    fn from(e: crate::limits::LimitsError) -> SubmitError {
        SubmitError::unavailable(Dependency::Limits, e)
    }
}

impl SubmitError {
    /// Inside a batch, whether this refusal stops the batch (the items after it are
    /// `not_submitted`, and submitting the batch again goes on from there) rather than
    /// refusing this one item while the others go on. A limit of the caller's budget
    /// (rate, jobs in flight, credits; any refusal about what the caller may still spend) and a
    /// queue that takes nothing would refuse every later item alike; an invalid request
    /// is its own. A new refusal must say which it is here.
    pub fn stops_batch(&self) -> bool {
        match self {
            SubmitError::Invalid(_) | SubmitError::Unserved { .. } => false,
            SubmitError::Limited(_) | SubmitError::Unavailable { .. } => true,
            // A rule's own answer: what the owner cannot pay (402), a limit (429) or a
            // store that did not answer (5xx) holds for the items after it too.
            SubmitError::Refused(e) => {
                use axum::http::StatusCode;
                let status = e.status();
                status == StatusCode::PAYMENT_REQUIRED
                    || status == StatusCode::TOO_MANY_REQUESTS
                    || status.is_server_error()
            }
        }
    }

    /// Seconds until trying again can succeed, when the refusal says.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            SubmitError::Limited(l) => Some(l.retry_after),
            SubmitError::Unavailable { .. } => Some(2),
            // Credits do not come back by waiting.
            SubmitError::Invalid(_) | SubmitError::Unserved { .. } | SubmitError::Refused(_) => None,
        }
    }
}

fn unserved_message(model: stemq_core::request::Model, served: &[stemq_core::request::Model]) -> String {
    let served: Vec<&str> = served.iter().map(|m| m.as_str()).collect();
    let here = if served.is_empty() { "no model (no worker is running)".to_string() } else { served.join(", ") };
    let how = if model == stemq_core::request::Model::Dsp {
        "start a worker".to_string()
    } else {
        format!(
            "put the weights of {model} into the worker's model folder (`stemq models pull {model}`, in a build with \
             the demucs engine) and restart it, or ask for a model served here"
        )
    };
    format!("no worker here serves {model}; the workers here serve {here}: {how}")
}

/// Validates and queues `body` for `owner`; `stores` are the base URLs of the stores an
/// `audio_uri` may point into, `audio_urls` the hosts an external `audio_uri` may name
/// (`None`: external audio is off).
pub async fn submit(
    js: &jetstream::Context,
    body: &[u8],
    owner: &str,
    traceparent: Option<String>,
    stores: &[String],
    audio_urls: Option<&HostPolicy>,
) -> Result<(SubmitResponse, Option<Event>), SubmitError> {
    let event = prepare(body, owner, traceparent, stores, audio_urls, None).await?;
    queue(js, event).await
}

/// Validates `body` for `owner` and builds its `requested` event (the job id is its
/// subject); nothing is published. An `upload:` `audio_uri` becomes the URI of the
/// owner's upload in the store first ([`crate::uploads::resolve`]), and with `uploads`
/// (the store itself) it must exist. `stores` and `audio_urls` as for [`submit`].
pub async fn prepare(
    body: &[u8],
    owner: &str,
    traceparent: Option<String>,
    stores: &[String],
    audio_urls: Option<&HostPolicy>,
    uploads: Option<&Store>,
) -> Result<Event, SubmitError> {
    let mut req = JobRequest::from_slice(body)?;
    // An upload named as POST /v1/uploads answered: the caller's own, in our store.
    if let Some(upload) = crate::uploads::resolve(&req.audio_uri, owner, stores)? {
        if let Some(store) = uploads {
            let size = store.size(&upload.key).await.map_err(|e| SubmitError::unavailable(Dependency::Store, e))?;
            if size.is_none() {
                let message = format!(
                    "no upload `{}` of yours: upload the file with POST /v1/uploads and use the audio_uri it returns",
                    req.audio_uri
                );
                return Err(RequestError { field: "audio_uri".into(), message }.into());
            }
        }
        req.audio_uri = upload.uri;
    }
    // Only the owner's own uploads inside the configured stores, or, where the operator
    // allows external audio, a URL whose host is admitted and whose addresses are public
    // (or exempt): refused before anything is published. The worker checks again when it
    // reads (connects).
    match audio_urls {
        Some(policy) if stemq_core::uri::is_web_url(&req.audio_uri) => {
            if let Err(e) = netpolicy::check_url(&req.audio_uri, policy).await {
                return Err(RequestError { field: "audio_uri".into(), message: e.to_string() }.into());
            }
        }
        _ => {
            let (_, key) = stemq_core::uri::store_key(&req.audio_uri, stores)?;
            stemq_core::uri::check_owned(key, owner)?;
        }
    }
    let normalized = req.normalize(owner)?;
    // Webhook receivers: https and public unless STEMQ_WEBHOOK_ALLOW says otherwise.
    if let Some(w) = &req.webhook {
        let allow = stemq_webhook::allowlist_from_env();
        if let Err(e) = stemq_webhook::check_url(&w.url, &allow).await {
            return Err(RequestError { field: "webhook".into(), message: e.to_string() }.into());
        }
    }
    if let Some(t) = req.start_before {
        if t <= chrono::Utc::now() {
            return Err(RequestError {
                field: "start_before".into(),
                message: format!("{} is in the past", t.to_rfc3339()),
            }
            .into());
        }
    }
    let mut event = Event::requested(normalized, req.webhook.clone(), req.metadata.clone(), "/stemq/ingress");
    if let stemq_core::EventBody::Requested(r) = &mut event.body {
        r.start_before = req.start_before;
        r.max_runtime = req.max_runtime;
        r.priority = req.priority;
    }
    event.traceparent = traceparent;
    Ok(event)
}

/// Publishes a prepared `requested` event once (see the module doc), waiting up to an
/// election's length for the queue.
pub async fn queue(js: &jetstream::Context, event: Event) -> Result<(SubmitResponse, Option<Event>), SubmitError> {
    queue_with(js, event, &Availability::default()).await
}

/// Publishes a prepared `requested` event once, waiting for the queue as long as
/// `availability` says, and tells it how the publish went.
pub async fn queue_with(
    js: &jetstream::Context,
    event: Event,
    availability: &Availability,
) -> Result<(SubmitResponse, Option<Event>), SubmitError> {
    let id = event.subject.clone();
    if !matches!(event.body, stemq_core::EventBody::Requested(_)) {
        let message = format!("only a requested event is queued, not {}", event.body.kind());
        return Err(RequestError { field: "body".into(), message }.into());
    }
    let subject = request_subject_of(&id, &event);
    let (t0, budget) = (tokio::time::Instant::now(), availability.budget());
    let deadline = t0 + budget;
    // Attempts with the same message id until the budget is spent (each also retries
    // transient failures itself); cutting one short is safe: the next finds the job if
    // the cut one got through.
    let once = loop {
        let attempt =
            publish_request(js, &id, &event).instrument(tracing::info_span!("nats.publish", subject = %subject));
        let cut = deadline.min(tokio::time::Instant::now() + ATTEMPT);
        let last = match tokio::time::timeout_at(cut, attempt).await {
            Ok(Ok(once)) => {
                availability.succeeded();
                break once;
            }
            Ok(Err(e)) if !e.is_transient() => return Err(SubmitError::unavailable(Dependency::Queue, e)),
            Ok(Err(e)) => BoxError::from(e),
            Err(_) => BoxError::from(NoAnswer(ATTEMPT)),
        };
        if tokio::time::Instant::now() + PAUSE >= deadline {
            availability.failed(t0);
            return Err(SubmitError::Unavailable { dependency: Dependency::Queue, source: last });
        }
        tokio::time::sleep(PAUSE).await;
    };
    // The job was there: submitted before, or by an attempt of this very submit whose
    // answer was lost (an election cut it, or the publish retried): then the stored
    // request is this event (same time), and the job is new to the caller.
    let cached = once == Once::AlreadyThere && !stored_is(js, &subject, &event).await;
    let resp = SubmitResponse {
        status_url: format!("/v1/separations/{id}"),
        job_id: id,
        status: JobStatus::Queued,
        cached,
        urls: None,
    };
    Ok((resp, (!cached).then_some(event)))
}

/// Whether the request stored on `subject` is `event` itself (its time): `false` when it
/// is another submit's, or cannot be read.
async fn stored_is(js: &jetstream::Context, subject: &str, event: &Event) -> bool {
    let Ok(log) = js.get_stream_no_info(stemq_nats::JOBS_STREAM).await else { return false };
    match log.direct_get_last_for_subject(subject).await {
        Ok(m) => Event::from_slice(&m.payload).is_ok_and(|stored| stored.id == event.id && stored.time == event.time),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stemq_core::request::ANONYMOUS;
    use stemq_devkit::nats_server::NatsServer;

    fn event(time: chrono::DateTime<chrono::Utc>) -> Event {
        let req = JobRequest::from_value(serde_json::json!({"audio_uri": "file:///a.wav"})).unwrap();
        let mut e = Event::requested(req.normalize(ANONYMOUS).unwrap(), None, None, "/test");
        e.time = time;
        e
    }

    /// A submit whose own first attempt was stored but unanswered (an election) finds
    /// its job on the next attempt: that is still a new job to its caller (202, not
    /// `cached`). A later submit of the same job is `cached`.
    #[tokio::test]
    async fn a_retried_attempt_that_finds_its_own_request_is_not_cached() {
        let dir = tempfile::tempdir().unwrap();
        let server = NatsServer::start_with(
            dir.path(),
            stemq_devkit::nats_server::ServerOptions { auth: false, ..Default::default() },
        )
        .expect("nats-server >= 2.11 on PATH (scripts/install-nats.sh)");
        let client = stemq_nats::connect(&server.url(), "test").await.unwrap();
        let js = jetstream::new(client);
        stemq_nats::apply(&js, &Default::default()).await.unwrap();
        let first = event(chrono::Utc::now());
        // The lost attempt: stored, its answer never seen.
        assert!(matches!(publish_request(&js, &first.subject, &first).await.unwrap(), Once::Stored(_)));
        let (resp, queued) = queue(&js, first.clone()).await.unwrap();
        assert!(!resp.cached && queued.is_some(), "the caller's own job: {resp:?}");
        // Another submit of the same job, later.
        let (resp, queued) = queue(&js, event(chrono::Utc::now() + chrono::Duration::seconds(1))).await.unwrap();
        assert!(resp.cached && queued.is_none(), "submitted before: {resp:?}");
    }
}
