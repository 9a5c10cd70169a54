//! stemq-projector: folds the job event log into the KV status view.
//!
//! This crate owns the write side of the status view. [`run`] consumes every job event
//! (and the compacted progress stream) with durable consumers, applies
//! [`stemq_core::apply`] and writes the result to the `stemq_jobs` bucket with
//! compare-and-set on the entry's revision. It is idempotent by stream sequence (each
//! view records the last applied position) and acks only after the write. Events of
//! different jobs are applied concurrently in lanes (one lane per hash of the job id), so
//! within one process the events of a job are applied in order while throughput scales;
//! a lane takes whatever has arrived for it as one batch, folds each job's events of the
//! batch into one write, and has the writes of all the batch's jobs in flight together;
//! the write of a job whose events so far leave it unfinished waits up to [`LINGER`]
//! for its next event (a job that ends within it is written once), a terminal event
//! never waits;
//! across processes (several projectors on the same consumers), order is not kept, and
//! need not be (next paragraph).
//! Both consumers are read through [`stemq_core::pull::messages`], so a server restart
//! or a recreated consumer (a rebuild) never stops the projector.
//!
//! **Per job, the view is the fold of its log, whoever applies what.** Idempotence by
//! position means an event at or below the view's `last_seq` changes nothing. But such
//! an event was not necessarily applied: it may have been overtaken by a newer event of
//! its job — applied by another projector sharing the consumer, or after this one's fold
//! of it failed and was handed back, or after its ack was lost and it came again behind
//! newer ones. The projector cannot tell "applied" from "overtaken" by position, so it
//! never guesses: a batch holding a log event at or below the view's `last_seq` (the
//! view as cached, or as re-read after a compare-and-set conflict) is an *anomaly*, and
//! the job is **refolded from the log**: its events up to the newest position known
//! (the batch's or the view's) are read back with direct gets (`stemq.jobs.<id>.>`, next
//! message by subject), refused requests left out as below, folded from nothing with
//! [`stemq_core::apply`], the live progress carried over from the stored view, and the
//! result written with compare-and-set like any other fold. A read that ends before the
//! newest position known (a replica behind, on R3) is an error
//! ([`ProjectorError::LogBehind`]), retried, never written. The normal path (events in
//! order) costs nothing more: no read of the log, no extra round trip. Any number of
//! projectors may therefore share the consumers: a view may for a moment miss an event
//! another projector still holds, and it is repaired when that event is folded (its
//! position is then at or below the view's). A fold that fails (a KV write refused, a
//! stored view that does not parse) hands its events back (nak, with a delay growing with
//! the delivery count, capped at [`MAX_RETRY_DELAY`]); later events of the job are
//! applied meanwhile and the failed one, when it comes back, is an anomaly like any other.
//! Progress has its own positions and only ever replaces older progress, so a progress
//! event at or below `progress_seq` is simply stale (a newer one is in the view).
//!
//! **A request for another owner is refused.** A `requested` event on
//! `stemq.jobs.<id>.requested.<token>` whose request names an owner with another token
//! is never folded (terminated, logged, counted as
//! `stemq_projector_errors_total{kind="owner_mismatch"}`, `id_mismatch` likewise, as is
//! any event whose job is not its subject's): the worker drops it too, so the job's view
//! waits for the job's real request.
//!
//! **A view that does not parse is an error**, never an absent view to overwrite:
//! [`get_view`] returns [`ProjectorError::CorruptView`], the fold refuses to write over
//! it (its events are handed back as above, logged with its `job_id`, and counted in
//! `stemq_projector_errors_total{kind="corrupt_view"}`), other jobs keep flowing, and
//! `stemq projector --rebuild` replaces it from the log.
//!
//! It also closes credit reservations from job outcomes ([`ledger`]).
//!
//! The view is disposable: [`reset`] drops the bucket and the consumers, and replays
//! the log into an identical view. Readers never depend on this crate: they read the
//! view, the list index and its cursor through [`stemq_core::read`], which this crate
//! uses too (its [`get_view`] is that reader with the projector's error).

