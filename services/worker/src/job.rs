//! One delivery of one job, from pull to ack.
//!
//! This module owns the order of side effects that makes a job run once in effect:
//!
//! 1. read the request event; an invalid one is `rejected`, a forged one (not hashing to
//!    its job id, or for another owner than its subject's) dropped, never run;
//! 2. if the job already has an outcome (a lost ack, a duplicate delivery), ack and skip
//!    (`skip.already_done`); if a cancel was requested or its start deadline passed, record
//!    that instead of running it. A first delivery asks by publishing `started` with the
//!    expectation that none of the job's one-token events is stored yet: a new job
//!    starts in that one round trip, and only when it is refused is the log looked up
//!    (one direct get tells both for a job with an earlier attempt);
//! 3. publish `started` (unless step 2 stored it); keep the ack deadline alive with
//!    progress acks;
//! 4. run the engine on a blocking thread, under the hard time limit, stepping down the
//!    out-of-memory ladder (smaller segment, then CPU) when it runs out of memory;
//! 5. store the stems and the manifest, then publish the outcome to the job's terminal
//!    subject (first terminal event wins), and only then ack (double ack);
//! 6. a transient failure publishes `failed(transient)` and naks with backoff, except on
//!    the last delivery, which dead-letters the job; a permanent failure is final at once.
//!
//! What a result *means* (steps 5 and 6) is one pure function, `decide`: the attempt,
//! the queue's max deliver, the backoff delay, whether a user's cancel came in, and the
//! engine's result in; the event to record and how to answer the delivery out
//! (`Decision`). `decide_start` says the same before the engine runs (cancelled,
//! expired). Both are tested given/when/then below; `run_delivery` only gathers their
//! inputs and carries their decisions out. Storing outputs lives in `outputs`, the
//! keepalive task in `keepalive`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use futures::future::OptionFuture;
use stemq_core::device::Device;
use stemq_core::engine::{EngineContext, EngineError, EngineJob};
use stemq_core::event::{
    Cancelled, DeadLettered, EventBody, Expired, Failed, FailureClass, FailureCode, Output, Rejected, Requested,
    Started, Succeeded,
};
use stemq_core::nats::{job_events_filter, job_id_of_subject, job_subject, SubjectKind};
use stemq_core::publish::{publish, publish_first_of, publish_once, First, Once};
use stemq_core::{Event, JobId};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::fetch::FetchError;
use crate::keepalive::spawn_keepalive;
use crate::outputs::{puts_in_flight, store_outputs, Stems};
use crate::{control, Shared};
use stemq_core::metrics::{metrics, JobLabels};

/// How long a first delivery's `started`, stored only while the job has no one-token
/// event, keeps retrying a transient failure (a leader election) before the worker
/// looks the job up instead and publishes `started` with the usual patience.
const STARTED_FIRST_PATIENCE: Duration = Duration::from_secs(2);

