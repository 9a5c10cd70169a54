//! One delivery of one job, from pull to ack.
//!
//! This module owns the order of side effects that makes a job run once in effect:
//!
//! 1. read the request event; a forged or invalid one is `rejected`, never run;
//! 2. if the job already has an outcome (a lost ack, a duplicate delivery), ack and skip
//!    (`skip.already_done`);
//! 3. publish `started`; keep the ack deadline alive with progress acks;
//! 4. run the engine on a blocking thread, under the hard time limit, stepping down the
//!    out-of-memory ladder (smaller segment, then CPU) when it runs out of memory;
//! 5. store the stems and the manifest, then publish the outcome to the job's terminal
//!    subject (first terminal event wins), and only then ack (double ack);
//! 6. a transient failure publishes `failed(transient)` and naks with backoff, except on
//!    the last delivery, which dead-letters the job; a permanent failure is final at once.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use serde_json::json;
use stemq_core::engine::{EngineContext, EngineError, EngineJob, StemFile};
use stemq_core::event::{
    Cancelled, DeadLettered, EventBody, Expired, Failed, FailureClass, Output, Progress, Rejected, Requested, Started,
    Succeeded,
};
use stemq_core::nats::{job_id_of_subject, job_subject, SubjectKind};
use stemq_core::publish::{publish, publish_once, Once};
use stemq_core::storage::output_key;
use stemq_core::{Event, JobId};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn, Instrument};

use crate::{control, Shared};
use stemq_core::metrics::{metrics, JobLabels};

/// Handles one delivery; never panics, never leaves the message without an answer
/// unless the process dies (then `ack_wait` redelivers it).
pub(crate) async fn handle(shared: &Arc<Shared>, msg: jetstream::Message, hard_stop: &CancellationToken) {
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
    run_delivery(shared, msg, parsed, job_id, attempt, seq, hard_stop).instrument(span).await
}

fn source(shared: &Shared) -> String {
    format!("/stemq/worker/{}", shared.config.name)
}

