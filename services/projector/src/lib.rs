//! stemq-projector: folds the job event log into the KV status view.
//!
//! This crate owns the read side. [`run`] consumes every job event (and the compacted
//! progress stream) with durable consumers, applies [`stemq_core::apply`] and writes the
//! result to the `stemq_jobs` bucket with compare-and-set on the entry's revision. It is
//! idempotent by stream sequence (each view records the last applied position) and acks
//! only after the write. Events of different jobs are applied concurrently in lanes
//! (one lane per hash of the job id), so order per job is kept while throughput scales.
//!
//! The view is disposable: [`rebuild`] drops the bucket and the consumers, and replays
//! the log into an identical view. [`index`] keeps the list query cheap.

pub mod index;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, kv, AckKind};
use futures::StreamExt;
use stemq_core::nats::{self as names, Settings};
use stemq_core::{apply, Event, JobId, JobView, Position};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

/// One delivered event waiting to be folded: where it sits in the log, the event, and
/// the message to ack once its job's view is written.
type Pending = (Position, Event, jetstream::Message);

/// Projector failures.
#[derive(Debug, thiserror::Error)]
pub enum ProjectorError {
    /// NATS set-up failed.
    #[error(transparent)]
    Nats(#[from] names::NatsError),
    /// A JetStream call failed.
    #[error("{what}: {message}")]
    JetStream {
        /// Which call.
        what: &'static str,
        /// Server or client message.
        message: String,
    },
}

fn js_err(what: &'static str) -> impl Fn(&dyn std::fmt::Display) -> ProjectorError {
    move |e| ProjectorError::JetStream { what, message: e.to_string() }
}

/// Projector configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Parallel lanes (each applies its jobs' events in order).
    pub lanes: usize,
    /// Views kept in memory per lane (saves a KV read per event).
    pub cache_per_lane: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config { lanes: 32, cache_per_lane: 4096 }
    }
}

/// Reads one job's view.
pub async fn get_view(kv: &kv::Store, id: &JobId) -> Result<Option<(JobView, u64)>, ProjectorError> {
    let entry = kv.entry(id.as_str()).await.map_err(|e| js_err("kv get")(&e))?;
    Ok(match entry {
        Some(e) if e.operation == kv::Operation::Put => {
            serde_json::from_slice::<JobView>(&e.value).ok().map(|v| (v, e.revision))
        }
        _ => None,
    })
}

/// Runs until `shutdown`: folds job and progress events into the view.
pub async fn run(
    client: async_nats::Client,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), ProjectorError> {
    let js = jetstream::new(client);
    let kv = js.get_key_value(names::JOBS_BUCKET).await.map_err(|e| js_err("open bucket")(&e))?;
    let jobs: PullConsumer = js
        .get_consumer_from_stream(names::PROJECTOR_CONSUMER, names::JOBS_STREAM)
        .await
        .map_err(|e| js_err("open projector consumer")(&e))?;
    let progress: PullConsumer = js
        .get_consumer_from_stream(names::PROJECTOR_PROGRESS_CONSUMER, names::PROGRESS_STREAM)
        .await
        .map_err(|e| js_err("open progress consumer")(&e))?;

    let tracker = TaskTracker::new();
    let mut lanes = Vec::with_capacity(config.lanes);
    for lane in 0..config.lanes.max(1) {
        let (tx, rx) = mpsc::channel::<(jetstream::Message, bool)>(1024);
        lanes.push(tx);
        let kv = kv.clone();
        let cap = config.cache_per_lane;
        tracker.spawn(async move { lane_loop(lane, kv, rx, cap).await });
    }
    let mut tasks = Vec::new();
    for (consumer, is_progress) in [(jobs, false), (progress, true)] {
        let lanes = lanes.clone();
        let shutdown = shutdown.clone();
        tasks.push(tracker.spawn(async move { pump(consumer, is_progress, lanes, shutdown).await }));
    }
    drop(lanes);
    tracker.close();
    info!(lanes = config.lanes, "projector running");
    let mut result = Ok(());
    for t in tasks {
        if let Ok(Err(e)) = t.await {
            shutdown.cancel();
            result = Err(e);
        }
    }
    tracker.wait().await;
    info!("projector stopped");
    result
}

