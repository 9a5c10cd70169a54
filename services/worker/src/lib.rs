//! stemq-worker: runs separation jobs from the queue, each exactly once in effect.
//!
//! This crate owns the work side of the pipeline:
//! - [`run`] serves the pools of the models its engine runs ([`Engine::models`]): it
//!   pulls from their consumers (`workers-<model>-<lane>`, every interactive lane before
//!   any batch lane) only as many jobs as it has free slots (`concurrency`), so nothing
//!   waits in a local buffer while its ack deadline runs; it announces itself in the
//!   worker registry (`stemq_workers`: models, devices, version, free memory, jobs
//!   running) every few seconds and leaves it on shutdown; and it runs the dead-letter
//!   handler ([`deadletter`]);
//! - [`job`] handles one delivery: skip if already done, start, keep the ack deadline
//!   alive with progress acks, run the engine (with the out-of-memory ladder and the hard
//!   time limit), store outputs, publish the outcome, and only then ack;
//!   The decision of what an attempt's result means is the pure `job::decide`;
//!   `keepalive` keeps the delivery alive and publishes progress, `outputs` stores the
//!   stems and the manifest;
//! - [`fetch`] reads inputs from external URLs, where the operator allows them, under
//!   the address policy checked again at connect time;
//! - [`backoff`] spaces retries of transient failures;
//! - [`isolate`] runs attempts in engine host processes, so a job that crashes its
//!   process costs only its own attempt;
//! - [`scratch`] owns local scratch space and sweeps what dead workers left.
//!
//! Each pool consumer's configuration is the single source of truth for its queue
//! settings: ack wait and max deliver are read from it at start and re-read every second
//! ([`QueueSettings`]), so `stemq nats apply` takes effect on running workers (progress
//! acks follow a shorter ack wait at once) and no flag of the worker can disagree with it.
//!
//! On shutdown the worker stops pulling and leaves the registry, the current jobs finish within the grace period
//! and the process exits; a job still running when the grace period ends is handed back
//! (nak) for another worker, with no outcome recorded.

pub mod backoff;
mod control;
mod credits;
pub mod deadletter;
pub mod fetch;
pub mod gpu;
pub mod hearing;
pub mod isolate;
pub mod job;
mod keepalive;
pub mod metrics;
mod outputs;
pub mod scratch;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use stemq_core::engine::Engine;
use stemq_core::request::{Model, Priority};
use stemq_nats as names;
use stemq_nats::error::JetStreamError;
use stemq_nats::registry::{self, WorkerInfo};
use stemq_storage::Store;
use stemq_telemetry::readiness::Condition;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

pub use backoff::Backoff;