/// Handles one delivery; never panics, never leaves the message without an answer
/// unless the process dies (then `ack_wait` redelivers it).
pub(crate) async fn handle(
    shared: &Arc<Shared>,
    msg: jetstream::Message,
    queue: watch::Receiver<crate::QueueSettings>,
    hard_stop: &CancellationToken,
) {
    let info = match msg.info() {
        Ok(i) => (i.delivered.max(1) as u32, i.stream_sequence),
        Err(e) => {
            warn!(error = %e, "message without JetStream metadata; terminating it");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
    };
    let (attempt, seq) = info;
    let Some(job_id) = job_id_of_subject(&msg.subject) else {
        warn!(subject = %msg.subject, "not a job subject; terminating it");
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    let span = info_span!("job", job_id = %job_id, attempt, seq, trace_id = tracing::field::Empty);
    // Continue the request's trace (set before the span is first entered).
    // The payload is parsed once, here; validation below works on this result.
    let parsed = Event::from_slice(&msg.payload);
    let traceparent = parsed.as_ref().ok().and_then(|e| e.traceparent.as_deref());
    stemq_core::telemetry::set_parent(&span, traceparent);
    run_delivery(shared, msg, queue, parsed, job_id, attempt, seq, hard_stop).instrument(span).await
}

pub(crate) fn source(shared: &Shared) -> String {
    format!("/stemq/worker/{}", shared.config.name)
}

#[allow(clippy::too_many_arguments)]
async fn run_delivery(
    shared: &Arc<Shared>,
    msg: jetstream::Message,
    queue: watch::Receiver<crate::QueueSettings>,
    parsed: Result<Event, serde_json::Error>,
    job_id: JobId,
    attempt: u32,
    seq: u64,
    hard_stop: &CancellationToken,
) {
    // 1. The request must be a `requested` event whose request hashes to its subject.
    let Valid { requested, at: requested_at, traceparent } = match validate(parsed, &msg.subject, &job_id) {
        Ok(v) => v,
        Err(rejection) if !rejection.proves_the_job() => {
            // Not provably this job's request (anyone allowed to publish requests could
            // have put it on this job's subject): recording an outcome would end the
            // real job before it was ever submitted. Dropped for good; it stays in the
            // log, and the real request, when it comes, runs.
            let (code, message) = (rejection.code(), rejection.to_string());
            warn!(%code, %message, event = "request.dropped", "dropping a request that is not this job's");
            metrics().outcome("unknown", "dropped");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
        Err(rejection) => {
            let (code, message) = (rejection.code(), rejection.to_string());
            warn!(%code, %message, "rejecting request event");
            metrics().outcome("unknown", "rejected");
            let ev = Event::new(&job_id, &source(shared), EventBody::Rejected(Rejected { code, message }));
            finish(shared, &msg, &job_id, ev).await;
            return;
        }
    };
    let model = requested.request.model.as_str();

    // 2. Already done (a lost ack, a duplicate delivery), or cancelled before it
    // started? The log is the source of truth (no projector lag). Listen for a cancel
    // request first, so one that arrives from now on is not missed.
    let cancel = Arc::new(AtomicBool::new(false));
    let user_cancel = Arc::new(AtomicBool::new(false));
    let _registered = shared.running.register(&job_id, cancel.clone(), user_cancel.clone());
    let engine = shared.engine.clone();
    let devices: Vec<Device> = engine.devices();
    let first_device = devices.first().cloned().unwrap_or(Device::Cpu);
    let mut started = Event::new(
        &job_id,
        &source(shared),
        EventBody::Started(Started { attempt, worker: shared.config.name.clone(), device: first_device.clone() }),
    );
    started.traceparent = traceparent.clone();
    let started_subject = job_subject(&job_id, SubjectKind::Started);
    // With a message id of its own attempt, so a publish retried through a leader
    // election is stored once, and one lost with a dying node is retried, not dropped.
    let started_id = format!("{job_id}.started.{attempt}");
    // A first delivery within its deadline asks the log with `started` itself: stored
    // only while none of the job's one-token events (an earlier attempt, a cancel
    // request, an outcome) is, so a new job starts in one round trip, with no look-up.
    let new_job = attempt == 1 && decide_start(attempt, false, requested.start_before, chrono::Utc::now()).is_none();
    let started_first = new_job
        && match publish_first_of(
            &shared.js,
            &started_subject,
            &job_events_filter(&job_id),
            &started,
            &started_id,
            STARTED_FIRST_PATIENCE,
        )
        .await
        {
            Ok(First::Stored(_)) => true,
            // This attempt's message id already taken: an earlier delivery numbered 1
            // (a recreated consumer) may have ended the job, so the look-up decides.
            Ok(First::Duplicate | First::Occupied) => false,
            Err(e) => {
                debug!(error = %e, "started not stored first; looking the job up");
                false
            }
        };
    if !started_first {
        let recorded = match control::recorded(shared, &job_id).await {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "cannot check for an outcome or a cancel request; retrying later");
                let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
                return;
            }
        };
        if recorded.outcome {
            info!(event = "skip.already_done", "job already has an outcome; acking");
            let _ = msg.double_ack().await;
            return;
        }

        // 2b. Cancelled or past its start deadline? Then it never starts.
        let cancel_requested = recorded.cancel_requested;
        if let Some(body) = decide_start(attempt, cancel_requested, requested.start_before, chrono::Utc::now()) {
            match &body {
                EventBody::Expired(e) => {
                    info!(event = "job.expired", start_before = %e.start_before, "start deadline passed; not running it")
                }
                _ => info!(event = "job.cancelled", "cancel requested before start; not running it"),
            }
            metrics().outcome(model, body.kind());
            finish(shared, &msg, &job_id, Event::new(&job_id, &source(shared), body)).await;
            return;
        }
    }
    // The per-job limit, never above the worker's own.
    let time_limit = match requested.max_runtime {
        Some(s) => shared.config.time_limit.min(Duration::from_secs(s)),
        None => shared.config.time_limit,
    };

    // 3. Started (unless stored above), and keep the delivery alive while we work.
    if attempt == 1 {
        let waited = (started.time - requested_at).to_std().unwrap_or_default();
        let labels = JobLabels { model: model.into(), device: first_device.to_string() };
        metrics().queue_wait.get_or_create(&labels).observe(waited.as_secs_f64());
    }
    let js = shared.js.clone();
    let started_pub = (!started_first)
        .then(|| tokio::spawn(async move { publish(&js, &started_subject, &started, Some(&started_id)).await }));
    let t0 = Instant::now();

    let msg = Arc::new(msg);
    let (progress_tx, progress_rx) = watch::channel::<Option<(f32, String)>>(None);
    let max_deliver = queue.borrow().max_deliver;
    let keepalive = spawn_keepalive(shared, queue, msg.clone(), &job_id, attempt, progress_rx);
    // What the decision needs besides the engine's result (the backoff is drawn now,
    // so the decision stays a pure function).
    let given = |user_cancel: bool| Given {
        attempt,
        max_deliver,
        backoff: shared.config.backoff.delay(attempt),
        user_cancel,
        elapsed: t0.elapsed(),
        request_seq: seq,
    };

    // 4. The engine, under the time limit, down the out-of-memory ladder. The attempt's
    // future is never dropped while its engine may still run: past the limit the engine
    // is told to stop (an isolated one is killed if it does not), the failure is
    // recorded, and this loop takes no other job until the engine has let go of the
    // scratch folder.
    let work = run_engine(shared, &job_id, &requested, attempt, &devices, progress_tx, cancel.clone());
    tokio::pin!(work);
    let result = tokio::select! {
        r = tokio::time::timeout(time_limit, &mut work) => match r {
            Ok(r) => r,
            Err(_) => {
                cancel.store(true, Ordering::SeqCst);
                warn!(event = "job.time_limit", limit_s = time_limit.as_secs(), "time limit reached; stopping the engine");
                keepalive.abort();
                let failure = Failure::permanent(
                    FailureCode::TimeLimit,
                    format!("the job ran longer than the {} s limit", time_limit.as_secs()),
                );
                // The time limit is what stopped it, even if a cancel came in meanwhile.
                execute(shared, &msg, &job_id, model, attempt, decide(&given(false), Err(failure))).await;
                // Wait for the engine to stop before this loop may take another job.
                let t = Instant::now();
                let _ = work.await;
                info!(waited_ms = t.elapsed().as_millis() as u64, "the engine stopped after the time limit");
                return;
            }
        },
        _ = hard_stop.cancelled() => {
            cancel.store(true, Ordering::SeqCst);
            keepalive.abort();
            warn!("shutdown grace period over: handing the job back");
            let _ = msg.ack_with(AckKind::Nak(None)).await;
            return;
        }
    };
    keepalive.abort();
    if let Some(Ok(Err(e))) = OptionFuture::from(started_pub).await {
        warn!(error = %e, "started event not stored");
    }

    // 5./6. Outcome, then ack.
    let given = given(user_cancel.load(Ordering::SeqCst));
    if let Ok(done) = &result {
        let labels = JobLabels { model: model.into(), device: done.device.to_string() };
        let elapsed = given.elapsed.as_secs_f64();
        metrics().job_duration.get_or_create(&labels).observe(elapsed);
        if let Some(audio) = done.audio_secs.filter(|s| *s > 0.0) {
            metrics().realtime_factor.get_or_create(&labels).observe(elapsed / audio);
        }
    }
    execute(shared, &msg, &job_id, model, attempt, decide(&given, result)).await;
}

/// Carries out a [`Decision`] about delivery `attempt`: logs it, counts it, records its
/// event and answers the delivery.
async fn execute(
    shared: &Shared,
    msg: &jetstream::Message,
    job_id: &JobId,
    model: &str,
    attempt: u32,
    decision: Decision,
) {
    metrics().outcome(model, decision.outcome_label());
    let ack = decision.ack();
    match decision {
        Decision::Outcome { body, discard_outputs } => {
            match &body {
                EventBody::Succeeded(s) => {
                    info!(event = "job.succeeded", duration_ms = s.duration_ms, degraded = s.degraded)
                }
                EventBody::Failed(f) => {
                    info!(event = "job.failed", code = %f.code, message = %f.message, "permanent failure")
                }
                EventBody::DeadLettered(d) => {
                    warn!(event = "job.dead_lettered", last_error = ?d.last_error, "last delivery failed")
                }
                EventBody::Cancelled(_) => info!(event = "job.cancelled", "cancelled while running; outputs discarded"),
                _ => {}
            }
            if !matches!(body, EventBody::Cancelled(_)) {
                metrics().deliveries.observe(attempt as f64);
            }
            if discard_outputs {
                // Stopped on request (or finished just as the request came): keep nothing.
                control::discard_outputs(shared, job_id).await;
            }
            // Acks once the outcome is stored (`AckAction::AckAfterOutcome`).
            finish(shared, msg, job_id, Event::new(job_id, &source(shared), body)).await;
        }
        Decision::Retry { failed, delay } => {
            info!(event = "job.retry", code = %failed.code, message = %failed.message, delay_ms = delay.as_millis() as u64);
            let ev = Event::new(job_id, &source(shared), EventBody::Failed(failed));
            if let Err(e) = publish(&shared.js, &job_subject(job_id, SubjectKind::Failed), &ev, None).await {
                warn!(error = %e, "failure event not stored");
            }
        }
    }
    if let AckAction::NakAfter(delay) = ack {
        let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
    }
}

/// What the decision about an attempt's result knows besides the result itself: plain
/// values, read by the caller (the clock and the backoff's jitter included).
#[derive(Debug, Clone, PartialEq)]
struct Given {
    /// This delivery, from 1.
    attempt: u32,
    /// The queue's `max_deliver`: the delivery after which a transient failure
    /// dead-letters the job instead of retrying.
    max_deliver: u32,
    /// How long to wait before the next delivery after a transient failure.
    backoff: Duration,
    /// True when a user's cancel request came in while the attempt ran.
    user_cancel: bool,
    /// Wall time of the attempt so far.
    elapsed: Duration,
    /// Stream sequence of the request (for the dead letter's replay).
    request_seq: u64,
}

/// What to record about an attempt, and how to answer its delivery.
#[derive(Debug, Clone, PartialEq)]
enum Decision {
    /// Record this terminal event on the job's outcome subject (first one wins), then
    /// ack. With `discard_outputs`, delete what the attempt stored first.
    Outcome { body: EventBody, discard_outputs: bool },
    /// Record this transient failure, then nak the delivery with `delay`.
    Retry { failed: Failed, delay: Duration },
}

/// How a [`Decision`] answers the delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AckAction {
    /// Ack once the outcome is stored (if it is not, nak and let the delivery come back).
    AckAfterOutcome,
    /// Nak with this delay once the failure is recorded.
    NakAfter(Duration),
}

