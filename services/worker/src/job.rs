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
//! What a result *means* (steps 5 and 6) is one pure function, `decide::decide`: the
//! attempt, the queue's max deliver, the backoff delay, whether a user's cancel came in,
//! and the engine's result in; the event to record and how to answer the delivery out
//! (`Decision`). `decide_start` says the same before the engine runs (cancelled,
//! expired). `run_delivery` only gathers their inputs and carries their decisions out.
//!
//! | module | owns |
//! |---|---|
//! | `validate` | step 1: whether a delivered request may run, or is rejected or dropped |
//! | `decide` | what a delivery comes to, before and after the engine: pure, given/when/then |
//! | `ladder` | step 4: the engine down the out-of-memory ladder, its errors classified |
//! | `input` | the input fetched into scratch, and what a failed fetch means |
//! | `crate::outputs`, `crate::keepalive` | storing the stems; keeping the delivery alive |

mod decide;
mod input;
mod ladder;
mod validate;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use futures::future::OptionFuture;
use stemq_core::device::Device;
use stemq_core::event::{EventBody, FailureClass, FailureCode, Output, Rejected, Started};
use stemq_core::{Event, JobId};
use stemq_nats::publish::{publish, publish_first_of, publish_once, First, Once};
use stemq_nats::{job_events_filter, job_id_of_subject, job_subject, SubjectKind};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument};

use self::decide::{decide, decide_start, AckAction, Decision, Given};
use self::ladder::run_engine;
use self::validate::{validate, Valid};
use crate::keepalive::spawn_keepalive;
use crate::metrics::{metrics, JobLabels};
use crate::{control, Shared};

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
    stemq_telemetry::logging::set_parent(&span, traceparent);
    let delivery = Delivery { msg, parsed, job_id, attempt, seq };
    run_delivery(shared, delivery, queue, hard_stop).instrument(span).await
}

pub(crate) fn source(shared: &Shared) -> String {
    format!("/stemq/worker/{}", shared.config.name)
}

/// One delivery as [`handle`] read it: the message, its payload parsed once, and the job
/// and queue position its metadata names.
struct Delivery {
    msg: jetstream::Message,
    parsed: Result<Event, serde_json::Error>,
    job_id: JobId,
    /// This delivery of the request, from 1.
    attempt: u32,
    /// The request's stream sequence.
    seq: u64,
}

/// Runs one delivery through the steps of the module docs.
async fn run_delivery(
    shared: &Arc<Shared>,
    delivery: Delivery,
    queue: watch::Receiver<crate::QueueSettings>,
    hard_stop: &CancellationToken,
) {
    let Delivery { msg, parsed, job_id, attempt, seq } = delivery;
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

/// Publishes a terminal event (first one wins) and acks. If the publish fails we do not
/// ack: the delivery comes back and tries again.
async fn finish(shared: &Shared, msg: &jetstream::Message, job_id: &JobId, mut ev: Event) {
    let _span = info_span!("publish_outcome", kind = ev.body.kind()).entered();
    ev.traceparent = stemq_telemetry::logging::current_traceparent();
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
    match stemq_nats::read::outcome::outcome(&shared.js, job_id, stemq_nats::read::outcome::From::Replica).await {
        Ok(Some(m)) => {
            Event::from_slice(&m.payload).map(|e| matches!(e.body, EventBody::Cancelled(_))).unwrap_or(false)
        }
        _ => false,
    }
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