/// Worker failures at start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A JetStream call failed.
    #[error(transparent)]
    JetStream(#[from] JetStreamError),
    /// The scratch directory is unusable.
    #[error("scratch directory {0}: {1}")]
    Scratch(PathBuf, #[source] std::io::Error),
    /// The engine runs no model, so there is no pool to serve.
    #[error("the engine `{0}` runs no model (is its model folder empty?)")]
    NoModels(String),
    /// The subscription to new requests failed.
    #[error("subscribing to new requests: {0}")]
    Subscribe(#[source] async_nats::SubscribeError),
}

/// Worker configuration.
#[derive(Clone)]
pub struct Config {
    /// This worker's name in events and logs.
    pub name: String,
    /// Job loops in this process (each runs one job at a time).
    pub concurrency: usize,
    /// Where outputs go.
    pub store: Store,
    /// Local scratch space for inputs and engine outputs.
    pub scratch: PathBuf,
    /// How long a SIGTERM waits for running jobs before handing them back.
    pub grace: Duration,
    /// Hard limit on one attempt; past it the job fails permanently (`time_limit`).
    pub time_limit: Duration,
    /// Retry spacing of transient failures.
    pub backoff: Backoff,
    /// Least time between two published progress updates of a job.
    pub progress_every: Duration,
    /// Most time between two published progress updates of a running job: the last
    /// progress is re-sent even when unchanged, so watchers see the job is alive. The
    /// progress stream keeps one message per job, so this costs the log nothing.
    pub progress_heartbeat: Duration,
    /// Run the dead-letter handler in this process.
    pub deadletter: bool,
    /// The GPU memory probe (`nvidia-smi`), sampled for `stemq_gpu_memory_used_bytes`;
    /// `None` (the default) when the engine has no CUDA device.
    pub gpu_probe: Option<PathBuf>,
    /// External audio: http(s) `audio_uri`s are fetched under these settings; `None`
    /// (the default) refuses them like any URI outside the store.
    pub audio_urls: Option<fetch::AudioUrls>,
    /// Reads how long an input file plays (milliseconds) from its header, for the
    /// credits reserved before the engine runs when the engine cannot say itself
    /// (`stemq` passes stemq-audio's probe). `None`: such jobs reserve nothing and are
    /// charged what they separate.
    pub audio_probe: Option<fn(&std::path::Path) -> Option<u64>>,
    /// Met once this worker has announced itself with its models in the registry (its
    /// engine is loaded before [`run`] is called): the process's `/readyz` condition.
    pub ready: Option<Condition>,
}

impl Config {
    /// Defaults for a worker storing into `store`, scratch under `scratch`.
    pub fn new(store: Store, scratch: PathBuf) -> Config {
        Config {
            name: default_name(),
            concurrency: 1,
            store,
            scratch,
            grace: Duration::from_secs(600),
            time_limit: Duration::from_secs(3600),
            backoff: Backoff::default(),
            progress_every: Duration::from_millis(500),
            progress_heartbeat: Duration::from_secs(1),
            deadletter: true,
            gpu_probe: None,
            audio_urls: None,
            audio_probe: None,
            ready: None,
        }
    }
}

/// `<host>-<pid>`.
pub fn default_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "worker".into());
    format!("{}-{}", host.trim(), std::process::id())
}

/// The queue settings a worker obeys, as the `workers` consumer has them now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSettings {
    /// The consumer's ack wait: a delivery not acked (or progress-acked) within it is
    /// redelivered.
    pub ack_wait: Duration,
    /// The consumer's max deliver (`u32::MAX` when unlimited).
    pub max_deliver: u32,
}

impl QueueSettings {
    fn of(config: &async_nats::jetstream::consumer::Config) -> QueueSettings {
        let max_deliver = if config.max_deliver <= 0 { u32::MAX } else { config.max_deliver as u32 };
        QueueSettings { ack_wait: config.ack_wait, max_deliver }
    }

    /// How often a running job's delivery is progress-acked: a third of the ack wait,
    /// and at least every 2 s, so that even a sudden cut of the ack wait to a few
    /// seconds finds a fresh ack.
    pub fn keepalive_every(&self) -> Duration {
        (self.ack_wait / 3).clamp(Duration::from_millis(100), Duration::from_secs(2))
    }
}

/// Shared state of the job loops.
pub(crate) struct Shared {
    pub js: jetstream::Context,
    pub jobs_stream: jetstream::stream::Stream<()>,
    /// `STEMQ_OUTCOMES`: each job's one outcome (`stemq_nats::read::outcome`).
    pub outcomes_stream: jetstream::stream::Stream<()>,
    pub engine: Arc<dyn Engine>,
    pub config: Config,
    /// This process's scratch folder.
    pub scratch: scratch::Scratch,
    /// Jobs running in this process, for the cancel listener.
    pub running: Arc<control::Running>,
    /// The ledger and the price list.
    pub credits: credits::Credits,
}

/// How often a lane's consumer is read while it holds something, or once a request of
/// it was heard ([`watch_settings`]). A running job's delivery is progress-acked at
/// least every 2 s whatever the ack wait ([`QueueSettings::keepalive_every`]), so a cut
/// of the ack wait down to a few seconds is safe before it is read; each read is a
/// request and its answer per lane.
const LANE_READ_EVERY: Duration = Duration::from_secs(5);

/// How often a quiet lane (its last read found it holding nothing) is read again when
/// nothing was heard of it meanwhile: only an announced request can change it (no
/// redelivery comes from a lane with nothing delivered), so its read is for following
/// the pool's settings, and for a request unheard otherwise.
const QUIET_READ_EVERY: Duration = Duration::from_secs(30);