pub mod ledger;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, kv, AckKind};
use futures::StreamExt;
use stemq_core::error::JetStreamError;
use stemq_core::nats::{self as names, Settings};
use stemq_core::pull::{self, PullOptions};
use stemq_core::read::{self, ViewError};
use stemq_core::readiness::Condition;
use stemq_core::{apply, Event, JobId, JobView, Position};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

/// One delivered event waiting to be folded: where it sits in the log, the event, and
/// the message to ack once its job's view is written.
type Pending = (Position, Event, jetstream::Message);

/// How long the write of an unfinished job (queued, running) may wait for the job's
/// next event: a job that ends within it costs one KV write for its whole life instead
/// of one per event (requested, started, outcome). Terminal events are written at once,
/// so the time to a terminal view does not grow; a queued or running status shows up
/// at most this much later. 10 ms: under load a job's `started` and outcome are a few
/// milliseconds apart (2 ms left a third of them written apart: 2.4 writes a job at
/// throughput, 2.0 with 10 ms; `docs/benchmarks.md`, "Settings, each against its alternative").
pub const LINGER: Duration = Duration::from_millis(10);

/// The longest delay before a handed-back event comes again.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(5);

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
    /// Reading a job's events back from the log (to refold it) failed.
    #[error("reading the log of job {id}")]
    LogRead {
        /// The job.
        id: JobId,
        /// The failed direct get.
        #[source]
        source: JetStreamError,
    },
    /// The log read back to refold a job ended before an event known to be in it: the
    /// replica that answered is behind (R3 direct gets may be served by any replica).
    /// Never written: a view folded from a shorter log would drop that event for good.
    #[error("refolding job {id}: the log read back ends at {read}, before event {wanted}")]
    LogBehind {
        /// The job.
        id: JobId,
        /// The newest position known to hold one of the job's events.
        wanted: u64,
        /// The newest position read back.
        read: u64,
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
            ProjectorError::LogRead { .. } => "log_read",
            ProjectorError::LogBehind { .. } => "log_behind",
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
    /// Met once the projector consumes the job and progress streams: the process's
    /// `/readyz` condition.
    pub ready: Option<Condition>,
}

impl Default for Config {
    fn default() -> Self {
        Config { lanes: 32, cache_per_lane: 4096, ready: None }
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
    let log = js.get_stream_no_info(names::JOBS_STREAM).await.map_err(JetStreamError::open("open job stream"))?;
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
        let lane = Lane::new(lane, kv.clone(), log.clone(), config.cache_per_lane, resubscriptions.clone());
        tracker.spawn(lane.run(rx));
    }
    for (messages, is_progress) in [(jobs, false), (progress, true)] {
        let lanes = lanes.clone();
        tracker.spawn(pump(messages, is_progress, lanes));
    }
    // Credits: the reservations of ended jobs are settled or refunded here.
    tracker.spawn(ledger::run(js.clone(), shutdown.clone()));
    drop(lanes);
    tracker.close();
    config.ready.iter().for_each(Condition::met);
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
    /// The job log, read back when a job is refolded.
    log: jetstream::stream::Stream<()>,
    cap: usize,
    /// Views as last written, with their revision.
    cache: HashMap<JobId, (Option<JobView>, u64)>,
    resubscriptions: [Arc<AtomicU64>; 2],
    seen_resubscriptions: u64,
}

impl Lane {
    fn new(
        lane: usize,
        kv: kv::Store,
        log: jetstream::stream::Stream<()>,
        cap: usize,
        resubscriptions: [Arc<AtomicU64>; 2],
    ) -> Lane {
        Lane { lane, kv, log, cap, cache: HashMap::new(), resubscriptions, seen_resubscriptions: 0 }
    }