impl Decision {
    fn ack(&self) -> AckAction {
        match self {
            Decision::Outcome { .. } => AckAction::AckAfterOutcome,
            Decision::Retry { delay, .. } => AckAction::NakAfter(*delay),
        }
    }

    /// The `outcome` label of `stemq_jobs_total`.
    fn outcome_label(&self) -> &'static str {
        match self {
            Decision::Outcome { body: EventBody::Succeeded(s), .. } if s.degraded => "degraded",
            Decision::Outcome { body: EventBody::Failed(_), .. } => "failed_permanent",
            Decision::Outcome { body, .. } => body.kind(),
            Decision::Retry { .. } => "failed_transient",
        }
    }
}

/// What a delivery comes to before it starts, if it must not run: cancelled (a cancel
/// request is in the log) or expired (`start_before` is before `now`).
fn decide_start(
    attempt: u32,
    cancel_requested: bool,
    start_before: Option<chrono::DateTime<chrono::Utc>>,
    now: chrono::DateTime<chrono::Utc>,
) -> Option<EventBody> {
    if cancel_requested {
        return Some(EventBody::Cancelled(Cancelled { attempt, interrupted: false }));
    }
    match start_before {
        Some(deadline) if now > deadline => Some(EventBody::Expired(Expired { start_before: deadline })),
        _ => None,
    }
}

/// What an attempt's result means: the one decision of this module, a pure function.
///
/// - a user's cancel wins over any result: `cancelled` (interrupted), outputs discarded;
/// - success: `succeeded` (`degraded` when the memory ladder stepped down);
/// - a permanent failure: `failed` (permanent), final at once;
/// - a transient failure on the last delivery: `dead_lettered` (`max_deliveries`, with
///   the failure as `last_error`);
/// - any other transient failure: `failed` (transient, with `retry_in_ms`), then a nak
///   with the backoff delay.
fn decide(given: &Given, result: Result<Done, Failure>) -> Decision {
    let attempt = given.attempt;
    if given.user_cancel {
        return Decision::Outcome {
            body: EventBody::Cancelled(Cancelled { attempt, interrupted: true }),
            discard_outputs: true,
        };
    }
    let body = match result {
        Ok(done) => EventBody::Succeeded(Succeeded {
            attempt,
            outputs: done.outputs,
            manifest_uri: Some(done.manifest_uri),
            degraded: done.degraded,
            device: done.device,
            segment: done.segment,
            duration_ms: given.elapsed.as_millis() as u64,
            audio_ms: done.audio_secs.map(|s| (s * 1000.0).round() as u64),
        }),
        Err(f) if f.class == FailureClass::Permanent => EventBody::Failed(Failed {
            attempt,
            class: FailureClass::Permanent,
            code: f.code,
            message: f.message,
            retry_in_ms: None,
        }),
        Err(f) if attempt >= given.max_deliver => EventBody::DeadLettered(DeadLettered {
            deliveries: attempt,
            reason: FailureCode::MaxDeliveries,
            last_error: Some(format!("{}: {}", f.code, f.message)),
            request_seq: given.request_seq,
        }),
        Err(f) => {
            return Decision::Retry {
                failed: Failed {
                    attempt,
                    class: FailureClass::Transient,
                    code: f.code,
                    message: f.message,
                    retry_in_ms: Some(given.backoff.as_millis() as u64),
                },
                delay: given.backoff,
            }
        }
    };
    Decision::Outcome { body, discard_outputs: false }
}

