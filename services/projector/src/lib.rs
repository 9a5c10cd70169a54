//! stemq-projector: folds the job event log into the KV status view.
//!
//! This crate owns the write side of the status view. [`run`] consumes every job event (and the compacted
//! progress stream) with durable consumers, applies [`stemq_core::apply`] and writes the
//! result to the `stemq_jobs` bucket with compare-and-set on the entry's revision. It is
//! idempotent by stream sequence (each view records the last applied position) and acks
//! only after the write. Events of different jobs are applied concurrently in lanes
//! (one lane per hash of the job id), so order per job is kept while throughput scales.
//! Both consumers are read through [`stemq_core::pull::messages`], so a server restart
//! or a recreated consumer (a rebuild) never stops the projector.
//!
//! **Per job, in order or not at all.** Idempotence by position means an event whose
//! sequence is at or below the view's `last_seq` is skipped as already applied. So once
//! a fold fails, no later event of that job may be applied before the failed one, or the
//! failed one would be dropped as old on redelivery. A lane therefore remembers, per
//! job, the log sequences it handed back (nak, with a delay growing with the delivery
//! count, capped at [`MAX_RETRY_DELAY`]) and not yet applied: the job is *held*. While
//! held, a delivered event of that job is applied only if every held sequence below it
//! is in the same batch (they are folded together, in log order); any other is handed
//! back too and joins the hold. When the failed event comes back and its fold succeeds,
//! the held ones follow in order. Only the held job waits: its lane keeps applying other
//! jobs, and a job that keeps failing (a corrupt view) costs a few naks every
//! [`MAX_RETRY_DELAY`] until it is fixed. Progress events only ever replace older
//! progress, but they too wait while their job is held. A handed-back event comes back
//! within [`MAX_RETRY_DELAY`] unless someone acked it (a second projector sharing the
//! consumer during `stemq projector --rebuild`); one not seen again for [`HOLD_EXPIRY`]
//! no longer holds its job. The hold lives in memory: a projector that restarts while a
//! job is held relies on the server's redelivery order (it is not re-derived from the
//! log).
//!
//! **A request for another owner is refused.** A `requested` event on
//! `stemq.jobs.<id>.requested.<token>` whose request names an owner with another token
//! is never folded (terminated, logged, counted as
//! `stemq_projector_errors_total{kind="owner_mismatch"}`, `id_mismatch` likewise): the
//! worker drops it too, so the job's view waits for the job's real request.
//!
//! **A view that does not parse is an error**, never an absent view to overwrite:
//! [`get_view`] returns [`ProjectorError::CorruptView`], the fold refuses to write over
//! it (the job is held as above, logged with its `job_id`, and counted in
//! `stemq_projector_errors_total{kind="corrupt_view"}`), other jobs keep flowing, and
//! `stemq projector --rebuild` replaces it from the log.
//!
//! The view is disposable: [`reset`] drops the bucket and the consumers, and replays
//! the log into an identical view. Readers never depend on this crate: they read the
//! view, the list index and its cursor through [`stemq_core::read`], which this crate
//! uses too (its [`get_view`] is that reader with the projector's error).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::PullConsumer, kv, AckKind};
use futures::StreamExt;
use stemq_core::error::JetStreamError;
use stemq_core::nats::{self as names, Settings};
use stemq_core::pull::{self, PullOptions};
use stemq_core::read::{self, ViewError};
use stemq_core::{apply, Event, JobId, JobView, Position};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

/// One delivered event waiting to be folded: where it sits in the log, the event, and
/// the message to ack once its job's view is written.
type Pending = (Position, Event, jetstream::Message);

/// The longest delay before a handed-back event comes again.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(5);

/// How long a handed-back event that is not delivered again keeps holding its job: four
/// times the projector consumer's `ack_wait` (30 s), so only an event acked elsewhere
/// (another projector on the same consumer) stops holding.
pub const HOLD_EXPIRY: Duration = Duration::from_secs(120);