    async fn run(mut self, mut rx: mpsc::Receiver<(jetstream::Message, bool)>) {
        let mut batch = Vec::new();
        // Unfinished jobs whose write waits for their next event ([`LINGER`]): until
        // when, and their events so far (not acked yet).
        let mut held: HashMap<JobId, (Instant, Vec<Pending>)> = HashMap::new();
        loop {
            // The next message, or `None` when a held job is due first; the lane ends
            // when the channel does (on shutdown), writing what it holds.
            let next = match held.values().map(|(until, _)| *until).min() {
                None => rx.recv().await.map(Some),
                Some(due) => match tokio::time::timeout_at(due, rx.recv()).await {
                    Ok(m) => m.map(Some),
                    Err(_) => Some(None),
                },
            };
            let closed = next.is_none();
            // Take whatever else is already waiting: events of one job that arrive together
            // (requested, started, outcome under load) become one KV write.
            batch.clear();
            batch.extend(next.flatten());
            while !closed && batch.len() < 256 {
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
            let mut per_job = self.group(&mut batch).await;
            // A held job's earlier events go before its new ones; held jobs that are due
            // (or all of them, when the lane is closing) are written now.
            let now = Instant::now();
            let mut holds: Vec<(JobId, Instant)> = Vec::new();
            for (id, events) in &mut per_job {
                let until = match held.remove(id) {
                    Some((until, mut before)) => {
                        before.append(events);
                        *events = before;
                        in_log_order(events);
                        until
                    }
                    None => now + LINGER,
                };
                if !closed && until > now && waits_for_more(events) {
                    holds.push((id.clone(), until));
                }
            }
            for (id, until) in holds {
                let at = per_job.iter().position(|(j, _)| *j == id).expect("the job is in the batch");
                let (_, events) = per_job.swap_remove(at);
                held.insert(id, (until, events));
            }
            let due: Vec<JobId> =
                held.iter().filter(|(_, (until, _))| closed || *until <= now).map(|(id, _)| id.clone()).collect();
            for id in due {
                let (_, events) = held.remove(&id).expect("listed");
                per_job.push((id, events));
            }
            self.jobs(per_job).await;
            if self.cache.len() > self.cap {
                // Terminal views rarely change again: drop them first, then anything.
                self.cache.retain(|_, (v, _)| v.as_ref().map(|v| !v.status.is_terminal()).unwrap_or(false));
                if self.cache.len() > self.cap {
                    self.cache.clear();
                }
            }
            if closed {
                return;
            }
        }
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
            if let Some((kind, error)) = refusal(&msg.subject, &event) {
                warn!(lane, seq, subject = %msg.subject, %error, "refusing an event that is not its subject's job's");
                stemq_core::metrics::metrics().projector_error(kind);
                let _ = msg.ack_with(AckKind::Term).await;
                continue;
            }
            match per_job.iter_mut().find(|(id, _)| *id == event.subject) {
                Some((_, v)) => v.push((pos, event, msg)),
                None => per_job.push((event.subject.clone(), vec![(pos, event, msg)])),
            }
        }
        for (_, events) in &mut per_job {
            in_log_order(events);
        }
        per_job
    }

