//! stemq-projector: folds the job event log into the KV status view.
//!
//! This crate owns the write side of the status view. [`run`] consumes every job event
//! (and the compacted progress stream) with durable consumers, applies
//! [`stemq_core::apply`] and writes the result to the `stemq_jobs` bucket with
//! compare-and-set on the entry's revision, acking only after the write. The job log
//! is pulled by one projector at a time (the one holding the [`lease`]) and acked
//! cumulatively, one ack for a folded prefix of the log; the progress stream, by
//! every projector, each event acked alone.
//!
//! | module | owns |
//! |---|---|
//! | [`lease`] | which projector pulls the job log |
//! | `acks` | the job log's cumulative acks: only ever over a prefix folded here |
//! | `lane` | each job's events in order, in the lane of its id; batches; [`LINGER`] |
//! | `plan` | the pure part: events never folded, apply or refold, whether a write waits |
//! | `write` | one job's fold written with compare-and-set, or refolded from the log |
//! | `reset` | the view dropped and recreated, for a replay of the log ([`reset()`]) |
//! | [`ledger`] | credit reservations closed from job outcomes |
//! | [`metrics`] | the fold's own figures: errors by kind, refolds |
//!
//! What holds, however many projectors share the consumers:
//! - **Per job, the view is the fold of its log, whoever applies what.** A log event at
//!   or below the view's `last_seq` may have been applied or only overtaken; either way
//!   the job is refolded from the log, never skipped on trust. A fold that fails hands
//!   its events back (nak, delay capped at [`MAX_RETRY_DELAY`]).
//! - **An event that is not its subject's job's is never folded**, a request for
//!   another owner included.
//! - **A view that does not parse is an error** ([`ProjectorError::CorruptView`]), never
//!   overwritten; `stemq projector --rebuild` replaces it from the log.
//! - **No event is acked unfolded**, however many projectors pull: a projector acks
//!   only up to the end of a prefix of the log it folded itself, contiguous from the
//!   consumer's ack floor.
//! - **The view is disposable**: [`reset()`] and a replay give an identical one. Readers
//!   never depend on this crate: they read through [`stemq_nats::read`], as it does.
//!
//! Why it is built so: docs/architecture.md, "The view", "Inside the projector" and
//! "Two projectors, two relays".

mod acks;
mod lane;
pub mod lease;
pub mod ledger;
pub mod metrics;
mod plan;
mod reset;
mod write;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::AckPolicy, consumer::PullConsumer, kv};
use futures::StreamExt;
use stemq_core::{Event, JobId, JobView, Position};
use stemq_nats as names;
use stemq_nats::error::JetStreamError;
use stemq_nats::pull::{self, PullOptions};
use stemq_nats::read::{self, ViewError};
use stemq_telemetry::readiness::Condition;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::acks::Acks;
use crate::lane::{pump, route, Lane};
pub use crate::reset::{reset, wait_caught_up};