/// Re-reads a pool consumer until `stop`: publishes changes of its settings, and sets
/// `quiet` while it holds nothing (no request waiting, none delivered and unacked, so no
/// redelivery can come), which idle looks skip. A lane that is not quiet is read every
/// [`LANE_READ_EVERY`]; a quiet one as well once `news` says a request of it was heard
/// or the connection was made again since its last read, and otherwise every
/// [`QUIET_READ_EVERY`].
async fn watch_settings(
    name: String,
    mut consumer: PullConsumer,
    tx: watch::Sender<QueueSettings>,
    quiet: Arc<AtomicBool>,
    news: LaneNews,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(LANE_READ_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<(tokio::time::Instant, NewsMark)> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Some((at, mark)) = last {
            if quiet.load(Ordering::Relaxed) && !news.since(mark) && at.elapsed() < QUIET_READ_EVERY {
                continue;
            }
        }
        let mark = (tokio::time::Instant::now(), news.mark());
        let Ok(info) = consumer.info().await else {
            quiet.store(false, Ordering::Relaxed);
            last = None;
            continue;
        };
        last = Some(mark);
        quiet.store(info.num_pending == 0 && info.num_ack_pending == 0, Ordering::Relaxed);
        let now = QueueSettings::of(&info.config);
        let before = *tx.borrow();
        if now != before {
            info!(
                event = "queue.settings_changed",
                consumer = %name,
                ack_wait_ms_before = before.ack_wait.as_millis() as u64,
                ack_wait_ms = now.ack_wait.as_millis() as u64,
                max_deliver_before = before.max_deliver,
                max_deliver = now.max_deliver,
                "the pool's consumer changed; following it"
            );
            let _ = tx.send(now);
        }
    }
}

/// What may have changed a quiet lane since its last read: a request of it heard, or
/// the connection made again (what was announced meanwhile went unheard).
struct LaneNews {
    heard: Arc<Heard>,
    lane: usize,
    connection: Arc<async_nats::Statistics>,
}

/// Where [`LaneNews`] stood at a read: announcements up to then, and the connection's
/// connects.
#[derive(Debug, Clone, Copy)]
struct NewsMark {
    heard_to: u64,
    connects: u64,
}

impl LaneNews {
    /// Now. An announcement can beat its request into the stream by up to [`SETTLE`], so
    /// those heard within `SETTLE` before a read count as after it.
    fn mark(&self) -> NewsMark {
        NewsMark {
            heard_to: self.heard.now_ms().saturating_sub(SETTLE.as_millis() as u64),
            connects: self.connection.connects.load(Ordering::Relaxed),
        }
    }

    /// Whether anything came since `mark`.
    fn since(&self, mark: NewsMark) -> bool {
        self.heard.at(self.lane) > mark.heard_to || self.connection.connects.load(Ordering::Relaxed) != mark.connects
    }
}

/// One lane of one pool this worker pulls from.
struct PoolLane {
    /// `workers-<model>-<lane>`.
    name: String,
    consumer: PullConsumer,
    queue: watch::Receiver<QueueSettings>,
    /// At the last read of the consumer, it held nothing ([`watch_settings`]).
    quiet: Arc<AtomicBool>,
}

/// What the dispatcher hears of its lanes between looks: when a new request of each
/// lane was last announced (in milliseconds from `epoch`; 0: not since the start), and
/// how many were.
/// The wake subscriptions write it, the dispatcher reads it to skip the lanes that
/// cannot have new work, so a worker serving many pools does not pay an empty pull
/// per lane for every job.
struct Heard {
    epoch: std::time::Instant,
    routes: Vec<(Model, Priority)>,
    at_ms: Vec<AtomicU64>,
    counts: Vec<AtomicU64>,
}