    /// Folds the batch's jobs into their views, all at once (their KV writes are in
    /// flight together, one round trip for the batch rather than one per job), then
    /// acks each job's events, or hands them all back when its fold failed. Each job
    /// appears once per batch, so the folds touch different views.
    async fn jobs(&mut self, per_job: Vec<(JobId, Vec<Pending>)>) {
        let (kv, log, cache) = (&self.kv, &self.log, &self.cache);
        let folds = per_job.iter().map(|(id, events)| {
            let refs: Vec<(Position, &Event)> = events.iter().map(|(p, e, _)| (*p, e)).collect();
            let span =
                tracing::info_span!("project", job_id = %id, events = refs.len(), trace_id = tracing::field::Empty);
            let tp = refs.iter().rev().find_map(|(_, e)| e.traceparent.as_deref());
            stemq_core::telemetry::set_parent(&span, tp);
            let cached = cache.get(id).cloned();
            let job = Job { kv, log, id };
            tracing::Instrument::instrument(async move { job.fold(cached, &refs).await }, span)
        });
        let results = futures::future::join_all(folds).await;
        for ((id, events), result) in per_job.into_iter().zip(results) {
            match result {
                Ok(cached) => {
                    match cached {
                        Cached::Keep => {}
                        Cached::Set(view, revision) => {
                            self.cache.insert(id.clone(), (Some(*view), revision));
                        }
                        Cached::Drop => {
                            self.cache.remove(&id);
                        }
                    }
                    for (_, _, msg) in &events {
                        if let Err(e) = msg.ack().await {
                            warn!(job_id = %id, error = %e, "ack failed; the event will be redelivered and refolded");
                        }
                    }
                }
                Err(e) => {
                    stemq_core::metrics::metrics().projector_error(e.kind());
                    let error = stemq_core::error::report(&e);
                    if matches!(e, ProjectorError::CorruptView { .. }) {
                        error!(job_id = %id, kind = e.kind(), %error, "stored view does not parse; not overwriting it (stemq projector --rebuild replaces it)");
                    } else {
                        warn!(job_id = %id, kind = e.kind(), %error, "projection failed; handing the job's events back");
                    }
                    self.cache.remove(&id);
                    for (_, _, msg) in &events {
                        let _ = msg.ack_with(AckKind::Nak(Some(retry_delay(msg)))).await;
                    }
                }
            }
        }
    }
}

/// What a lane's cache holds for a job after its fold.
#[derive(Debug)]
enum Cached {
    /// What it held.
    Keep,
    /// This view as written, at this revision.
    Set(Box<JobView>, u64),
    /// Nothing (the view was re-read and not written: the next fold reads it again).
    Drop,
}

/// Redeliveries can overtake: puts one job's log events back in log order, in the slots
/// log events held (progress events keep their places).
fn in_log_order(events: &mut Vec<Pending>) {
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

/// True when a job's write may wait for its next event ([`LINGER`]): none of its
/// events so far ends it. A terminal event is written at once.
fn waits_for_more<T>(events: &[(Position, Event, T)]) -> bool {
    !events.iter().any(|(_, e, _)| e.body.is_terminal())
}

fn log_seq(p: &Position) -> Option<u64> {
    match p {
        Position::Log(s) => Some(*s),
        Position::Progress(_) => None,
    }
}

/// Why an event on `subject` is never folded, if it is not: an event whose job is not
/// its subject's (the subject's owner published it for another job); a request that
/// does not hash to its job's id, or names another owner than its subject's token (a
/// publisher may put anything on subjects of its own owner). The worker drops such a
/// request too; it stays in the log, and the job's real request is folded when it
/// comes. Returns the error kind (`stemq_projector_errors_total{kind}`) and a sentence.
/// The normal path and the refold leave out the same events, so both fold the same log.
fn refusal(subject: &str, event: &Event) -> Option<(&'static str, String)> {
    if let Some(id) = names::job_id_of_subject(subject).filter(|id| *id != event.subject) {
        return Some(("id_mismatch", format!("an event of job {} on the subject of job {id}", event.subject)));
    }
    let stemq_core::EventBody::Requested(r) = &event.body else { return None };
    if r.request.job_id() != event.subject || event.id != event.subject.as_str() {
        return Some(("id_mismatch", format!("the request hashes to {}, not {}", r.request.job_id(), event.subject)));
    }
    names::check_request_owner(subject, &r.request.owner).err().map(|e| ("owner_mismatch", e.to_string())).or_else(
        || {
            names::check_request_route(subject, r.request.model, r.lane())
                .err()
                .map(|e| ("route_mismatch", e.to_string()))
        },
    )
}

/// What to do with a batch of one job's events, given its view.
#[derive(Debug, PartialEq)]
enum Plan {
    /// The events change nothing.
    Unchanged,
    /// The view with the events applied, in order.
    Write(Box<JobView>),
    /// A log event at or below the view's position: refold the job's log up to this
    /// sequence (module docs).
    Refold {
        /// The newest log position known: the batch's or the view's.
        upto: u64,
    },
}

/// The pure part of a fold: apply the events to `view` unless one of them is behind it.
fn plan(view: Option<&JobView>, events: &[(Position, &Event)]) -> Plan {
    let last = view.map_or(0, |v| v.last_seq);
    let newest = events.iter().filter_map(|(p, _)| log_seq(p)).max();
    if view.is_some() && events.iter().filter_map(|(p, _)| log_seq(p)).any(|s| s <= last) {
        return Plan::Refold { upto: newest.unwrap_or(last).max(last) };
    }
    let mut next: Option<JobView> = None;
    for (pos, event) in events {
        if let Some(v) = apply(next.as_ref().or(view), *pos, event) {
            next = Some(v);
        }
    }
    next.map_or(Plan::Unchanged, |v| Plan::Write(Box::new(v)))
}

/// A view refolded from the log keeps the live progress of the stored one: progress
/// lives in another stream, and only the newest counts. The stored view's progress
/// position always; its progress and time too when both are running the same attempt
/// (progress of another attempt, or of an ended job, is not news).
fn keep_progress(refolded: &mut JobView, stored: &JobView) {
    refolded.progress_seq = refolded.progress_seq.max(stored.progress_seq);
    let same_run = refolded.status == stemq_core::JobStatus::Running
        && stored.status == stemq_core::JobStatus::Running
        && refolded.attempt == stored.attempt;
    if same_run && stored.progress.is_some() {
        refolded.progress = stored.progress.clone();
        refolded.updated_at = refolded.updated_at.max(stored.updated_at);
    }
}

/// One job's view and where its events are.
struct Job<'a> {
    kv: &'a kv::Store,
    log: &'a jetstream::stream::Stream<()>,
    id: &'a JobId,
}