async fn pump(
    consumer: PullConsumer,
    is_progress: bool,
    lanes: Vec<mpsc::Sender<(jetstream::Message, bool)>>,
    shutdown: CancellationToken,
) -> Result<(), ProjectorError> {
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(1000)
        .heartbeat(Duration::from_secs(5))
        .expires(Duration::from_secs(30))
        .messages()
        .await
        .map_err(|e| js_err("pull")(&e))?;
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            m = messages.next() => m,
        };
        let msg = match msg {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                // Transient (missed heartbeat, reconnect): the stream resumes by itself.
                warn!(error = %e, "projector pull error");
                continue;
            }
            None => return Ok(()),
        };
        let lane = match names::job_id_of_subject(&msg.subject) {
            Some(id) => lane_of(&id, lanes.len()),
            None => {
                warn!(subject = %msg.subject, "not a job subject; skipping");
                let _ = msg.ack().await;
                continue;
            }
        };
        if lanes[lane].send((msg, is_progress)).await.is_err() {
            return Ok(());
        }
    }
}

fn lane_of(id: &JobId, n: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    (h.finish() % n as u64) as usize
}

async fn lane_loop(lane: usize, kv: kv::Store, mut rx: mpsc::Receiver<(jetstream::Message, bool)>, cap: usize) {
    let mut cache: HashMap<JobId, (Option<JobView>, u64)> = HashMap::new();
    let mut batch = Vec::new();
    while let Some(first) = rx.recv().await {
        // Take whatever else is already waiting: events of one job that arrive together
        // (requested, started, outcome under load) become one KV write.
        batch.clear();
        batch.push(first);
        while batch.len() < 256 {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let mut per_job: Vec<(JobId, Vec<Pending>)> = Vec::new();
        for (msg, is_progress) in batch.drain(..) {
            let seq = match msg.info() {
                Ok(i) => i.stream_sequence,
                Err(e) => {
                    warn!(error = %e, "message without JetStream info");
                    continue;
                }
            };
            let pos = if is_progress { Position::Progress(seq) } else { Position::Log(seq) };
            let event = match Event::from_slice(&msg.payload) {
                Ok(e) => e,
                Err(e) => {
                    // Not an event we can read: never retried, never lost (it stays in the log).
                    warn!(lane, seq, subject = %msg.subject, error = %e, "unreadable event; terminating it");
                    let _ = msg.ack_with(AckKind::Term).await;
                    continue;
                }
            };
            match per_job.iter_mut().find(|(id, _)| *id == event.subject) {
                Some((_, v)) => v.push((pos, event, msg)),
                None => per_job.push((event.subject.clone(), vec![(pos, event, msg)])),
            }
        }
        for (id, events) in per_job {
            let refs: Vec<(Position, &Event)> = events.iter().map(|(p, e, _)| (*p, e)).collect();
            let span =
                tracing::info_span!("project", job_id = %id, events = refs.len(), trace_id = tracing::field::Empty);
            let tp = refs.iter().rev().find_map(|(_, e)| e.traceparent.as_deref());
            stemq_core::telemetry::set_parent(&span, tp);
            match tracing::Instrument::instrument(fold(&kv, &mut cache, &id, &refs), span).await {
                Ok(()) => {
                    for (_, _, msg) in &events {
                        if let Err(e) = msg.ack().await {
                            warn!(error = %e, "ack failed; the event will be redelivered and skipped");
                        }
                    }
                }
                Err(e) => {
                    warn!(job_id = %id, error = %e, "projection failed; will retry");
                    cache.remove(&id);
                    for (_, _, msg) in &events {
                        let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_millis(200)))).await;
                    }
                }
            }
        }
        if cache.len() > cap {
            // Terminal views rarely change again: drop them first, then anything.
            cache.retain(|_, (v, _)| v.as_ref().map(|v| !v.status.is_terminal()).unwrap_or(false));
            if cache.len() > cap {
                cache.clear();
            }
        }
    }
}