impl Heard {
    fn new(routes: Vec<(Model, Priority)>) -> Heard {
        let at_ms = routes.iter().map(|_| AtomicU64::new(0)).collect();
        let counts = routes.iter().map(|_| AtomicU64::new(0)).collect();
        Heard { epoch: std::time::Instant::now(), routes, at_ms, counts }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// A new request of lane `i` was announced (its subscription knows its lane).
    fn announce(&self, i: usize) {
        // Counted first: a reader that sees this time sees the count too.
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.at_ms[i].store(self.now_ms(), Ordering::Release);
    }

    /// How many requests of lane `i` were announced.
    fn count(&self, i: usize) -> u64 {
        self.counts[i].load(Ordering::Relaxed)
    }

    /// When a request of lane `i` was last announced (0: never).
    fn at(&self, i: usize) -> u64 {
        self.at_ms[i].load(Ordering::Acquire)
    }
}

/// How long an idle worker first waits between looks at its pools when it hears of no
/// new request: redeliveries (retries after their backoff, deliveries whose worker died
/// or handed its job back) are not announced, so the looks go on, each wait twice the
/// last up to [`IDLE_POLL_MAX`], which bounds how late one starts on a worker idle for a
/// while. Every look at a lane is a pull request and its empty answer: every 250 ms for
/// good, a worker serving 15 models (30 lanes) would cost the server about 200 messages
/// a second while idle.
const IDLE_POLL: Duration = Duration::from_millis(250);

/// The longest wait between an idle worker's looks ([`IDLE_POLL`]).
const IDLE_POLL_MAX: Duration = Duration::from_secs(2);

/// The wait after `n` idle looks in a row that found nothing and heard nothing.
fn idle_pause(n: usize) -> Duration {
    IDLE_POLL.saturating_mul(1u32 << n.min(16)).min(IDLE_POLL_MAX)
}

/// Longest one look at a lane may take (its pull request and the answer).
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// After hearing of a new request and finding nothing (the request may not have
/// reached its consumer yet, or another worker took it), look again after these.
/// The first is short: the announcement of a request may beat the request to its
/// consumer.
const RECHECK: [Duration; 3] = [Duration::from_millis(1), Duration::from_millis(10), Duration::from_millis(50)];

/// Longest a look waits for an announced request that is not in its consumer yet (a
/// pull that returns the moment it is stored). Short: another worker may have taken it,
/// and the other lanes wait meanwhile; past it, the rechecks of [`RECHECK`] go on.
const ANNOUNCED_WAIT: Duration = Duration::from_millis(5);

/// How long an announced request may take to reach its consumer: a lane is looked at
/// after an announcement until a look that began this long after it finds the lane
/// empty (the request was taken, by this worker or another).
const SETTLE: Duration = Duration::from_millis(50);

/// Runs the worker until `shutdown`, then drains.
pub async fn run(
    client: async_nats::Client,
    engine: Arc<dyn Engine>,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    // Every family is exported from the start, at zero.
    metrics::metrics();
    let js = jetstream::new(client.clone());
    let models = engine.models();
    if models.is_empty() {
        return Err(WorkerError::NoModels(engine.name().to_string()));
    }
    // Interactive lanes of every pool first, then batch: the order of every look.
    let routes: Vec<(Model, Priority)> =
        Priority::ALL.iter().flat_map(|lane| models.iter().map(move |model| (*model, *lane))).collect();
    let heard = Arc::new(Heard::new(routes.clone()));
    let mut lanes = Vec::new();
    let tracker = TaskTracker::new();
    for (i, (model, lane)) in routes.iter().enumerate() {
        let name = names::pool_consumer(*model, *lane);
        let mut consumer: PullConsumer = js
            .get_consumer_from_stream(&name, names::JOBS_STREAM)
            .await
            .map_err(JetStreamError::open("open a pool consumer"))?;
        let info = consumer.info().await.map_err(JetStreamError::read("consumer info"))?.clone();
        let (tx, queue) = watch::channel(QueueSettings::of(&info.config));
        let quiet = Arc::new(AtomicBool::new(false));
        let news = LaneNews { heard: heard.clone(), lane: i, connection: client.statistics() };
        tracker.spawn(watch_settings(name.clone(), consumer.clone(), tx, quiet.clone(), news, shutdown.clone()));
        lanes.push(PoolLane { name, consumer, queue, quiet });
    }
    let settings = *lanes[0].queue.borrow();
    let jobs_stream =
        js.get_stream_no_info(names::JOBS_STREAM).await.map_err(JetStreamError::open("open job stream"))?;
    let outcomes_stream =
        js.get_stream_no_info(names::OUTCOMES_STREAM).await.map_err(JetStreamError::open("open outcome stream"))?;
    let scratch =
        scratch::Scratch::open(&config.scratch).map_err(|e| WorkerError::Scratch(config.scratch.clone(), e))?;
    let shared = Arc::new(Shared {
        js: js.clone(),
        jobs_stream,
        outcomes_stream,
        engine: engine.clone(),
        config: config.clone(),
        scratch,
        running: Arc::new(control::Running::default()),
        credits: credits::Credits::open(&js).await,
    });
    let cancel_listener = control::listen(js.client(), shared.running.clone())
        .await
        .map_err(JetStreamError::open("subscribe to cancel requests"))?;
    // New requests of the pools served here wake the dispatcher (the server does not
    // tell a pull consumer's clients that something arrived); not while a lane has a
    // backlog (`hearing`).
    let wake = Arc::new(tokio::sync::Notify::new());
    let ears =
        hearing::Ears::open(client.clone(), heard.clone(), wake.clone(), tracker.clone(), shutdown.clone()).await?;
    info!(
        worker = %config.name,
        engine = engine.name(),
        devices = ?engine.devices(),
        models = ?models,
        concurrency = config.concurrency,
        max_deliver = settings.max_deliver,
        ack_wait_ms = settings.ack_wait.as_millis() as u64,
        "worker running"
    );

    // `shutdown` ends the dispatcher's pulls; `hard_stop` cancels jobs past the grace period.
    let hard_stop = CancellationToken::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(config.concurrency.max(1)));
    let jobs = TaskTracker::new();
    {
        let (shared, slots, jobs, stop, hard) =
            (shared.clone(), slots.clone(), jobs.clone(), shutdown.clone(), hard_stop.clone());
        tracker.spawn(dispatch(lanes, ears, wake, heard, shared, slots, jobs, stop, hard));
    }
    if config.deadletter {
        let js = js.clone();
        let stop = shutdown.clone();
        tracker.spawn(async move {
            if let Err(e) = deadletter::run(js, stop).await {
                warn!(error = %e, "dead-letter handler stopped");
            }
        });
    }
    let registry = match js.get_key_value(names::WORKERS_BUCKET).await {
        Ok(bucket) => Some(bucket),
        Err(e) => {
            warn!(error = %e, "no worker registry bucket (run `stemq nats apply`): this worker is not announced");
            None
        }
    };
    {
        // The registry entry and the heartbeat gauge. Alerts on dead workers read
        // Prometheus's `up` instead: this series dies with the process.
        let announce = registry.clone().map(|bucket| {
            let info = WorkerInfo {
                name: config.name.clone(),
                models: models.clone(),
                devices: engine.devices().iter().map(|d| d.to_string()).collect(),
                engine: engine.name().to_string(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                concurrency: config.concurrency.max(1),
                running: 0,
                free_memory_bytes: None,
                gpu_free_memory_bytes: Default::default(),
                started_at: chrono::Utc::now(),
                heartbeat_at: chrono::Utc::now(),
            };
            (bucket, info)
        });
        // Without a registry there is nothing to announce: ready once dispatching.
        let ready = config.ready.clone();
        if announce.is_none() {
            ready.iter().for_each(Condition::met);
        }
        let (name, stop, slots, concurrency, gpu_probe) =
            (config.name.clone(), shutdown.clone(), slots.clone(), config.concurrency.max(1), config.gpu_probe.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(registry::HEARTBEAT);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                metrics::metrics().heartbeat(&name);
                if let Some((bucket, info)) = &announce {
                    let mut info = info.clone();
                    info.running = concurrency.saturating_sub(slots.available_permits());
                    info.free_memory_bytes = registry::mem_available();
                    if let Some(probe) = &gpu_probe {
                        info.gpu_free_memory_bytes = gpu::free(probe).await.unwrap_or_default().into_iter().collect();
                    }
                    info.heartbeat_at = chrono::Utc::now();
                    match registry::announce(bucket, &info).await {
                        Ok(()) => ready.iter().for_each(Condition::met),
                        Err(e) => warn!(error = %e, "cannot announce this worker"),
                    }
                }
            }
        });
    }
    if let Some(probe) = config.gpu_probe.clone() {
        tracker.spawn(gpu::run(probe, Duration::from_secs(15), shutdown.clone()));
    }
    tracker.close();

    shutdown.cancelled().await;
    info!(grace_s = config.grace.as_secs(), "shutting down: finishing current jobs");
    // Not serving any more: leave the registry now, so no job waits for this worker.
    if let Some(bucket) = &registry {
        if let Err(e) = registry::withdraw(bucket, &config.name).await {
            warn!(error = %e, "cannot leave the worker registry; the entry expires");
        }
    }
    tracker.wait().await;
    jobs.close();
    if tokio::time::timeout(config.grace, jobs.wait()).await.is_err() {
        warn!("grace period over: handing running jobs back");
        hard_stop.cancel();
        jobs.wait().await;
    }
    cancel_listener.abort();
    info!("worker stopped");
    Ok(())
}