impl Job<'_> {
    /// Applies the job's events in order to `cached` (the lane's cached view, if any)
    /// and writes the result once, with compare-and-set; on a concurrent writer it
    /// re-reads and plans again. An event behind the view refolds the job from the log
    /// (module docs). A stored entry that is not a view is an error
    /// ([`ProjectorError::CorruptView`]), never overwritten. Returns what the lane's
    /// cache should hold for the job now.
    async fn fold(
        &self,
        cached: Option<(Option<JobView>, u64)>,
        events: &[(Position, &Event)],
    ) -> Result<Cached, ProjectorError> {
        let id = self.id;
        // An unknown job is most likely new: try creating it before paying for a read.
        let mut reread = false;
        let mut current = cached.unwrap_or((None, 0));
        let unchanged = |reread: bool| if reread { Cached::Drop } else { Cached::Keep };
        for _ in 0..10 {
            let next = match plan(current.0.as_ref(), events) {
                Plan::Unchanged => {
                    debug!(job_id = %id, "events change nothing");
                    return Ok(unchanged(reread));
                }
                Plan::Write(v) => *v,
                Plan::Refold { upto } => {
                    stemq_core::metrics::metrics().projector_refold();
                    let Some(v) = self.refold(upto, current.0.as_ref(), events).await? else {
                        return Ok(unchanged(reread));
                    };
                    if current.0.as_ref() == Some(&v) {
                        debug!(job_id = %id, upto, "refolded: the view was right");
                        return Ok(unchanged(reread));
                    }
                    info!(job_id = %id, upto, "refolded from the log: an event had been overtaken");
                    v
                }
            };
            let body = serde_json::to_vec(&next).expect("views serialise");
            match self.kv.update(id.as_str(), body.into(), current.1).await {
                Ok(rev) => return Ok(Cached::Set(Box::new(next), rev)),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    // It exists (or another writer moved it): read the real revision, retry.
                    reread = true;
                    current = read::stored_view(self.kv, id).await?;
                }
                Err(source) => return Err(ProjectorError::KvWrite { id: id.clone(), source }),
            }
        }
        Err(ProjectorError::Conflicts { id: id.clone() })
    }

    /// The job's view as its log up to `upto` folds it (refused requests and unreadable
    /// events left out, as the projector leaves them out), with the live progress of
    /// `stored` and the batch's progress events on top. `None` when the log holds no
    /// event of the job.
    async fn refold(
        &self,
        upto: u64,
        stored: Option<&JobView>,
        events: &[(Position, &Event)],
    ) -> Result<Option<JobView>, ProjectorError> {
        use jetstream::stream::DirectGetErrorKind::NotFound;
        let filter = format!("{}.{}.>", names::JOBS_PREFIX, self.id);
        let mut view: Option<JobView> = None;
        let mut from = 1;
        let mut read = 0;
        while from <= upto {
            let m = match self.log.direct_get_builder().sequence(from).next_by_subject(filter.as_str()).send().await {
                Ok(m) => m,
                Err(e) if e.kind() == NotFound => break,
                Err(e) => {
                    return Err(ProjectorError::LogRead {
                        id: self.id.clone(),
                        source: JetStreamError::read("direct get")(e),
                    })
                }
            };
            from = m.sequence + 1;
            if m.sequence > upto {
                break;
            }
            read = m.sequence;
            let Ok(event) = Event::from_slice(&m.payload) else { continue };
            if refusal(m.subject.as_str(), &event).is_some() {
                continue;
            }
            if let Some(v) = apply(view.as_ref(), Position::Log(m.sequence), &event) {
                view = Some(v);
            }
        }
        // `upto` is the position of one of the job's events (the batch's, or the one the
        // view was last moved by): a read that stops short of it is behind, not the log.
        if read < upto {
            return Err(ProjectorError::LogBehind { id: self.id.clone(), wanted: upto, read });
        }
        let Some(mut view) = view else { return Ok(stored.cloned()) };
        if let Some(stored) = stored {
            keep_progress(&mut view, stored);
        }
        for (pos, event) in events.iter().filter(|(p, _)| matches!(p, Position::Progress(_))) {
            if let Some(v) = apply(Some(&view), *pos, event) {
                view = v;
            }
        }
        Ok(Some(view))
    }
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