/// Publishes a terminal event (first one wins) and acks. If the publish fails we do not
/// ack: the delivery comes back and tries again.
async fn finish(shared: &Shared, msg: &jetstream::Message, job_id: &JobId, mut ev: Event) {
    let _span = info_span!("publish_outcome", kind = ev.body.kind()).entered();
    ev.traceparent = stemq_core::telemetry::current_traceparent();
    drop(_span);
    let subject = job_subject(job_id, SubjectKind::Outcome);
    match publish_once(&shared.js, &subject, &ev, &format!("{job_id}.outcome")).await {
        Ok(Once::Stored(_)) => {}
        Ok(Once::AlreadyThere) => {
            info!(event = "skip.already_done", "another outcome was recorded first");
            // A cancel that won the race against our success: its outputs must go.
            if matches!(ev.body, EventBody::Succeeded(_)) && outcome_is_cancelled(shared, job_id).await {
                control::discard_outputs(shared, job_id).await;
            }
        }
        Err(e) => {
            warn!(error = %e, "outcome not stored; the job will be redelivered");
            let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
            return;
        }
    }
    // A plain ack is enough: the outcome is already stored, so if this ack is lost the
    // redelivery finds the outcome and is skipped (step 2) — the job never runs twice.
    if let Err(e) = msg.ack().await {
        warn!(error = %e, "ack not sent; a redelivery will be skipped");
    }
}

async fn outcome_is_cancelled(shared: &Shared, job_id: &JobId) -> bool {
    match stemq_core::read::outcome::outcome(&shared.js, job_id, stemq_core::read::outcome::From::Replica).await {
        Ok(Some(m)) => {
            Event::from_slice(&m.payload).map(|e| matches!(e.body, EventBody::Cancelled(_))).unwrap_or(false)
        }
        _ => false,
    }
}

/// A delivered request that checks out: the request, when it was recorded, and the
/// trace context it carries.
#[derive(Debug)]
struct Valid {
    requested: Requested,
    at: chrono::DateTime<chrono::Utc>,
    traceparent: Option<String>,
}