/// Hands jobs to free job slots: whenever a slot is free, looks at the pools' lanes in
/// order (every interactive lane before any batch lane) and takes at most as many jobs as
/// slots are free, so nothing waits in a local buffer while its ack deadline runs and a
/// job queued in an interactive lane is the next one any free slot takes. When nothing
/// is there, it waits to hear of a new request (or [`IDLE_POLL`], growing to
/// [`IDLE_POLL_MAX`] while nothing comes).
///
/// A look skips the lanes that cannot have new work: a lane is looked at when its last
/// pull came back full (it may hold more) or a new request of it was announced and not
/// yet found taken (a look that began [`SETTLE`] after the announcement found the lane
/// empty, or a pull that waited for the lane's one new announcement took a job);
/// besides, each look takes one more lane in turn, so that a busy worker
/// looks at every lane about every [`IDLE_POLL`] (redeliveries are not announced), and
/// the looks after an idle wait of [`IDLE_POLL`] take every lane. Without
/// this, a worker serving many pools paid one empty pull per lane before each job of
/// its last lane (24 lanes for 12 models: about 2 ms a job on the 2-core machine).
#[allow(clippy::too_many_arguments)]
async fn dispatch(
    lanes: Vec<PoolLane>,
    mut ears: hearing::Ears,
    wake: Arc<tokio::sync::Notify>,
    heard: Arc<Heard>,
    shared: Arc<Shared>,
    slots: Arc<tokio::sync::Semaphore>,
    jobs: TaskTracker,
    stop: CancellationToken,
    hard: CancellationToken,
) {
    let mut rechecks = 0;
    // Lanes whose last pull came back full (all of them at the start: a backlog is not
    // announced), and when every lane was last looked at.
    let mut full: Vec<bool> = vec![true; lanes.len()];
    // Per lane, announcements up to this time (`Heard`'s clock) are settled: a later
    // look found the lane empty.
    let mut settled: Vec<u64> = vec![0; lanes.len()];
    // Per lane, how many announcements were settled (all of them up to `settled`).
    let mut settled_count: Vec<u64> = vec![0; lanes.len()];
    // Per lane, when the last look that took a job from it began: an announcement up to
    // then may be that job's, so only a later one is waited for.
    let mut took: Vec<u64> = vec![0; lanes.len()];
    // One lane more per look, in turn, at most every `sweep_every`: a busy worker looks
    // at each lane about every IDLE_POLL.
    let sweep_every = IDLE_POLL / lanes.len().max(1) as u32;
    let (mut swept_at, mut sweep_next) = (tokio::time::Instant::now(), 0);
    while !stop.is_cancelled() {
        let first = tokio::select! {
            _ = stop.cancelled() => return,
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
        };
        let mut permits = vec![first];
        while let Ok(p) = slots.clone().try_acquire_owned() {
            permits.push(p);
        }
        let mut taken = 0usize;
        // Every lane on the looks after an idle wait; otherwise (the looks again after a
        // wake included: the lane announced is among them) the lanes that may have work,
        // and one more in turn.
        let all = rechecks > RECHECK.len();
        let sweep = (!all && swept_at.elapsed() >= sweep_every).then(|| {
            swept_at = tokio::time::Instant::now();
            sweep_next = (sweep_next + 1) % lanes.len();
            sweep_next
        });
        for (i, lane) in lanes.iter().enumerate() {
            if permits.is_empty() {
                break;
            }
            // A lane not full and not announced is looked at by the sweeps and the idle
            // looks, unless its last read found it holding nothing: then a request would
            // have been announced, and no redelivery can come.
            let unheard = !full[i] && heard.at(i) <= settled[i];
            if unheard && (lane.quiet.load(Ordering::Relaxed) || (!all && sweep != Some(i))) {
                continue;
            }
            let asked = permits.len();
            let count = heard.count(i);
            let began = heard.now_ms();
            // A lane looked at only for a fresh announcement gets one pull that waits for
            // that request ([`wait_for_announced`]): the announcement usually beats the
            // request into the stream, and the job starts the moment it is stored, where
            // a look first would find nothing and cost a pull and its empty answer more
            // (about two messages a job at a steady rate). Any other look takes what the
            // lane holds now, and waits like that only when it found nothing although a
            // new request was announced. A look never hangs: a pull request or answer
            // lost in a server restart would otherwise leave it waiting for ever (a
            // no-wait fetch has no timer of its own).
            let announced_only = !all && !full[i] && sweep != Some(i);
            let first_wait = announced_only.then(|| wait_for_announced(heard.at(i), settled[i], took[i], began));
            let (mut wait, mut got, mut again) = (first_wait.flatten(), 0, false);
            loop {
                let pulled = tokio::time::timeout(FETCH_TIMEOUT, look(lane, permits.len(), wait)).await;
                match pulled {
                    Ok(Ok(batch)) => {
                        let t = take(lane, batch, &mut permits, &shared, &hard, &jobs).await;
                        got += t.started;
                        again |= t.again;
                    }
                    Ok(Err(e)) => {
                        warn!(consumer = %lane.name, error = %e, "pull failed; retrying");
                        again = true;
                    }
                    Err(_) => {
                        warn!(consumer = %lane.name, "pull request unanswered; retrying");
                        again = true;
                    }
                }
                if got > 0 || again || wait.is_some() {
                    break;
                }
                match wait_for_announced(heard.at(i), settled[i], took[i], began) {
                    Some(w) => wait = Some(w),
                    None => break,
                }
            }
            taken += got;
            if got > 0 {
                took[i] = began;
            }
            // A lane whose pull came back full (or failed) may hold more.
            let came_back_full = again || got >= asked;
            if !came_back_full {
                settled[i] = settled[i].max(began.saturating_sub(SETTLE.as_millis() as u64));
                let at = heard.at(i);
                let unchanged = heard.count(i) == count;
                // One announcement since the lane was last settled, and a pull that
                // waited for it took one job: that job was the announced request (a
                // lane that may hold more is looked at without waiting), so the lane is
                // settled at once, where looks until SETTLE after the announcement
                // would cost a pull and its empty answer each.
                if unchanged && wait.is_some() && got == 1 && count == settled_count[i] + 1 {
                    settled[i] = settled[i].max(at);
                }
                if unchanged && at <= settled[i] {
                    settled_count[i] = count;
                }
            }
            // Not listened to while it has a backlog; listened to again (and looked at
            // once more) when drained.
            full[i] = ears.after_look(i, came_back_full).await;
        }
        drop(permits);
        if taken > 0 {
            rechecks = 0;
            continue;
        }
        let pause = match RECHECK.get(rechecks) {
            Some(d) => *d,
            None => idle_pause(rechecks - RECHECK.len()),
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = wake.notified() => rechecks = 0,
            _ = tokio::time::sleep(pause) => rechecks += 1,
        }
    }
}