#[cfg(test)]
mod tests {
    //! Given a stored view, when a batch of events arrives, then the plan.
    use super::*;
    use stemq_core::event::{EventBody, Progress, Started};
    use stemq_core::request::{JobRequest, ANONYMOUS};
    use stemq_core::JobStatus;

    fn events() -> (Event, Event, Event) {
        let request = JobRequest::from_value(serde_json::json!({"audio_uri": "file:///a.wav"}))
            .unwrap()
            .normalize(ANONYMOUS)
            .unwrap();
        let id = request.job_id();
        let started = |attempt| {
            Event::new(&id, "/test", EventBody::Started(Started { attempt, worker: "w".into(), device: "cpu".into() }))
        };
        (Event::requested(request, None, None, "/test"), started(1), started(2))
    }

    fn folded(events: &[(u64, &Event)]) -> JobView {
        let mut view = None;
        for (s, e) in events {
            view = apply(view.as_ref(), Position::Log(*s), e).or(view);
        }
        view.unwrap()
    }

    #[test]
    fn events_after_the_view_are_applied_in_order() {
        let (requested, first, second) = events();
        let view = folded(&[(10, &requested)]);
        match plan(Some(&view), &[(Position::Log(11), &first), (Position::Log(14), &second)]) {
            Plan::Write(v) => assert_eq!(*v, folded(&[(10, &requested), (11, &first), (14, &second)])),
            other => panic!("{other:?}"),
        }
        assert_eq!(plan(None, &[(Position::Log(10), &requested)]), Plan::Write(Box::new(view)));
    }

    #[test]
    fn an_event_behind_the_view_refolds_up_to_the_newest_position_known() {
        let (requested, first, second) = events();
        // Another projector applied 12 before this one got 11: 11 is not "already applied".
        let view = folded(&[(10, &requested), (12, &second)]);
        assert_eq!(plan(Some(&view), &[(Position::Log(11), &first)]), Plan::Refold { upto: 12 });
        assert_eq!(
            plan(Some(&view), &[(Position::Log(11), &first), (Position::Log(15), &second)]),
            Plan::Refold { upto: 15 }
        );
        // A plain redelivery looks the same, and is refolded too (to no change).
        assert_eq!(plan(Some(&view), &[(Position::Log(12), &second)]), Plan::Refold { upto: 12 });
    }

