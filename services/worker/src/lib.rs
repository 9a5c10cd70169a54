//! stemq-worker: runs separation jobs from the queue, each exactly once in effect.
//!
//! This crate owns the work side of the pipeline:
//! - [`run`] starts `concurrency` job loops over the durable `workers` pull consumer,
//!   one job at a time each (pulled one by one, so nothing waits in a local buffer while
//!   its ack deadline runs), plus the dead-letter handler ([`deadletter`]);
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
//! The `workers` consumer's configuration is the single source of truth for the queue
//! settings: ack wait and max deliver are read from it at start and re-read every second
//! ([`QueueSettings`]), so `stemq nats apply` takes effect on running workers (progress
//! acks follow a shorter ack wait at once) and no flag of the worker can disagree with it.
//!
//! On shutdown the loops stop pulling, the current jobs finish within the grace period
//! and the process exits; a job still running when the grace period ends is handed back
//! (nak) for another worker, with no outcome recorded.

pub mod backoff;
mod control;
pub mod deadletter;
pub mod fetch;
pub mod gpu;
pub mod isolate;
pub mod job;
mod keepalive;
mod outputs;
pub mod scratch;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use stemq_core::engine::Engine;
use stemq_core::error::JetStreamError;
use stemq_core::nats as names;
use stemq_core::storage::Store;
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
    pub engine: Arc<dyn Engine>,
    pub config: Config,
    /// The consumer's settings, kept current by [`watch_settings`].
    pub queue: watch::Receiver<QueueSettings>,
    /// This process's scratch folder.
    pub scratch: scratch::Scratch,
    /// Jobs running in this process, for the cancel listener.
    pub running: Arc<control::Running>,
}

impl Shared {
    /// The queue settings now.
    pub fn queue(&self) -> QueueSettings {
        *self.queue.borrow()
    }
}

/// Re-reads the consumer's settings every second until `stop`, publishing changes.
async fn watch_settings(mut consumer: PullConsumer, tx: watch::Sender<QueueSettings>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Ok(info) = consumer.info().await else { continue };
        let now = QueueSettings::of(&info.config);
        let before = *tx.borrow();
        if now != before {
            info!(
                event = "queue.settings_changed",
                ack_wait_ms_before = before.ack_wait.as_millis() as u64,
                ack_wait_ms = now.ack_wait.as_millis() as u64,
                max_deliver_before = before.max_deliver,
                max_deliver = now.max_deliver,
                "the workers consumer changed; following it"
            );
            let _ = tx.send(now);
        }
    }
}

/// Runs the worker until `shutdown`, then drains.
pub async fn run(
    client: async_nats::Client,
    engine: Arc<dyn Engine>,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    let js = jetstream::new(client);
    let mut consumer: PullConsumer = js
        .get_consumer_from_stream(names::WORKERS_CONSUMER, names::JOBS_STREAM)
        .await
        .map_err(JetStreamError::open("open workers consumer"))?;
    let info = consumer.info().await.map_err(JetStreamError::read("consumer info"))?.clone();
    let jobs_stream =
        js.get_stream_no_info(names::JOBS_STREAM).await.map_err(JetStreamError::open("open job stream"))?;
    let scratch =
        scratch::Scratch::open(&config.scratch).map_err(|e| WorkerError::Scratch(config.scratch.clone(), e))?;
    let settings = QueueSettings::of(&info.config);
    let (settings_tx, queue) = watch::channel(settings);
    let shared = Arc::new(Shared {
        js: js.clone(),
        jobs_stream,
        engine: engine.clone(),
        config: config.clone(),
        queue,
        scratch,
        running: Arc::new(control::Running::default()),
    });
    let cancel_listener = control::listen(js.client(), shared.running.clone())
        .await
        .map_err(JetStreamError::open("subscribe to cancel requests"))?;
    info!(
        worker = %config.name,
        engine = engine.name(),
        devices = ?engine.devices(),
        concurrency = config.concurrency,
        max_deliver = settings.max_deliver,
        ack_wait_ms = settings.ack_wait.as_millis() as u64,
        "worker running"
    );

    let tracker = TaskTracker::new();
    tracker.spawn(watch_settings(consumer.clone(), settings_tx, shutdown.clone()));
    // `stop_pulling` ends the loops' pulls; `hard_stop` cancels jobs past the grace period.
    let hard_stop = CancellationToken::new();
    for n in 0..config.concurrency.max(1) {
        let shared = shared.clone();
        let consumer = consumer.clone();
        let stop = shutdown.clone();
        let hard = hard_stop.clone();
        tracker.spawn(async move { job_loop(n, shared, consumer, stop, hard).await });
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
    {
        // The heartbeat gauge, for dashboards. Alerts on dead workers read Prometheus's
        // `up` instead: this series dies with the process.
        let (name, stop) = (config.name.clone(), shutdown.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => stemq_core::metrics::metrics().heartbeat(&name),
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
    if tokio::time::timeout(config.grace, tracker.wait()).await.is_err() {
        warn!("grace period over: handing running jobs back");
        hard_stop.cancel();
        tracker.wait().await;
    }
    cancel_listener.abort();
    info!("worker stopped");
    Ok(())
}

async fn job_loop(
    n: usize,
    shared: Arc<Shared>,
    consumer: PullConsumer,
    stop: CancellationToken,
    hard: CancellationToken,
) {
    while !stop.is_cancelled() {
        let batch = consumer.batch().max_messages(1).expires(Duration::from_secs(5)).messages().await;
        let mut batch = match batch {
            Ok(b) => b,
            Err(e) => {
                warn!(lane = n, error = %e, "pull failed; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                }
            }
        };
        let msg = tokio::select! {
            _ = stop.cancelled() => return,
            m = batch.next() => m,
        };
        match msg {
            Some(Ok(msg)) => job::handle(&shared, msg, &hard).await,
            Some(Err(e)) => {
                warn!(lane = n, error = %e, "pull error");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None => {}
        }
    }
}