/// After a look at a lane that began at `began` found it empty: how long one more pull
/// should wait for the request announced at `announced` (times on [`Heard`]'s clock), or
/// `None`. Only for an announcement that is not settled, newer than the lane's last
/// taken job (`took`: it may have been that job's) and younger than [`SETTLE`]; at most
/// [`ANNOUNCED_WAIT`], and never past `SETTLE` after the announcement.
fn wait_for_announced(announced: u64, settled: u64, took: u64, began: u64) -> Option<Duration> {
    if announced <= settled || announced <= took {
        return None;
    }
    let age = Duration::from_millis(began.saturating_sub(announced));
    (age < SETTLE).then(|| ANNOUNCED_WAIT.min(SETTLE - age))
}

/// Pulls up to `n` jobs of `lane`: what it holds now (`wait` None), or, with `wait`, the
/// first one to come within it. The caller bounds the pull with [`FETCH_TIMEOUT`] and
/// [`take`] the answer.
async fn look(
    lane: &PoolLane,
    n: usize,
    wait: Option<Duration>,
) -> Result<async_nats::jetstream::consumer::pull::Batch, String> {
    let request = match wait {
        None => lane.consumer.fetch().max_messages(n).messages().await,
        // One job: a waiting pull returns when it is full, and the next look takes more.
        Some(w) => lane.consumer.batch().max_messages(1).expires(w).messages().await,
    };
    request.map_err(|e| e.to_string())
}