/// Why a delivered request is never run: recorded as the job's `rejected` outcome with
/// [`Rejection::code`] and the message when the request is the job's own
/// ([`Rejection::proves_the_job`]), dropped otherwise.
#[derive(Debug, thiserror::Error)]
enum Rejection {
    /// The payload is not a stemq CloudEvent.
    #[error("not a stemq CloudEvent: {0}")]
    NotAnEvent(#[source] serde_json::Error),
    /// A CloudEvent, but not a `requested` one.
    #[error("expected a requested event, got {0}")]
    NotARequest(&'static str),
    /// The request does not hash to the id its subject and event claim (forged).
    #[error("the request hashes to {computed}, but the event claims {claimed} (subject/id)")]
    IdMismatch { computed: JobId, claimed: JobId },
    /// The request names another owner than the owner token of its subject: published
    /// by someone allowed to publish for that token's owner only (a publisher).
    #[error(transparent)]
    OwnerMismatch(#[from] stemq_core::nats::OwnerMismatch),
    /// The request was routed into another pool or lane than its body names.
    #[error(transparent)]
    RouteMismatch(#[from] stemq_core::nats::RouteMismatch),
    /// The request is invalid, or valid but not as the ingress would have normalised it
    /// (a raw publisher bypassed the ingress).
    #[error("{0}")]
    Invalid(#[source] stemq_core::request::RequestError),
}

impl Rejection {
    /// True when the request is provably the job's own (it hashes to the job's id and
    /// its owner is its subject's): only then may the job be recorded `rejected`.
    /// Otherwise the request is dropped with no outcome, so a forged or garbled request
    /// on someone else's job subject cannot end their job in advance.
    fn proves_the_job(&self) -> bool {
        matches!(self, Rejection::Invalid(_))
    }

    /// The `code` of the `rejected` outcome.
    fn code(&self) -> FailureCode {
        match self {
            Rejection::NotAnEvent(_) | Rejection::NotARequest(_) => FailureCode::InvalidEvent,
            Rejection::IdMismatch { .. } => FailureCode::IdMismatch,
            Rejection::OwnerMismatch(_) => FailureCode::OwnerMismatch,
            Rejection::RouteMismatch(_) => FailureCode::RouteMismatch,
            Rejection::Invalid(_) => FailureCode::InvalidRequest,
        }
    }
}

/// Checks a delivered request: a `requested` event whose request hashes to its subject
/// and id, whose owner is the owner token of its subject (when the subject has one), and
/// which is a valid request in normalised form.
fn validate(parsed: Result<Event, serde_json::Error>, subject: &str, job_id: &JobId) -> Result<Valid, Rejection> {
    let ev = parsed.map_err(Rejection::NotAnEvent)?;
    let EventBody::Requested(r) = ev.body else {
        return Err(Rejection::NotARequest(ev.body.kind()));
    };
    let computed = r.request.job_id();
    if &computed != job_id || &ev.subject != job_id || ev.id != job_id.as_str() {
        return Err(Rejection::IdMismatch { computed, claimed: job_id.clone() });
    }
    stemq_core::nats::check_request_owner(subject, &r.request.owner)?;
    stemq_core::nats::check_request_route(subject, r.request.model, r.lane())?;
    // Re-validate the request itself: a raw publisher bypasses the ingress.
    r.request.revalidate(r.webhook.as_ref(), r.metadata.as_ref(), r.max_runtime).map_err(Rejection::Invalid)?;
    Ok(Valid { requested: r, at: ev.time, traceparent: ev.traceparent })
}

/// A failed attempt, classified.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Failure {
    class: FailureClass,
    code: FailureCode,
    message: String,
}

impl Failure {
    pub(crate) fn permanent(code: FailureCode, message: String) -> Failure {
        Failure { class: FailureClass::Permanent, code, message }
    }
    pub(crate) fn transient(code: FailureCode, message: String) -> Failure {
        Failure { class: FailureClass::Transient, code, message }
    }
}

/// A successful attempt: what it stored and how.
#[derive(Debug, Clone, PartialEq)]
struct Done {
    /// Length of the separated audio, when the engine reports it.
    audio_secs: Option<f64>,
    outputs: Vec<Output>,
    manifest_uri: String,
    degraded: bool,
    device: Device,
    segment: Option<f64>,
}

struct Ctx {
    progress: watch::Sender<Option<(f32, String)>>,
    cancel: Arc<AtomicBool>,
}

impl EngineContext for Ctx {
    fn progress(&self, fraction: f32, stage: &str) {
        let _ = self.progress.send(Some((fraction.clamp(0.0, 1.0), stage.to_string())));
    }
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// The rungs of the out-of-memory ladder: (device, segment).
fn ladder(devices: &[Device], requested: Option<f64>, max_segment: Option<f64>) -> Vec<(Device, Option<f64>)> {
    let first = devices.first().cloned().unwrap_or(Device::Cpu);
    let mut rungs = vec![(first.clone(), requested)];
    let base = requested.or(max_segment);
    if let Some(b) = base {
        rungs.push((first.clone(), Some((b / 2.0).max(1.0))));
    }
    if !first.is_cpu() && devices.iter().any(Device::is_cpu) {
        rungs.push((Device::Cpu, requested));
    }
    rungs
}

async fn run_engine(
    shared: &Arc<Shared>,
    job_id: &JobId,
    requested: &Requested,
    attempt: u32,
    devices: &[Device],
    progress: watch::Sender<Option<(f32, String)>>,
    cancel: Arc<AtomicBool>,
) -> Result<Done, Failure> {
    if attempt > 1 {
        // A redelivery: some attempt may have died without cleaning up.
        let shared = shared.clone();
        let _ = tokio::task::spawn_blocking(move || shared.scratch.sweep()).await;
    }
    let dir = shared.scratch.attempt_dir(job_id.as_str(), attempt);
    // Removed when the attempt ends, if it was made: an engine that neither reads its
    // input nor writes files (stems in memory) never makes one.
    let mut cleanup = ScratchDir { path: dir.clone(), made: false };
    let out_dir = dir.join("out");
    let make_out_dir = |out_dir: &Path| {
        std::fs::create_dir_all(out_dir)
            .map_err(|e| Failure::transient(FailureCode::Scratch, format!("cannot create {}: {e}", out_dir.display())))
    };
    let input = if shared.engine.reads_input() {
        cleanup.made = true;
        let out = out_dir.clone();
        tokio::task::spawn_blocking(move || make_out_dir(&out)).await.map_err(|e| {
            Failure::transient(FailureCode::Scratch, format!("cannot create the scratch folder: {e}"))
        })??;
        fetch_input(shared, &requested.request.audio_uri, &requested.request.owner, &dir)
            .instrument(info_span!("fetch_input"))
            .await?
    } else {
        dir.join("input")
    };
    // Paid for before any engine time is spent (nothing happens when credits are off).
    crate::credits::reserve(shared, job_id, requested, &input).await?;

    let ctx = Arc::new(Ctx { progress, cancel });
    let rungs = ladder(devices, requested.request.segment, requested.request.model.max_segment());
    // The last rung's refusal decides the failure: a real out-of-memory may pass later
    // (memory freed elsewhere), a budget refusal will not.
    let mut last_oom = EngineError::OutOfMemory { device: String::new() };
    for (i, (device, segment)) in rungs.iter().enumerate() {
        let engine = shared.engine.clone();
        let (job_id2, req, input2, out2, dev, ctx2) =
            (job_id.clone(), requested.clone(), input.clone(), out_dir.clone(), device.clone(), ctx.clone());
        let segment = *segment;
        let engine_span = info_span!("engine.separate", %device, segment = ?segment);
        // One hand-off to a blocking thread per rung: the engine keeps its stems in
        // memory, or the output folder is made there and the engine writes files.
        let (wrote_files, res) = tokio::task::spawn_blocking(move || {
            let _entered = engine_span.entered();
            let job = EngineJob {
                job_id: &job_id2,
                request: &req.request,
                metadata: stemq_core::engine::metadata_for(engine.as_ref(), req.metadata.as_ref()),
                attempt,
                input: &input2,
                out_dir: &out2,
                device: &dev,
                segment,
            };
            if let Some(res) = engine.separate_in_memory(&job, ctx2.as_ref()) {
                return (false, Ok(res.map(Stems::Memory)));
            }
            if let Err(f) = make_out_dir(&out2) {
                return (true, Err(f));
            }
            (true, Ok(engine.separate(&job, ctx2.as_ref()).map(Stems::Files)))
        })
        .await
        .map_err(|e| Failure::transient(FailureCode::EnginePanic, format!("the engine crashed: {e}")))?;
        cleanup.made |= wrote_files;
        match res? {
            Ok(_) if ctx.cancel.load(Ordering::SeqCst) => {
                // Stopped from outside (time limit, cancel) just as it finished: store nothing.
                return Err(Failure::permanent(FailureCode::Cancelled, "the attempt was stopped".into()));
            }
            Ok(stems) => {
                let degraded = i > 0;
                if degraded {
                    warn!(event = "job.degraded", %device, ?segment, "finished on a lower rung of the memory ladder");
                }
                let audio_secs = stems.first_audio().map(|a| a.secs());
                let span = info_span!("store_outputs", stems = stems.len());
                let store = &shared.config.store;
                let in_flight = puts_in_flight(store, &stems);
                let (outputs, manifest_uri) =
                    store_outputs(store, in_flight, job_id, requested, stems, device, degraded)
                        .instrument(span)
                        .await?;
                return Ok(Done { audio_secs, outputs, manifest_uri, degraded, device: device.clone(), segment });
            }
            Err(e @ (EngineError::OutOfMemory { .. } | EngineError::OverBudget { .. })) => {
                warn!(event = "job.oom", %device, ?segment, error = %e, "out of memory; stepping down");
                last_oom = e;
                // Nothing partial may survive into the next rung.
                if wrote_files {
                    let _ = tokio::fs::remove_dir_all(&out_dir).await;
                }
            }
            Err(e) => return Err(classify(e)),
        }
    }
    Err(match last_oom {
        EngineError::OverBudget { device, needed, budget } => Failure::permanent(
            FailureCode::OverMemoryBudget,
            format!(
                "does not fit the memory budget on {device} at any rung of the ladder (the smallest needs about \
                 {needed} bytes, the budget is {budget})"
            ),
        ),
        e => Failure::transient(FailureCode::OutOfMemory, format!("{e} at every rung")),
    })
}

fn classify(e: EngineError) -> Failure {
    match e {
        EngineError::InvalidInput { code, message } => Failure::permanent(code, message),
        EngineError::Unsupported { code, message } => Failure::permanent(code, message),
        EngineError::Transient(m) => Failure::transient(FailureCode::EngineError, m),
        // The attempt's own process died: this job, and only it, pays an attempt.
        EngineError::Crashed(m) => Failure::transient(FailureCode::EngineCrashed, m),
        EngineError::Cancelled => Failure::permanent(FailureCode::Cancelled, "the job was cancelled".into()),
        EngineError::OutOfMemory { device } => {
            Failure::transient(FailureCode::OutOfMemory, format!("out of memory on {device}"))
        }
        e @ EngineError::OverBudget { .. } => Failure::permanent(FailureCode::OverMemoryBudget, e.to_string()),
    }
}

/// Streams the input to local scratch, chunk by chunk. Only the owner's own uploads in
/// the configured store are read (the same policy as the ingress: no traversal, no other
/// store, no other owner's objects; a raw publisher bypasses the ingress), and http(s)
/// URLs where the operator allows external audio (`fetch`, under the address policy
/// again).
async fn fetch_input(shared: &Shared, uri: &str, owner: &str, dir: &Path) -> Result<PathBuf, Failure> {
    let path = dir.join("input");
    let t0 = Instant::now();
    if let Some(urls) = shared.config.audio_urls.as_ref().filter(|_| stemq_core::uri::is_web_url(uri)) {
        let bytes = crate::fetch::fetch(urls, uri, &path).await.map_err(Failure::from)?;
        info!(event = "input.fetched", bytes, ms = t0.elapsed().as_millis() as u64, from = "url", "input fetched");
        return Ok(path);
    }
    let store = &shared.config.store;
    let (_, key) = stemq_core::uri::store_key(uri, &[store.base_url().to_string()])
        .and_then(|(i, key)| stemq_core::uri::check_owned(key, owner).map(|_| (i, key)))
        .map_err(|e| Failure::permanent(FailureCode::InputNotAllowed, e.message))?;
    let bytes = store.get_to_file(key, &path).await.map_err(|e| match e {
        e if e.is_not_found() => Failure::permanent(FailureCode::InputNotFound, format!("{uri} does not exist")),
        e @ stemq_core::storage::StorageError::Io { .. } => Failure::transient(FailureCode::Scratch, e.to_string()),
        e => Failure::transient(FailureCode::Storage, e.to_string()),
    })?;
    info!(event = "input.fetched", bytes, ms = t0.elapsed().as_millis() as u64, "input fetched");
    Ok(path)
}

/// What a failed fetch of an input URL means: refused URLs, 4xx answers and too-large
/// inputs are permanent; 5xx, 408, 429, timeouts, connection and DNS errors transient.
impl From<FetchError> for Failure {
    fn from(e: FetchError) -> Failure {
        let message = stemq_core::error::report(&e);
        let status_transient = |s: &reqwest::StatusCode| s.is_server_error() || s.as_u16() == 408 || s.as_u16() == 429;
        match &e {
            FetchError::Policy { source, .. } if source.is_transient() => {
                Failure::transient(FailureCode::InputFetch, message)
            }
            FetchError::Policy { .. } => Failure::permanent(FailureCode::InputNotAllowed, message),
            FetchError::Status { status, .. } if matches!(status.as_u16(), 404 | 410) => {
                Failure::permanent(FailureCode::InputNotFound, message)
            }
            FetchError::Status { status, .. } if status_transient(status) => {
                Failure::transient(FailureCode::InputFetch, message)
            }
            FetchError::Status { .. } | FetchError::BadRedirect { .. } | FetchError::TooManyRedirects { .. } => {
                Failure::permanent(FailureCode::InputFetch, message)
            }
            FetchError::TooLarge { .. } => Failure::permanent(FailureCode::InputTooLarge, message),
            FetchError::Http { .. } => Failure::transient(FailureCode::InputFetch, message),
            FetchError::Write { .. } => Failure::transient(FailureCode::Scratch, message),
        }
    }
}

/// An attempt's scratch folder: removed when the attempt ends, however it ends, once
/// it was `made`.
struct ScratchDir {
    path: PathBuf,
    made: bool,
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if self.made {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use stemq_core::request::{JobRequest, Model, Priority, ANONYMOUS};

    /// The routed subject of an interactive `htdemucs` request (what [`requested`] is).
    fn request_subject(id: &JobId, owner: &str) -> String {
        stemq_core::nats::request_subject(id, owner, Model::Htdemucs, Priority::Interactive)
    }

    fn requested() -> Event {
        let n = JobRequest::from_value(json!({"audio_uri": "file:///a.wav"})).unwrap().normalize(ANONYMOUS).unwrap();
        Event::requested(n, None, None, "/test")
    }

    #[test]
    fn validate_accepts_a_request_that_hashes_to_its_id() {
        let ev = requested();
        let id = ev.subject.clone();
        let valid = validate(Ok(ev.clone()), &request_subject(&id, ANONYMOUS), &id).expect("valid");
        assert_eq!(valid.requested.request.job_id(), id);
        // A request recorded before owner tokens is still run.
        assert!(validate(Ok(ev.clone()), &job_subject(&id, SubjectKind::Requested), &id).is_ok());
        // Routed into another pool or lane: refused (another pool's worker may not run it).
        for (model, lane) in [(Model::Dsp, Priority::Interactive), (Model::Htdemucs, Priority::Batch)] {
            let wrong = stemq_core::nats::request_subject(&id, ANONYMOUS, model, lane);
            let e = validate(Ok(ev.clone()), &wrong, &id).unwrap_err();
            assert_eq!(e.code(), FailureCode::RouteMismatch, "{e:?}");
        }
    }

    #[test]
    fn validate_rejects_a_request_for_another_owner_than_its_subjects() {
        let ev = requested();
        let id = ev.subject.clone();
        let e = validate(Ok(ev), &request_subject(&id, "acme"), &id).unwrap_err();
        assert!(matches!(e, Rejection::OwnerMismatch(_)), "{e:?}");
        assert_eq!(e.code(), FailureCode::OwnerMismatch);
        assert!(e.to_string().contains("`anonymous`") && e.to_string().contains("`acme`"), "{e}");
    }

    #[test]
    fn validate_rejects_with_a_code_per_reason() {
        let ev = requested();
        let other = JobId::parse(&"0".repeat(64)).unwrap();
        let e = validate(Ok(ev.clone()), &request_subject(&other, ANONYMOUS), &other).unwrap_err();
        assert!(matches!(e, Rejection::IdMismatch { .. }), "{e:?}");
        assert_eq!(e.code(), FailureCode::IdMismatch);

        // Hashes to its id, but is not a request the ingress would accept.
        let mut n = match &ev.body {
            EventBody::Requested(r) => r.request.clone(),
            _ => unreachable!(),
        };
        n.audio_uri = format!(" {} ", n.audio_uri);
        let unnormalised = Event::requested(n.clone(), None, None, "/test");
        let id = unnormalised.subject.clone();
        let e = validate(Ok(unnormalised), &request_subject(&id, ANONYMOUS), &id).unwrap_err();
        assert!(matches!(e, Rejection::Invalid(_)), "{e:?}");
        assert_eq!(e.code(), FailureCode::InvalidRequest);
        assert!(e.to_string().starts_with("invalid `audio_uri`: "), "{e}");

        // Valid, but a default written out where the ingress leaves it absent.
        n.audio_uri = n.audio_uri.trim().to_string();
        n.segment = n.model.max_segment();
        let spelled_out = Event::requested(n, None, None, "/test");
        let id = spelled_out.subject.clone();
        let e = validate(Ok(spelled_out), &request_subject(&id, ANONYMOUS), &id).unwrap_err();
        assert_eq!(e.code(), FailureCode::InvalidRequest);
        assert!(e.to_string().starts_with("invalid `request`: not in normalised form"), "{e}");

        let not_json = serde_json::from_slice::<Event>(b"{").map(|_| unreachable!());
        let e = validate(not_json, &request_subject(&ev.subject, ANONYMOUS), &ev.subject).unwrap_err();
        assert_eq!(e.code(), FailureCode::InvalidEvent);
        assert!(e.to_string().starts_with("not a stemq CloudEvent: "), "{e}");

        let started = Event::new(
            &ev.subject,
            "/test",
            EventBody::Started(Started { attempt: 1, worker: "w".into(), device: "cpu".into() }),
        );
        let e = validate(Ok(started), &request_subject(&ev.subject, ANONYMOUS), &ev.subject).unwrap_err();
        assert_eq!(e.code(), FailureCode::InvalidEvent);
        assert_eq!(e.to_string(), "expected a requested event, got started");
    }

    #[test]
    fn fetch_errors_are_classified_with_their_codes() {
        use reqwest::StatusCode;
        use stemq_core::netpolicy::UrlError;
        let url = || "https://a.example/x.wav".to_string();
        let status = |s: u16| FetchError::Status { url: url(), status: StatusCode::from_u16(s).unwrap() };
        let cases: Vec<(FetchError, FailureClass, FailureCode)> = vec![
            (
                FetchError::Policy { url: url(), source: UrlError::HostNotAllowed("a.example".into()) },
                FailureClass::Permanent,
                FailureCode::InputNotAllowed,
            ),
            (
                FetchError::Policy {
                    url: url(),
                    source: UrlError::Resolve { host: "a.example".into(), message: "no".into() },
                },
                FailureClass::Transient,
                FailureCode::InputFetch,
            ),
            (status(404), FailureClass::Permanent, FailureCode::InputNotFound),
            (status(410), FailureClass::Permanent, FailureCode::InputNotFound),
            (status(403), FailureClass::Permanent, FailureCode::InputFetch),
            (status(429), FailureClass::Transient, FailureCode::InputFetch),
            (status(503), FailureClass::Transient, FailureCode::InputFetch),
            (FetchError::TooManyRedirects { url: url(), max: 5 }, FailureClass::Permanent, FailureCode::InputFetch),
            (FetchError::TooLarge { url: url(), limit: 10 }, FailureClass::Permanent, FailureCode::InputTooLarge),
            (
                FetchError::Http { url: url(), message: "timed out".into() },
                FailureClass::Transient,
                FailureCode::InputFetch,
            ),
        ];
        for (e, class, code) in cases {
            let text = e.to_string();
            let f = Failure::from(e);
            assert_eq!((f.class, &f.code), (class, &code), "{text}");
            assert!(f.message.contains("a.example"), "{}", f.message);
        }
    }

    #[test]
    fn ladder_steps_segment_then_cpu() {
        let gpu = Device::Cuda(Some(0));
        let devs = vec![gpu.clone(), Device::Cpu];
        assert_eq!(
            ladder(&devs, None, Some(7.8)),
            vec![(gpu.clone(), None), (gpu.clone(), Some(3.9)), (Device::Cpu, None)]
        );
        let cpu_only = vec![Device::Cpu];
        assert_eq!(ladder(&cpu_only, Some(4.0), Some(7.8)), vec![(Device::Cpu, Some(4.0)), (Device::Cpu, Some(2.0))]);
        assert_eq!(ladder(&cpu_only, None, None), vec![(Device::Cpu, None)]);
        // The fake engine's GPU is not the CPU; an engine without a CPU has no CPU rung.
        let fake = Device::from("fake-gpu");
        assert_eq!(ladder(&[fake.clone(), Device::Cpu], None, None), vec![(fake.clone(), None), (Device::Cpu, None)]);
        assert_eq!(ladder(std::slice::from_ref(&fake), None, None), vec![(fake, None)]);
        assert_eq!(ladder(&[], None, None), vec![(Device::Cpu, None)]);
    }

    #[test]
    fn engine_errors_are_classified_with_their_codes() {
        let f = classify(EngineError::InvalidInput { code: FailureCode::InvalidAudio, message: "m".into() });
        assert_eq!((f.class, f.code), (FailureClass::Permanent, FailureCode::InvalidAudio));
        let f = classify(EngineError::Unsupported { code: "brand_new".into(), message: "m".into() });
        assert_eq!((f.class, f.code), (FailureClass::Permanent, FailureCode::Other("brand_new".into())));
        let f = classify(EngineError::Transient("m".into()));
        assert_eq!((f.class, f.code), (FailureClass::Transient, FailureCode::EngineError));
        let f = classify(EngineError::Crashed("m".into()));
        assert_eq!((f.class, f.code), (FailureClass::Transient, FailureCode::EngineCrashed));
        let f = classify(EngineError::OutOfMemory { device: "cuda:0".into() });
        assert_eq!((f.class, f.code), (FailureClass::Transient, FailureCode::OutOfMemory));
        let f = classify(EngineError::OverBudget { device: "cpu".into(), needed: 2, budget: 1 });
        assert_eq!((f.class, f.code), (FailureClass::Permanent, FailureCode::OverMemoryBudget));
        let f = classify(EngineError::Cancelled);
        assert_eq!((f.class, f.code), (FailureClass::Permanent, FailureCode::Cancelled));
    }

    // The decision, given / when / then.

    /// Given: delivery `attempt` of a queue that delivers at most 3 times, 4 s backoff.
    fn given(attempt: u32) -> Given {
        Given {
            attempt,
            max_deliver: 3,
            backoff: Duration::from_secs(4),
            user_cancel: false,
            elapsed: Duration::from_millis(1500),
            request_seq: 42,
        }
    }

    fn done(degraded: bool) -> Done {
        Done {
            audio_secs: Some(10.0),
            outputs: vec![Output {
                stem: "vocals".into(),
                uri: "file:///o/v.wav".into(),
                bytes: 3,
                sha256: "ab".into(),
            }],
            manifest_uri: "file:///o/manifest.json".into(),
            degraded,
            device: if degraded { Device::Cpu } else { Device::Cuda(Some(0)) },
            segment: if degraded { Some(3.9) } else { None },
        }
    }

    fn transient() -> Failure {
        Failure::transient(FailureCode::Storage, "the store is down".into())
    }

    fn outcome(d: &Decision) -> &EventBody {
        match d {
            Decision::Outcome { body, .. } => body,
            Decision::Retry { .. } => panic!("expected an outcome, got {d:?}"),
        }
    }

    #[test]
    fn given_success_when_decided_then_succeeded_and_ack() {
        let d = decide(&given(1), Ok(done(false)));
        assert_eq!(d.ack(), AckAction::AckAfterOutcome);
        assert_eq!(d.outcome_label(), "succeeded");
        let EventBody::Succeeded(s) = outcome(&d) else { panic!("{d:?}") };
        assert_eq!(s.attempt, 1);
        assert_eq!((s.device.to_string().as_str(), s.degraded, s.segment), ("cuda:0", false, None));
        assert_eq!(s.duration_ms, 1500);
        assert_eq!(s.manifest_uri.as_deref(), Some("file:///o/manifest.json"));
        assert_eq!(s.outputs.len(), 1);
        assert!(matches!(d, Decision::Outcome { discard_outputs: false, .. }));
    }

    #[test]
    fn given_success_down_the_ladder_when_decided_then_succeeded_degraded() {
        let d = decide(&given(2), Ok(done(true)));
        assert_eq!(d.outcome_label(), "degraded");
        let EventBody::Succeeded(s) = outcome(&d) else { panic!("{d:?}") };
        assert_eq!((s.attempt, &s.device, s.degraded, s.segment), (2, &Device::Cpu, true, Some(3.9)));
    }

    #[test]
    fn given_a_user_cancel_when_the_engine_succeeded_anyway_then_cancelled_and_outputs_discarded() {
        let g = Given { user_cancel: true, ..given(2) };
        let d = decide(&g, Ok(done(false)));
        assert_eq!(
            d,
            Decision::Outcome {
                body: EventBody::Cancelled(Cancelled { attempt: 2, interrupted: true }),
                discard_outputs: true
            }
        );
        assert_eq!(d.ack(), AckAction::AckAfterOutcome);
        assert_eq!(d.outcome_label(), "cancelled");
    }

    #[test]
    fn given_a_user_cancel_when_the_engine_failed_then_cancelled_not_failed() {
        let g = Given { user_cancel: true, ..given(3) };
        for failure in [transient(), Failure::permanent(FailureCode::Cancelled, "stopped".into())] {
            let d = decide(&g, Err(failure));
            assert!(matches!(outcome(&d), EventBody::Cancelled(Cancelled { attempt: 3, interrupted: true })), "{d:?}");
        }
    }

    #[test]
    fn given_a_permanent_failure_when_decided_then_failed_permanent_and_ack() {
        let d = decide(&given(1), Err(Failure::permanent(FailureCode::InvalidAudio, "not audio".into())));
        assert_eq!(
            d,
            Decision::Outcome {
                body: EventBody::Failed(Failed {
                    attempt: 1,
                    class: FailureClass::Permanent,
                    code: FailureCode::InvalidAudio,
                    message: "not audio".into(),
                    retry_in_ms: None,
                }),
                discard_outputs: false
            }
        );
        assert_eq!(d.ack(), AckAction::AckAfterOutcome);
        assert_eq!(d.outcome_label(), "failed_permanent");
    }

    #[test]
    fn given_a_permanent_failure_on_the_last_delivery_then_failed_not_dead_lettered() {
        let d = decide(&given(3), Err(Failure::permanent(FailureCode::TimeLimit, "too slow".into())));
        assert!(matches!(outcome(&d), EventBody::Failed(f) if f.code == FailureCode::TimeLimit), "{d:?}");
    }

    #[test]
    fn given_a_transient_failure_before_the_last_delivery_then_failed_transient_and_nak_with_backoff() {
        let d = decide(&given(2), Err(transient()));
        assert_eq!(
            d,
            Decision::Retry {
                failed: Failed {
                    attempt: 2,
                    class: FailureClass::Transient,
                    code: FailureCode::Storage,
                    message: "the store is down".into(),
                    retry_in_ms: Some(4000),
                },
                delay: Duration::from_secs(4),
            }
        );
        assert_eq!(d.ack(), AckAction::NakAfter(Duration::from_secs(4)));
        assert_eq!(d.outcome_label(), "failed_transient");
    }

    #[test]
    fn given_a_transient_failure_on_the_last_delivery_then_dead_lettered_max_deliveries_with_last_error() {
        for attempt in [3, 4] {
            let d = decide(&given(attempt), Err(transient()));
            assert_eq!(
                d,
                Decision::Outcome {
                    body: EventBody::DeadLettered(DeadLettered {
                        deliveries: attempt,
                        reason: FailureCode::MaxDeliveries,
                        last_error: Some("storage: the store is down".into()),
                        request_seq: 42,
                    }),
                    discard_outputs: false
                }
            );
            assert_eq!(d.ack(), AckAction::AckAfterOutcome);
            assert_eq!(d.outcome_label(), "dead_lettered");
        }
    }

    #[test]
    fn given_an_unbounded_queue_when_transient_failures_repeat_then_it_always_retries() {
        let g = Given { max_deliver: u32::MAX, ..given(1000) };
        assert!(matches!(decide(&g, Err(transient())), Decision::Retry { .. }));
    }

    #[test]
    fn given_a_cancel_request_in_the_log_when_a_delivery_arrives_then_cancelled_without_running() {
        let now = chrono::Utc::now();
        assert_eq!(
            decide_start(1, true, Some(now - chrono::Duration::seconds(5)), now),
            Some(EventBody::Cancelled(Cancelled { attempt: 1, interrupted: false }))
        );
    }

    #[test]
    fn given_a_start_deadline_when_a_delivery_arrives_then_expired_only_past_it() {
        let now = chrono::Utc::now();
        let past = now - chrono::Duration::seconds(1);
        assert_eq!(decide_start(1, false, Some(past), now), Some(EventBody::Expired(Expired { start_before: past })));
        assert_eq!(decide_start(1, false, Some(now), now), None);
        assert_eq!(decide_start(1, false, Some(now + chrono::Duration::seconds(1)), now), None);
        assert_eq!(decide_start(2, false, None, now), None);
    }
}