async fn run_delivery(
    shared: &Arc<Shared>,
    msg: jetstream::Message,
    parsed: Result<Event, serde_json::Error>,
    job_id: JobId,
    attempt: u32,
    seq: u64,
    hard_stop: &CancellationToken,
) {
    // 1. The request must be a `requested` event whose request hashes to its subject.
    let Valid { requested, at: requested_at, traceparent } = match validate(parsed, &job_id) {
        Ok(v) => v,
        Err(rejection) => {
            let (code, message) = (rejection.code(), rejection.to_string());
            warn!(code, %message, "rejecting request event");
            metrics().outcome("unknown", "rejected");
            let ev = Event::new(&job_id, &source(shared), EventBody::Rejected(Rejected { code: code.into(), message }));
            finish(shared, &msg, &job_id, ev).await;
            return;
        }
    };
    let model = requested.request.model.as_str();

    // 2. Already done? The outcome subject is the source of truth (no projector lag).
    match shared.jobs_stream.direct_get_last_for_subject(job_subject(&job_id, SubjectKind::Outcome)).await {
        Ok(_) => {
            info!(event = "skip.already_done", "job already has an outcome; acking");
            let _ = msg.double_ack().await;
            return;
        }
        Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => {}
        Err(e) => {
            warn!(error = %e, "cannot check for an outcome; retrying later");
            let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
            return;
        }
    }

    // 2b. Cancelled or past its start deadline? Then it never starts. Listen for a
    // cancel request first, so one that arrives from now on is not missed.
    let cancel = Arc::new(AtomicBool::new(false));
    let user_cancel = Arc::new(AtomicBool::new(false));
    let _registered = shared.running.register(&job_id, cancel.clone(), user_cancel.clone());
    match control::cancel_requested_in_log(shared, &job_id).await {
        Ok(true) => {
            info!(event = "job.cancelled", "cancel requested before start; not running it");
            metrics().outcome(model, "cancelled");
            let ev =
                Event::new(&job_id, &source(shared), EventBody::Cancelled(Cancelled { attempt, interrupted: false }));
            finish(shared, &msg, &job_id, ev).await;
            return;
        }
        Ok(false) => {}
        Err(e) => {
            warn!(error = %e, "cannot check for a cancel request; retrying later");
            let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
            return;
        }
    }
    if let Some(deadline) = requested.start_before {
        if chrono::Utc::now() > deadline {
            info!(event = "job.expired", start_before = %deadline, "start deadline passed; not running it");
            metrics().outcome(model, "expired");
            let ev = Event::new(&job_id, &source(shared), EventBody::Expired(Expired { start_before: deadline }));
            finish(shared, &msg, &job_id, ev).await;
            return;
        }
    }
    // The per-job limit, never above the worker's own.
    let time_limit = match requested.max_runtime {
        Some(s) => shared.config.time_limit.min(Duration::from_secs(s)),
        None => shared.config.time_limit,
    };

    // 3. Started, and keep the delivery alive while we work.
    let engine = shared.engine.clone();
    let devices = engine.devices();
    let first_device = devices.first().cloned().unwrap_or_else(|| "cpu".into());
    let mut started = Event::new(
        &job_id,
        &source(shared),
        EventBody::Started(Started { attempt, worker: shared.config.name.clone(), device: first_device.clone() }),
    );
    started.traceparent = traceparent.clone();
    if attempt == 1 {
        let waited = (started.time - requested_at).to_std().unwrap_or_default();
        let labels = JobLabels { model: model.into(), device: first_device.clone() };
        metrics().queue_wait.get_or_create(&labels).observe(waited.as_secs_f64());
    }
    let js = shared.js.clone();
    let started_subject = job_subject(&job_id, SubjectKind::Started);
    let started_pub = tokio::spawn(async move { publish(&js, &started_subject, &started, None).await });
    let t0 = Instant::now();

    let msg = Arc::new(msg);
    let (progress_tx, progress_rx) = watch::channel::<Option<(f32, String)>>(None);
    let keepalive = spawn_keepalive(shared, msg.clone(), &job_id, attempt, progress_rx);

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
                let ev = Event::new(&job_id, &source(shared), EventBody::Failed(Failed {
                    attempt,
                    class: FailureClass::Permanent,
                    code: "time_limit".into(),
                    message: format!("the job ran longer than the {} s limit", time_limit.as_secs()),
                    retry_in_ms: None,
                }));
                metrics().outcome(model, "failed_permanent");
                finish(shared, &msg, &job_id, ev).await;
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
    if let Ok(Err(e)) = started_pub.await {
        warn!(error = %e, "started event not stored");
    }
    let elapsed = t0.elapsed();

    // 5./6. Outcome, then ack.
    let src = source(shared);
    if user_cancel.load(Ordering::SeqCst) {
        // Stopped on request (or finished just as the request came): keep nothing.
        control::discard_outputs(shared, &job_id).await;
        info!(event = "job.cancelled", "cancelled while running; outputs discarded");
        metrics().outcome(model, "cancelled");
        let ev = Event::new(&job_id, &src, EventBody::Cancelled(Cancelled { attempt, interrupted: true }));
        finish(shared, &msg, &job_id, ev).await;
        return;
    }
    match result {
        Ok(done) => {
            let outcome = Event::new(
                &job_id,
                &src,
                EventBody::Succeeded(Succeeded {
                    attempt,
                    outputs: done.outputs,
                    manifest_uri: Some(done.manifest_uri),
                    degraded: done.degraded,
                    device: done.device.clone(),
                    segment: done.segment,
                    duration_ms: elapsed.as_millis() as u64,
                }),
            );
            info!(event = "job.succeeded", duration_ms = elapsed.as_millis() as u64, degraded = done.degraded);
            let labels = JobLabels { model: model.into(), device: done.device.clone() };
            metrics().job_duration.get_or_create(&labels).observe(elapsed.as_secs_f64());
            if let Some(audio) = done.audio_secs.filter(|s| *s > 0.0) {
                metrics().realtime_factor.get_or_create(&labels).observe(elapsed.as_secs_f64() / audio);
            }
            metrics().outcome(model, if done.degraded { "degraded" } else { "succeeded" });
            metrics().deliveries.observe(attempt as f64);
            finish(shared, &msg, &job_id, outcome).await;
        }
        Err(f) if f.class == FailureClass::Permanent => {
            info!(event = "job.failed", code = %f.code, message = %f.message, "permanent failure");
            metrics().outcome(model, "failed_permanent");
            metrics().deliveries.observe(attempt as f64);
            let ev = Event::new(
                &job_id,
                &src,
                EventBody::Failed(Failed {
                    attempt,
                    class: f.class,
                    code: f.code,
                    message: f.message,
                    retry_in_ms: None,
                }),
            );
            finish(shared, &msg, &job_id, ev).await;
        }
        Err(f) if attempt >= shared.queue().max_deliver => {
            warn!(event = "job.dead_lettered", code = %f.code, message = %f.message, "last delivery failed");
            metrics().outcome(model, "dead_lettered");
            metrics().deliveries.observe(attempt as f64);
            let ev = Event::new(
                &job_id,
                &src,
                EventBody::DeadLettered(DeadLettered {
                    deliveries: attempt,
                    reason: "max_deliveries".into(),
                    last_error: Some(format!("{}: {}", f.code, f.message)),
                    request_seq: seq,
                }),
            );
            finish(shared, &msg, &job_id, ev).await;
        }
        Err(f) => {
            let delay = shared.config.backoff.delay(attempt);
            info!(event = "job.retry", code = %f.code, message = %f.message, delay_ms = delay.as_millis() as u64);
            metrics().outcome(model, "failed_transient");
            let ev = Event::new(
                &job_id,
                &src,
                EventBody::Failed(Failed {
                    attempt,
                    class: FailureClass::Transient,
                    code: f.code,
                    message: f.message,
                    retry_in_ms: Some(delay.as_millis() as u64),
                }),
            );
            if let Err(e) = publish(&shared.js, &job_subject(&job_id, SubjectKind::Failed), &ev, None).await {
                warn!(error = %e, "failure event not stored");
            }
            let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
        }
    }
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
    match shared.jobs_stream.direct_get_last_for_subject(job_subject(job_id, SubjectKind::Outcome)).await {
        Ok(m) => Event::from_slice(&m.payload).map(|e| matches!(e.body, EventBody::Cancelled(_))).unwrap_or(false),
        Err(_) => false,
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

/// Why a delivered request is rejected, never run (recorded as the job's `rejected`
/// outcome with [`Rejection::code`] and the message).
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
    /// The request is valid, but not as the ingress would have normalised it.
    #[error("the request is not in normalised form")]
    NotNormalised,
    /// The request itself is invalid (a raw publisher bypassed the ingress).
    #[error("{0}")]
    Invalid(#[source] stemq_core::request::RequestError),
}

impl Rejection {
    /// The `code` of the `rejected` outcome.
    fn code(&self) -> &'static str {
        match self {
            Rejection::NotAnEvent(_) | Rejection::NotARequest(_) => "invalid_event",
            Rejection::IdMismatch { .. } => "id_mismatch",
            Rejection::NotNormalised | Rejection::Invalid(_) => "invalid_request",
        }
    }
}

/// Checks a delivered request: a `requested` event whose request hashes to its subject
/// and id, and is a valid request in normalised form.
fn validate(parsed: Result<Event, serde_json::Error>, job_id: &JobId) -> Result<Valid, Rejection> {
    let ev = parsed.map_err(Rejection::NotAnEvent)?;
    let EventBody::Requested(r) = ev.body else {
        return Err(Rejection::NotARequest(ev.body.kind()));
    };
    let computed = r.request.job_id();
    if &computed != job_id || &ev.subject != job_id || ev.id != job_id.as_str() {
        return Err(Rejection::IdMismatch { computed, claimed: job_id.clone() });
    }
    // Re-validate the request itself: a raw publisher bypasses the ingress.
    let req = stemq_core::JobRequest {
        audio_uri: r.request.audio_uri.clone(),
        model: Some(r.request.model),
        two_stems: r.request.two_stems.clone(),
        other_method: r.request.other_method,
        output_format: Some(r.request.output_format),
        encoding: Some(r.request.encoding),
        clip_mode: Some(r.request.clip_mode),
        segment: r.request.segment,
        overlap: Some(r.request.overlap),
        shifts: Some(r.request.shifts),
        webhook: r.webhook.clone(),
        metadata: r.metadata.clone(),
        start_before: None,
        max_runtime: r.max_runtime,
    };
    let mut normalised = req.normalize(&r.request.owner).map_err(Rejection::Invalid)?;
    normalised.retry_of = r.request.retry_of.clone();
    if normalised != r.request {
        return Err(Rejection::NotNormalised);
    }
    Ok(Valid { requested: r, at: ev.time, traceparent: ev.traceparent })
}

/// A failed attempt, classified.
#[derive(Debug)]
struct Failure {
    class: FailureClass,
    code: String,
    message: String,
}

impl Failure {
    fn permanent(code: &str, message: String) -> Failure {
        Failure { class: FailureClass::Permanent, code: code.into(), message }
    }
    fn transient(code: &str, message: String) -> Failure {
        Failure { class: FailureClass::Transient, code: code.into(), message }
    }
}

struct Done {
    /// Length of the separated audio, when the engine reports it.
    audio_secs: Option<f64>,
    outputs: Vec<Output>,
    manifest_uri: String,
    degraded: bool,
    device: String,
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
fn ladder(devices: &[String], requested: Option<f64>, max_segment: Option<f64>) -> Vec<(String, Option<f64>)> {
    let first = devices.first().cloned().unwrap_or_else(|| "cpu".into());
    let mut rungs = vec![(first.clone(), requested)];
    let base = requested.or(max_segment);
    if let Some(b) = base {
        rungs.push((first.clone(), Some((b / 2.0).max(1.0))));
    }
    if first != "cpu" && devices.iter().any(|d| d == "cpu") {
        rungs.push(("cpu".into(), requested));
    }
    rungs
}

async fn run_engine(
    shared: &Arc<Shared>,
    job_id: &JobId,
    requested: &Requested,
    attempt: u32,
    devices: &[String],
    progress: watch::Sender<Option<(f32, String)>>,
    cancel: Arc<AtomicBool>,
) -> Result<Done, Failure> {
    if attempt > 1 {
        // A redelivery: some attempt may have died without cleaning up.
        let shared = shared.clone();
        let _ = tokio::task::spawn_blocking(move || shared.scratch.sweep()).await;
    }
    let dir = shared.scratch.attempt_dir(job_id.as_str(), attempt);
    let _cleanup = ScratchDir(dir.clone());
    let out_dir = dir.join("out");
    tokio::fs::create_dir_all(&out_dir)
        .await
        .map_err(|e| Failure::transient("scratch", format!("cannot create {}: {e}", out_dir.display())))?;
    let input = if shared.engine.reads_input() {
        fetch_input(shared, &requested.request.audio_uri, &dir).instrument(info_span!("fetch_input")).await?
    } else {
        dir.join("input")
    };

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
        let res = tokio::task::spawn_blocking(move || {
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
            engine.separate(&job, ctx2.as_ref())
        })
        .await
        .map_err(|e| Failure::transient("engine_panic", format!("the engine crashed: {e}")))?;
        match res {
            Ok(_) if ctx.cancel.load(Ordering::SeqCst) => {
                // Stopped from outside (time limit, cancel) just as it finished: store nothing.
                return Err(Failure::permanent("cancelled", "the attempt was stopped".into()));
            }
            Ok(stems) => {
                let degraded = i > 0;
                if degraded {
                    warn!(event = "job.degraded", %device, ?segment, "finished on a lower rung of the memory ladder");
                }
                let (outputs, manifest_uri) = store_outputs(shared, job_id, requested, &stems, device, degraded)
                    .instrument(info_span!("store_outputs", stems = stems.len()))
                    .await?;
                let audio_secs =
                    stems.first().and_then(|s| s.audio).map(|a| a.frames as f64 / a.sample_rate.max(1) as f64);
                return Ok(Done { audio_secs, outputs, manifest_uri, degraded, device: device.clone(), segment });
            }
            Err(e @ (EngineError::OutOfMemory { .. } | EngineError::OverBudget { .. })) => {
                warn!(event = "job.oom", %device, ?segment, error = %e, "out of memory; stepping down");
                last_oom = e;
                // Nothing partial may survive into the next rung.
                let _ = tokio::fs::remove_dir_all(&out_dir).await;
                let _ = tokio::fs::create_dir_all(&out_dir).await;
            }
            Err(e) => return Err(classify(e)),
        }
    }
    Err(match last_oom {
        EngineError::OverBudget { device, needed, budget } => Failure::permanent(
            "over_memory_budget",
            format!(
                "does not fit the memory budget on {device} at any rung of the ladder (the smallest needs about \
                 {needed} bytes, the budget is {budget})"
            ),
        ),
        e => Failure::transient("out_of_memory", format!("{e} at every rung")),
    })
}

fn classify(e: EngineError) -> Failure {
    match e {
        EngineError::InvalidInput { code, message } => Failure::permanent(&code, message),
        EngineError::Unsupported { code, message } => Failure::permanent(&code, message),
        EngineError::Transient(m) => Failure::transient("engine_error", m),
        // The attempt's own process died: this job, and only it, pays an attempt.
        EngineError::Crashed(m) => Failure::transient("engine_crashed", m),
        EngineError::Cancelled => Failure::permanent("cancelled", "the job was cancelled".into()),
        EngineError::OutOfMemory { device } => {
            Failure::transient("out_of_memory", format!("out of memory on {device}"))
        }
        e @ EngineError::OverBudget { .. } => Failure::permanent("over_memory_budget", e.to_string()),
    }
}

/// Streams the input to local scratch, chunk by chunk. Only URIs inside the configured
/// store are read (the same policy as the ingress: no traversal, no other store).
async fn fetch_input(shared: &Shared, uri: &str, dir: &Path) -> Result<PathBuf, Failure> {
    let store = &shared.config.store;
    let (_, key) = stemq_core::uri::store_key(uri, &[store.base_url().to_string()])
        .map_err(|e| Failure::permanent("input_not_allowed", e.message))?;
    let path = dir.join("input");
    let t0 = Instant::now();
    let bytes = store.get_to_file(key, &path).await.map_err(|e| match e {
        e if e.is_not_found() => Failure::permanent("input_not_found", format!("{uri} does not exist")),
        e @ stemq_core::storage::StorageError::Io { .. } => Failure::transient("scratch", e.to_string()),
        e => Failure::transient("storage", e.to_string()),
    })?;
    info!(event = "input.fetched", bytes, ms = t0.elapsed().as_millis() as u64, "input fetched");
    Ok(path)
}

/// Stores the stems, then `jobs/<id>/manifest.json` describing them (the manifest last,
/// so its presence means every stem is there).
async fn store_outputs(
    shared: &Shared,
    job_id: &JobId,
    requested: &Requested,
    stems: &[StemFile],
    device: &str,
    degraded: bool,
) -> Result<(Vec<Output>, String), Failure> {
    let store = &shared.config.store;
    let ext = requested.request.output_format.extension();
    let mut outputs = Vec::with_capacity(stems.len());
    let mut entries = Vec::with_capacity(stems.len());
    for s in stems {
        let file = format!("{}.{ext}", s.stem);
        let key = output_key(job_id.as_str(), &file);
        let stored = store.put_file(&key, &s.path).await.map_err(|e| Failure::transient("storage", e.to_string()))?;
        let mut entry = json!({
            "stem": s.stem, "file": file, "uri": stored.uri, "bytes": stored.bytes, "sha256": stored.sha256,
        });
        if let Some(a) = s.audio {
            entry["sample_rate"] = json!(a.sample_rate);
            entry["frames"] = json!(a.frames);
            entry["duration_secs"] = json!(a.frames as f64 / f64::from(a.sample_rate.max(1)));
        }
        entries.push(entry);
        outputs.push(Output { stem: s.stem.clone(), uri: stored.uri, bytes: stored.bytes, sha256: stored.sha256 });
    }
    let first_audio = stems.iter().find_map(|s| s.audio);
    let manifest = json!({
        "manifest_version": 1,
        "job_id": job_id,
        "model": requested.request.model,
        "format": ext,
        "sample_rate": first_audio.map(|a| a.sample_rate),
        "duration_secs": first_audio.map(|a| a.frames as f64 / f64::from(a.sample_rate.max(1))),
        "device": device,
        "degraded": degraded,
        "stems": entries,
    });
    let key = stemq_core::storage::manifest_key(job_id.as_str());
    let stored = store
        .put_bytes(&key, serde_json::to_vec_pretty(&manifest).expect("json"))
        .await
        .map_err(|e| Failure::transient("storage", e.to_string()))?;
    Ok((outputs, stored.uri))
}

/// Progress acks (every third of `ack_wait`) and rate-limited progress events.
fn spawn_keepalive(
    shared: &Arc<Shared>,
    msg: Arc<jetstream::Message>,
    job_id: &JobId,
    attempt: u32,
    mut progress: watch::Receiver<Option<(f32, String)>>,
) -> tokio::task::JoinHandle<()> {
    let js = shared.js.clone();
    let mut queue = shared.queue.clone();
    let min_gap = shared.config.progress_every;
    let subject = job_subject(job_id, SubjectKind::Progress);
    let job_id = job_id.clone();
    let src = source(shared);
    let heartbeat = shared.config.progress_heartbeat;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(queue.borrow_and_update().keepalive_every());
        tick.tick().await;
        let mut beat = tokio::time::interval(heartbeat);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        beat.tick().await;
        let mut engine_done = false;
        let mut last_sent: Option<Instant> = None;
        let mut last: (f32, String) = (0.0, "starting".to_string());
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if let Err(e) = msg.ack_with(AckKind::Progress).await {
                        warn!(error = %e, "progress ack failed");
                    }
                }
                Ok(()) = queue.changed() => {
                    // The consumer's ack wait changed: ack now, then at the new pace.
                    let every = queue.borrow_and_update().keepalive_every();
                    if let Err(e) = msg.ack_with(AckKind::Progress).await {
                        warn!(error = %e, "progress ack failed");
                    }
                    tick = tokio::time::interval(every);
                    tick.tick().await;
                }
                _ = beat.tick(), if !engine_done => {
                    if last_sent.map(|t| t.elapsed() + Duration::from_millis(50) < heartbeat).unwrap_or(false) {
                        continue;
                    }
                    let ev = Event::new(&job_id, &src, EventBody::Progress(Progress {
                        attempt, percent: (last.0 * 100.0).round(), stage: last.1.clone(), message: None,
                    }));
                    if let Err(e) = publish(&js, &subject, &ev, None).await {
                        warn!(error = %e, "progress heartbeat not stored");
                    }
                    last_sent = Some(Instant::now());
                }
                changed = progress.changed(), if !engine_done => {
                    if changed.is_err() {
                        engine_done = true;
                        continue;
                    }
                    if let Some(t) = last_sent {
                        if let Some(rest) = min_gap.checked_sub(t.elapsed()) {
                            tokio::time::sleep(rest).await;
                        }
                    }
                    let Some((fraction, stage)) = progress.borrow_and_update().clone() else { continue };
                    last = (fraction, stage.clone());
                    let ev = Event::new(&job_id, &src, EventBody::Progress(Progress {
                        attempt, percent: (fraction * 100.0).round(), stage, message: None,
                    }));
                    if let Err(e) = publish(&js, &subject, &ev, None).await {
                        warn!(error = %e, "progress event not stored");
                    }
                    last_sent = Some(Instant::now());
                }
            }
        }
    })
}