    #[test]
    fn only_unfinished_jobs_wait_for_their_next_event() {
        let (requested, first, _) = events();
        let ended = Event::new(
            &requested.subject,
            "/test",
            EventBody::Cancelled(stemq_core::event::Cancelled { attempt: 1, interrupted: false }),
        );
        let batch = |events: &[&Event]| -> Vec<(Position, Event, ())> {
            events.iter().zip(10..).map(|(e, s)| (Position::Log(s), (*e).clone(), ())).collect()
        };
        assert!(waits_for_more(&batch(&[&requested])), "queued");
        assert!(waits_for_more(&batch(&[&requested, &first])), "running");
        assert!(!waits_for_more(&batch(&[&requested, &first, &ended])), "ended: written at once");
        assert!(!waits_for_more(&batch(&[&ended])));
    }

    #[test]
    fn stale_progress_is_no_anomaly() {
        let (requested, first, _) = events();
        let id = requested.subject.clone();
        let progress = |percent| {
            Event::new(
                &id,
                "/test",
                EventBody::Progress(Progress { attempt: 1, percent, stage: "separate".into(), message: None }),
            )
        };
        let (p1, p2) = (progress(10.0), progress(20.0));
        let view = folded(&[(10, &requested), (11, &first)]);
        let Plan::Write(with_p2) = plan(Some(&view), &[(Position::Progress(7), &p2)]) else { panic!() };
        assert_eq!(plan(Some(&with_p2), &[(Position::Progress(5), &p1)]), Plan::Unchanged);
    }

    #[test]
    fn the_normal_path_and_the_refold_refuse_the_same_events() {
        let (requested, first, _) = events();
        let id = requested.subject.clone();
        let own = names::job_subject(&id, names::SubjectKind::Started);
        assert_eq!(refusal(&own, &first), None);
        let routed = |owner: &str| {
            let EventBody::Requested(r) = &requested.body else { unreachable!() };
            names::request_subject(&id, owner, r.request.model, r.lane())
        };
        assert_eq!(refusal(&routed(ANONYMOUS), &requested), None);
        assert_eq!(refusal(&names::unrouted_request_subject(&id, ANONYMOUS), &requested), None);
        let other = JobId::parse(&"cd".repeat(32)).unwrap();
        let elsewhere = names::job_subject(&other, names::SubjectKind::Started);
        assert_eq!(refusal(&elsewhere, &first).map(|r| r.0), Some("id_mismatch"));
        assert_eq!(refusal(&routed("someone-else"), &requested).map(|r| r.0), Some("owner_mismatch"));
    }

    #[test]
    fn a_refolded_view_keeps_the_live_progress_of_the_same_run_only() {
        let (requested, first, second) = events();
        let id = requested.subject.clone();
        let p = Event::new(
            &id,
            "/test",
            EventBody::Progress(Progress { attempt: 1, percent: 40.0, stage: "separate".into(), message: None }),
        );
        let running = folded(&[(10, &requested), (11, &first)]);
        let stored = apply(Some(&running), Position::Progress(3), &p).unwrap();
        let mut refolded = running.clone();
        keep_progress(&mut refolded, &stored);
        assert_eq!(refolded, stored, "same attempt, still running: the progress stays");

        let mut next_attempt = folded(&[(10, &requested), (11, &first), (12, &second)]);
        keep_progress(&mut next_attempt, &stored);
        assert_eq!(next_attempt.progress, None, "progress of attempt 1 is not attempt 2's");
        assert_eq!(next_attempt.progress_seq, 3, "but its position is kept: older progress stays stale");
        assert_eq!(next_attempt.status, JobStatus::Running);
    }
}
