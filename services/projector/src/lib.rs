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

mod lane;
pub mod ledger;
mod plan;
mod reset;
mod write;

use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, kv};
use stemq_core::error::JetStreamError;
use stemq_core::nats as names;
use stemq_core::pull::{self, PullOptions};
use stemq_core::read::{self, ViewError};
use stemq_core::readiness::Condition;
use stemq_core::{Event, JobId, JobView, Position};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

use crate::lane::{pump, Lane};
pub use crate::reset::{reset, wait_caught_up};

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