/// Removes a job's scratch directory when the attempt ends, however it ends.
struct ScratchDir(PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stemq_core::request::{JobRequest, ANONYMOUS};

    fn requested() -> Event {
        let n = JobRequest::from_value(json!({"audio_uri": "file:///a.wav"})).unwrap().normalize(ANONYMOUS).unwrap();
        Event::requested(n, None, None, "/test")
    }

    #[test]
    fn validate_accepts_a_request_that_hashes_to_its_id() {
        let ev = requested();
        let id = ev.subject.clone();
        let valid = validate(Ok(ev), &id).expect("valid");
        assert_eq!(valid.requested.request.job_id(), id);
    }

    #[test]
    fn validate_rejects_with_a_code_per_reason() {
        let ev = requested();
        let other = JobId::parse(&"0".repeat(64)).unwrap();
        let e = validate(Ok(ev.clone()), &other).unwrap_err();
        assert!(matches!(e, Rejection::IdMismatch { .. }), "{e:?}");
        assert_eq!(e.code(), "id_mismatch");

        // Hashes to its id, but is not a request the ingress would accept.
        let mut n = match &ev.body {
            EventBody::Requested(r) => r.request.clone(),
            _ => unreachable!(),
        };
        n.audio_uri = format!(" {} ", n.audio_uri);
        let unnormalised = Event::requested(n, None, None, "/test");
        let id = unnormalised.subject.clone();
        let e = validate(Ok(unnormalised), &id).unwrap_err();
        assert!(matches!(e, Rejection::Invalid(_)), "{e:?}");
        assert_eq!(e.code(), "invalid_request");
        assert!(e.to_string().starts_with("invalid `audio_uri`: "), "{e}");

        let not_json = serde_json::from_slice::<Event>(b"{").map(|_| unreachable!());
        let e = validate(not_json, &ev.subject).unwrap_err();
        assert_eq!(e.code(), "invalid_event");
        assert!(e.to_string().starts_with("not a stemq CloudEvent: "), "{e}");

        let started = Event::new(
            &ev.subject,
            "/test",
            EventBody::Started(Started { attempt: 1, worker: "w".into(), device: "cpu".into() }),
        );
        let e = validate(Ok(started), &ev.subject).unwrap_err();
        assert_eq!((e.code(), e.to_string().as_str()), ("invalid_event", "expected a requested event, got started"));
    }

    #[test]
    fn ladder_steps_segment_then_cpu() {
        let devs = vec!["cuda:0".to_string(), "cpu".to_string()];
        assert_eq!(
            ladder(&devs, None, Some(7.8)),
            vec![("cuda:0".into(), None), ("cuda:0".into(), Some(3.9)), ("cpu".into(), None)]
        );
        let cpu_only = vec!["cpu".to_string()];
        assert_eq!(ladder(&cpu_only, Some(4.0), Some(7.8)), vec![("cpu".into(), Some(4.0)), ("cpu".into(), Some(2.0))]);
        assert_eq!(ladder(&cpu_only, None, None), vec![("cpu".into(), None)]);
    }
}