/// What one pull gave.
struct Taken {
    /// Jobs started.
    started: usize,
    /// The pull failed or its answer was cut short: the lane may hold more.
    again: bool,
}

/// Starts a job for each message of `batch` while `permits` last (a message beyond them
/// cannot come, and is handed back untouched if it does).
async fn take(
    lane: &PoolLane,
    batch: async_nats::jetstream::consumer::pull::Batch,
    permits: &mut Vec<tokio::sync::OwnedSemaphorePermit>,
    shared: &Arc<Shared>,
    hard: &CancellationToken,
    jobs: &TaskTracker,
) -> Taken {
    let deadline = tokio::time::Instant::now() + FETCH_TIMEOUT;
    tokio::pin!(batch);
    let mut got = 0;
    loop {
        let msg = match tokio::time::timeout_at(deadline, batch.next()).await {
            Ok(Some(Ok(msg))) => msg,
            Ok(None) => return Taken { started: got, again: false },
            Ok(Some(Err(e))) => {
                warn!(consumer = %lane.name, error = %e, "pull error");
                return Taken { started: got, again: true };
            }
            Err(_) => {
                warn!(consumer = %lane.name, "pull answer incomplete; looking again");
                return Taken { started: got, again: true };
            }
        };
        let Some(permit) = permits.pop() else {
            let _ = msg.ack_with(async_nats::jetstream::AckKind::Nak(None)).await;
            continue;
        };
        got += 1;
        let (shared, queue, hard) = (shared.clone(), lane.queue.clone(), hard.clone());
        jobs.spawn(async move {
            job::handle(&shared, msg, queue, &hard).await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_worker_looks_less_and_less_often_up_to_the_bound() {
        let waits: Vec<Duration> = (0..6).map(idle_pause).collect();
        assert_eq!(waits[0], IDLE_POLL);
        assert_eq!(waits[1], IDLE_POLL * 2);
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert_eq!(*waits.last().unwrap(), IDLE_POLL_MAX);
        assert_eq!(idle_pause(usize::MAX), IDLE_POLL_MAX);
    }

    #[test]
    fn a_fresh_announcement_that_a_look_missed_is_waited_for() {
        // Announced at 100 ms, the look began 1 ms later and found nothing.
        assert_eq!(wait_for_announced(100, 0, 0, 101), Some(ANNOUNCED_WAIT));
        // Announced after the look began (it came in while the look ran): the full wait.
        assert_eq!(wait_for_announced(105, 0, 0, 101), Some(ANNOUNCED_WAIT));
    }

    #[test]
    fn an_announcement_that_may_be_the_last_taken_job_or_is_settled_is_not_waited_for() {
        // The last look that took a job began at 100: an announcement up to then may be its.
        assert_eq!(wait_for_announced(100, 0, 100, 102), None);
        assert_eq!(wait_for_announced(99, 0, 100, 102), None);
        assert_eq!(wait_for_announced(101, 0, 100, 102), Some(ANNOUNCED_WAIT));
        // Settled: a later look already found the lane empty.
        assert_eq!(wait_for_announced(100, 100, 0, 102), None);
    }

    #[test]
    fn the_wait_never_runs_past_settle_after_the_announcement() {
        let settle = SETTLE.as_millis() as u64;
        assert_eq!(wait_for_announced(100, 0, 0, 100 + settle), None);
        assert_eq!(wait_for_announced(100, 0, 0, 100 + settle + 30), None);
        assert_eq!(wait_for_announced(100, 0, 0, 100 + settle - 2), Some(Duration::from_millis(2)));
    }
}