/// One delivered event waiting to be folded: where it sits in the log, the event, and
/// the message to ack once its job's view is written.
type Pending = (Position, Event, lane::Delivery);

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
    /// A job's first view has no request, and no request of the job could be read from
    /// the log to learn whose it is (the view's key names its owner): the replica that
    /// answered is behind. Never written under a guessed key.
    #[error("job {id}: no request read from the log to key its view by")]
    RequestUnread {
        /// The job.
        id: JobId,
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
            ProjectorError::LogBehind { .. } | ProjectorError::RequestUnread { .. } => "log_behind",
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

/// Reads one job's view as stored: [`stemq_nats::read::get_view`] (what readers use),
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
    // Every family is exported from the start, at zero.
    metrics::metrics();
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
    let progress = pull::messages(progress, options.clone(), shutdown.clone());
    // A new subscription may be a recreated consumer over a recreated bucket (a
    // rebuild): the lanes drop their cached views when either count moves. The job
    // log's counts each subscription of each lease.
    let log_subscriptions = Arc::new(AtomicU64::new(0));
    let resubscriptions = [log_subscriptions.clone(), progress.resubscriptions()];

    let tracker = TaskTracker::new();
    let mut lanes = Vec::with_capacity(config.lanes);
    for lane in 0..config.lanes.max(1) {
        let (tx, rx) = mpsc::channel::<lane::Delivery>(1024);
        lanes.push(tx);
        let lane = Lane::new(lane, kv.clone(), log.clone(), config.cache_per_lane, resubscriptions.clone());
        tracker.spawn(lane.run(rx));
    }
    tracker.spawn(pump(progress, lanes.clone()));
    let (lease, lease_task) = lease::hold(kv.clone(), uuid::Uuid::new_v4().to_string(), shutdown.clone());
    let puller = LogPuller { consumer: jobs, log: log.clone(), options, subscriptions: log_subscriptions };
    tracker.spawn(puller.run(lease, lanes.clone(), tracker.clone(), shutdown.clone()));
    // Credits: the reservations of ended jobs are settled or refunded here.
    tracker.spawn(ledger::run(js.clone(), shutdown.clone()));
    drop(lanes);
    tracker.close();
    config.ready.iter().for_each(Condition::met);
    info!(lanes = config.lanes, "projector running");
    tracker.wait().await;
    let _ = lease_task.await;
    info!("projector stopped");
    Ok(())
}

/// Pulls the job log while this projector holds the lease ([`lease`]), each event's ack
/// left to the folded prefix ([`acks`]).
struct LogPuller {
    consumer: PullConsumer,
    log: jetstream::stream::Stream<()>,
    options: PullOptions,
    /// Bumped with every subscription (the lanes' caches follow it).
    subscriptions: Arc<AtomicU64>,
}

impl LogPuller {
    /// Whether the consumer acks all. One made by an earlier release acks each event
    /// until `stemq nats apply` recreates it: its events are then acked one by one.
    async fn acks_all(&self) -> bool {
        let mut consumer = self.consumer.clone();
        match consumer.info().await {
            Ok(info) if info.config.ack_policy != AckPolicy::All => {
                warn!("the projector consumer acks each event: acking them one by one (`stemq nats apply` makes it ack all)");
                false
            }
            _ => true,
        }
    }

    async fn run(
        self,
        mut lease: watch::Receiver<bool>,
        lanes: Vec<mpsc::Sender<lane::Delivery>>,
        tracker: TaskTracker,
        shutdown: CancellationToken,
    ) {
        loop {
            // Until this projector holds the lease.
            while !*lease.borrow_and_update() {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    changed = lease.changed() => if changed.is_err() { return },
                }
            }
            let term = shutdown.child_token();
            let mut messages = pull::messages(self.consumer.clone(), self.options.clone(), term.clone());
            let generations = messages.resubscriptions();
            let acks = Acks::start(self.consumer.clone(), self.log.clone(), term.clone(), &tracker);
            self.subscriptions.fetch_add(1, Ordering::SeqCst);
            let mut seen = 0;
            let mut cumulative = self.acks_all().await;
            loop {
                let msg = tokio::select! {
                    _ = term.cancelled() => break,
                    changed = lease.changed() => match changed {
                        Ok(()) if *lease.borrow_and_update() => continue,
                        _ => break,
                    },
                    m = messages.next() => match m {
                        Some(m) => m,
                        None => break,
                    },
                };
                let generation = generations.load(Ordering::SeqCst);
                if generation != seen {
                    seen = generation;
                    self.subscriptions.fetch_add(1, Ordering::SeqCst);
                    cumulative = self.acks_all().await;
                }
                let answer = if cumulative {
                    acks.received(&msg, generation);
                    lane::Answer::Prefix(acks.clone(), generation)
                } else {
                    lane::Answer::Each
                };
                let d = lane::Delivery { msg, progress: false, answer };
                if !route(d, &lanes).await {
                    break;
                }
            }
            // Lost the lease, or stopping: the pull ends; what the lanes fold of it is
            // still acked.
            term.cancel();
            if shutdown.is_cancelled() {
                return;
            }
            info!("projector lease lost: no longer pulling the job log");
        }
    }
}