/// Applies a job's events in order and writes the result once, with compare-and-set;
/// on a concurrent writer it re-reads and retries.
async fn fold(
    kv: &kv::Store,
    cache: &mut HashMap<JobId, (Option<JobView>, u64)>,
    id: &JobId,
    events: &[(Position, &Event)],
) -> Result<(), ProjectorError> {
    // An unknown job is most likely new: try creating it before paying for a read.
    let mut current = cache.get(id).cloned().unwrap_or((None, 0));
    for _ in 0..10 {
        let mut view = current.0.clone();
        let mut changed = false;
        for (pos, event) in events {
            if let Some(next) = apply(view.as_ref(), *pos, event) {
                view = Some(next);
                changed = true;
            }
        }
        if !changed {
            debug!(job_id = %id, "events change nothing");
            return Ok(());
        }
        let next = view.expect("changed implies a view");
        let body = serde_json::to_vec(&next).expect("views serialise");
        match kv.update(id.as_str(), body.into(), current.1).await {
            Ok(rev) => {
                cache.insert(id.clone(), (Some(next), rev));
                return Ok(());
            }
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                // It exists (or another writer moved it): read the real revision, retry.
                cache.remove(id);
                current = match kv.entry(id.as_str()).await.map_err(|e| js_err("kv get")(&e))? {
                    Some(e) if e.operation == kv::Operation::Put => {
                        (serde_json::from_slice::<JobView>(&e.value).ok(), e.revision)
                    }
                    Some(e) => (None, e.revision),
                    None => (None, 0),
                };
            }
            Err(e) => return Err(js_err("kv update")(&e)),
        }
    }
    Err(ProjectorError::JetStream { what: "kv update", message: "too many revision conflicts".into() })
}

/// Drops the view and the projector's consumers and recreates them empty, so a running
/// (or next) projector replays the whole log. Returns the number of job events to replay.
pub async fn reset(js: &jetstream::Context, settings: &Settings) -> Result<u64, ProjectorError> {
    for (stream, consumer) in
        [(names::JOBS_STREAM, names::PROJECTOR_CONSUMER), (names::PROGRESS_STREAM, names::PROJECTOR_PROGRESS_CONSUMER)]
    {
        if let Ok(s) = js.get_stream_no_info(stream).await {
            let _ = s.delete_consumer(consumer).await;
        }
    }
    let _ = js.delete_key_value(names::JOBS_BUCKET).await;
    names::apply(js, settings).await?;
    let mut s = js.get_stream(names::JOBS_STREAM).await.map_err(|e| js_err("stream info")(&e))?;
    let info = s.info().await.map_err(|e| js_err("stream info")(&e))?;
    Ok(info.state.messages)
}

/// Waits until the projector has applied (acked) everything in the log.
pub async fn wait_caught_up(js: &jetstream::Context, timeout: Duration) -> Result<bool, ProjectorError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let mut done = true;
        for (stream, consumer) in [
            (names::JOBS_STREAM, names::PROJECTOR_CONSUMER),
            (names::PROGRESS_STREAM, names::PROJECTOR_PROGRESS_CONSUMER),
        ] {
            let mut c: PullConsumer =
                js.get_consumer_from_stream(consumer, stream).await.map_err(|e| js_err("consumer")(&e))?;
            let info = c.info().await.map_err(|e| js_err("consumer info")(&e))?;
            if info.num_pending > 0 || info.num_ack_pending > 0 {
                done = false;
            }
        }
        if done {
            return Ok(true);
        }
        if tokio::time::Instant::now() > deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