/// Projector failures.
#[derive(Debug, thiserror::Error)]
pub enum ProjectorError {
    /// NATS set-up failed.
    #[error(transparent)]
    Nats(#[from] names::NatsError),
    /// A JetStream call failed.
    #[error(transparent)]
    JetStream(#[from] JetStreamError),
    /// Reading a job's view failed.
    #[error("reading the view of job {id}")]
    KvRead {
        /// The job.
        id: JobId,
        /// The failed KV get.
        #[source]
        source: JetStreamError,
    },
    /// Writing a job's view failed.
    #[error("writing the view of job {id}")]
    KvWrite {
        /// The job.
        id: JobId,
        /// The KV error.
        #[source]
        source: kv::UpdateError,
    },
    /// Other writers kept moving the view while this one tried to write it.
    #[error("writing the view of job {id}: too many revision conflicts")]
    Conflicts {
        /// The job.
        id: JobId,
    },
    /// The stored view is not a view (hand-edited, or written by an incompatible version).
    /// Never overwritten as if absent: `stemq projector --rebuild` replaces it.
    #[error("the stored view of job {id} (revision {revision}) does not parse")]
    CorruptView {
        /// The job.
        id: JobId,
        /// The entry's revision.
        revision: u64,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
}

impl ProjectorError {
    /// A low-cardinality name of the failure (the `kind` label of
    /// `stemq_projector_errors_total`).
    pub fn kind(&self) -> &'static str {
        match self {
            ProjectorError::Nats(_) | ProjectorError::JetStream(_) => "nats",
            ProjectorError::KvRead { .. } => "kv_read",
            ProjectorError::KvWrite { .. } => "kv_write",
            ProjectorError::Conflicts { .. } => "kv_conflict",
            ProjectorError::CorruptView { .. } => "corrupt_view",
        }
    }
}

impl From<ViewError> for ProjectorError {
    fn from(e: ViewError) -> ProjectorError {
        match e {
            ViewError::Unavailable { id, source } => ProjectorError::KvRead { id, source },
            ViewError::Corrupt { id, revision, source } => ProjectorError::CorruptView { id, revision, source },
        }
    }
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

/// Reads one job's view as stored: [`stemq_core::read::get_view`] (what readers use),
/// with the projector's error: `None` when there is none (never written, or deleted); an
/// error when the stored entry is not a view ([`ProjectorError::CorruptView`]).
pub async fn get_view(kv: &kv::Store, id: &JobId) -> Result<Option<(JobView, u64)>, ProjectorError> {
    Ok(read::get_view(kv, id).await?)
}

/// Runs until `shutdown`: folds job and progress events into the view.
pub async fn run(
    client: async_nats::Client,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), ProjectorError> {
    let js = jetstream::new(client);
    let kv = js.get_key_value(names::JOBS_BUCKET).await.map_err(JetStreamError::open("open bucket"))?;
    let jobs: PullConsumer = js
        .get_consumer_from_stream(names::PROJECTOR_CONSUMER, names::JOBS_STREAM)
        .await
        .map_err(JetStreamError::open("open projector consumer"))?;
    let progress: PullConsumer = js
        .get_consumer_from_stream(names::PROJECTOR_PROGRESS_CONSUMER, names::PROGRESS_STREAM)
        .await
        .map_err(JetStreamError::open("open progress consumer"))?;
    let options = PullOptions {
        batch: 1000,
        heartbeat: Some(Duration::from_secs(5)),
        expires: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    let jobs = pull::messages(jobs, options.clone(), shutdown.clone());
    let progress = pull::messages(progress, options, shutdown.clone());
    // A new subscription may be a recreated consumer over a recreated bucket (a
    // rebuild): the lanes drop their cached views when either count moves.
    let resubscriptions = [jobs.resubscriptions(), progress.resubscriptions()];

    let tracker = TaskTracker::new();
    let mut lanes = Vec::with_capacity(config.lanes);
    for lane in 0..config.lanes.max(1) {
        let (tx, rx) = mpsc::channel::<(jetstream::Message, bool)>(1024);
        lanes.push(tx);
        let lane = Lane::new(lane, kv.clone(), config.cache_per_lane, resubscriptions.clone());
        tracker.spawn(lane.run(rx));
    }
    for (messages, is_progress) in [(jobs, false), (progress, true)] {
        let lanes = lanes.clone();
        tracker.spawn(pump(messages, is_progress, lanes));
    }
    drop(lanes);
    tracker.close();
    info!(lanes = config.lanes, "projector running");
    tracker.wait().await;
    info!("projector stopped");
    Ok(())
}

/// Routes each message to its job's lane until the messages end (on shutdown).
async fn pump(mut messages: pull::Messages, is_progress: bool, lanes: Vec<mpsc::Sender<(jetstream::Message, bool)>>) {
    while let Some(msg) = messages.next().await {
        let lane = match names::job_id_of_subject(&msg.subject) {
            Some(id) => lane_of(&id, lanes.len()),
            None => {
                warn!(subject = %msg.subject, "not a job subject; skipping");
                let _ = msg.ack().await;
                continue;
            }
        };
        if lanes[lane].send((msg, is_progress)).await.is_err() {
            return;
        }
    }
}

fn lane_of(id: &JobId, n: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    (h.finish() % n as u64) as usize
}

/// The delay before a handed-back message comes again: 100 ms doubling with each
/// delivery, capped at [`MAX_RETRY_DELAY`].
fn retry_delay(msg: &jetstream::Message) -> Duration {
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1).clamp(1, 16) as u32;
    (Duration::from_millis(100) * 2u32.pow(delivered - 1)).min(MAX_RETRY_DELAY)
}

/// One lane: applies the events of its jobs, one job after the other.
struct Lane {
    lane: usize,
    kv: kv::Store,
    cap: usize,
    /// Views as last written, with their revision.
    cache: HashMap<JobId, (Option<JobView>, u64)>,
    /// Held jobs: the log sequences handed back and not yet applied (module docs), with
    /// when each was last handed back.
    held: HashMap<JobId, BTreeMap<u64, Instant>>,
    resubscriptions: [Arc<AtomicU64>; 2],
    seen_resubscriptions: u64,
}

impl Lane {
    fn new(lane: usize, kv: kv::Store, cap: usize, resubscriptions: [Arc<AtomicU64>; 2]) -> Lane {
        Lane { lane, kv, cap, cache: HashMap::new(), held: HashMap::new(), resubscriptions, seen_resubscriptions: 0 }
    }

    async fn run(mut self, mut rx: mpsc::Receiver<(jetstream::Message, bool)>) {
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
            let resubscriptions = self.resubscriptions.iter().map(|r| r.load(Ordering::SeqCst)).sum();
            if resubscriptions != self.seen_resubscriptions {
                self.seen_resubscriptions = resubscriptions;
                self.cache.clear();
            }
            self.expire_holds();
            let per_job = self.group(&mut batch).await;
            for (id, events) in per_job {
                self.job(id, events).await;
            }
            if self.cache.len() > self.cap {
                // Terminal views rarely change again: drop them first, then anything.
                self.cache.retain(|_, (v, _)| v.as_ref().map(|v| !v.status.is_terminal()).unwrap_or(false));
                if self.cache.len() > self.cap {
                    self.cache.clear();
                }
            }
        }
    }

    /// Forgets held events not delivered again for [`HOLD_EXPIRY`]: someone else acked
    /// them.
    fn expire_holds(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let now = Instant::now();
        self.held.retain(|id, h| {
            h.retain(|seq, at| {
                let keep = now.duration_since(*at) < HOLD_EXPIRY;
                if !keep {
                    warn!(job_id = %id, seq, "held event not delivered again; no longer holding the job for it");
                }
                keep
            });
            !h.is_empty()
        });
    }

    /// Reads the batch into events per job, each job's log events in log order.
    async fn group(&self, batch: &mut Vec<(jetstream::Message, bool)>) -> Vec<(JobId, Vec<Pending>)> {
        let lane = self.lane;
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
                    stemq_core::metrics::metrics().projector_error("unreadable_event");
                    let _ = msg.ack_with(AckKind::Term).await;
                    continue;
                }
            };
            // A request that does not hash to its job's id, or names another owner than
            // its subject's token, is not the job's request (a publisher may put
            // anything on subjects of its own owner): refused for good, like the worker
            // drops it; it stays in the log, and the job's real request is folded when
            // it comes.
            if let stemq_core::EventBody::Requested(r) = &event.body {
                let refused = if r.request.job_id() != event.subject || event.id != event.subject.as_str() {
                    Some((
                        "id_mismatch",
                        format!("the request hashes to {}, not {}", r.request.job_id(), event.subject),
                    ))
                } else {
                    names::check_request_owner(&msg.subject, &r.request.owner)
                        .err()
                        .map(|e| ("owner_mismatch", e.to_string()))
                        .or_else(|| {
                            names::check_request_route(&msg.subject, r.request.model, r.lane())
                                .err()
                                .map(|e| ("route_mismatch", e.to_string()))
                        })
                };
                if let Some((kind, error)) = refused {
                    warn!(lane, seq, subject = %msg.subject, %error, "refusing a request that is not its job's");
                    stemq_core::metrics::metrics().projector_error(kind);
                    let _ = msg.ack_with(AckKind::Term).await;
                    continue;
                }
            }
            match per_job.iter_mut().find(|(id, _)| *id == event.subject) {
                Some((_, v)) => v.push((pos, event, msg)),
                None => per_job.push((event.subject.clone(), vec![(pos, event, msg)])),
            }
        }
        for (_, events) in &mut per_job {
            // Redeliveries can overtake: put the log events back in log order, in the
            // slots log events held (progress events keep their places).
            let slots: Vec<usize> =
                events.iter().enumerate().filter(|(_, e)| matches!(e.0, Position::Log(_))).map(|(i, _)| i).collect();
            let mut order = slots.clone();
            order.sort_by_key(|&i| log_seq(&events[i].0));
            let mut taken: Vec<Option<Pending>> = events.drain(..).map(Some).collect();
            let mut out = Vec::with_capacity(taken.len());
            let mut next_log = order.into_iter();
            for i in 0..taken.len() {
                let from = if slots.binary_search(&i).is_ok() { next_log.next().expect("one per slot") } else { i };
                out.push(taken[from].take().expect("each taken once"));
            }
            *events = out;
        }
        per_job
    }

    /// Applies what may be applied of one job's events, holds back the rest.
    async fn job(&mut self, id: JobId, events: Vec<Pending>) {
        let in_batch: BTreeSet<u64> = events.iter().filter_map(|(p, _, _)| log_seq(p)).collect();
        // The first held event that is not here: nothing after it may be applied.
        let blocker = self.held.get(&id).and_then(|h| h.keys().find(|s| !in_batch.contains(s)).copied());
        let (ready, later): (Vec<Pending>, Vec<Pending>) = match blocker {
            None => (events, Vec::new()),
            Some(b) => events.into_iter().partition(|(p, _, _)| log_seq(p).is_some_and(|s| s < b)),
        };
        if !later.is_empty() {
            debug!(job_id = %id, blocker = ?blocker, events = later.len(), "job held: waiting for an earlier event");
            self.hand_back(&id, &later).await;
        }
        if ready.is_empty() {
            return;
        }
        let refs: Vec<(Position, &Event)> = ready.iter().map(|(p, e, _)| (*p, e)).collect();
        let span = tracing::info_span!("project", job_id = %id, events = refs.len(), trace_id = tracing::field::Empty);
        let tp = refs.iter().rev().find_map(|(_, e)| e.traceparent.as_deref());
        stemq_core::telemetry::set_parent(&span, tp);
        match tracing::Instrument::instrument(fold(&self.kv, &mut self.cache, &id, &refs), span).await {
            Ok(()) => {
                if let Some(h) = self.held.get_mut(&id) {
                    for s in ready.iter().filter_map(|(p, _, _)| log_seq(p)) {
                        h.remove(&s);
                    }
                    if h.is_empty() {
                        self.held.remove(&id);
                        info!(job_id = %id, "job released: its held events are applied");
                    }
                }
                for (_, _, msg) in &ready {
                    if let Err(e) = msg.ack().await {
                        warn!(job_id = %id, error = %e, "ack failed; the event will be redelivered and skipped");
                    }
                }
            }
            Err(e) => {
                stemq_core::metrics::metrics().projector_error(e.kind());
                let error = stemq_core::error::report(&e);
                if matches!(e, ProjectorError::CorruptView { .. }) {
                    error!(job_id = %id, kind = e.kind(), %error, "stored view does not parse; not overwriting it (stemq projector --rebuild replaces it)");
                } else {
                    warn!(job_id = %id, kind = e.kind(), %error, "projection failed; holding the job's events and retrying");
                }
                self.cache.remove(&id);
                self.hand_back(&id, &ready).await;
            }
        }
    }

    /// Naks `events` with a growing delay and holds their job until they are applied.
    async fn hand_back(&mut self, id: &JobId, events: &[Pending]) {
        let held = self.held.entry(id.clone()).or_default();
        for (pos, _, msg) in events {
            if let Some(s) = log_seq(pos) {
                held.insert(s, Instant::now());
            }
            let _ = msg.ack_with(AckKind::Nak(Some(retry_delay(msg)))).await;
        }
        if held.is_empty() {
            // Only progress was handed back: nothing to wait for.
            self.held.remove(id);
        }
    }
}

fn log_seq(p: &Position) -> Option<u64> {
    match p {
        Position::Log(s) => Some(*s),
        Position::Progress(_) => None,
    }
}

/// Applies a job's events in order and writes the result once, with compare-and-set;
/// on a concurrent writer it re-reads and retries. A stored entry that is not a view is
/// an error ([`ProjectorError::CorruptView`]), never overwritten.
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
                current = read::stored_view(kv, id).await?;
            }
            Err(source) => return Err(ProjectorError::KvWrite { id: id.clone(), source }),
        }
    }
    Err(ProjectorError::Conflicts { id: id.clone() })
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
    let mut s = js.get_stream(names::JOBS_STREAM).await.map_err(JetStreamError::open("stream info"))?;
    let info = s.info().await.map_err(JetStreamError::read("stream info"))?;
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
                js.get_consumer_from_stream(consumer, stream).await.map_err(JetStreamError::open("consumer"))?;
            let info = c.info().await.map_err(JetStreamError::read("consumer info"))?;
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
