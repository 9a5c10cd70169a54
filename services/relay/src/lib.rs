//! stemq-relay: tells clients what happened to their jobs, with signed webhooks.
//!
//! This crate owns webhook delivery, as a service with its own durable consumers
//! (`relay` over started/outcome/replay-request events, `relay-progress` over the
//! compacted progress stream; both in `nats/consumers/`), so a slow or dead receiver
//! delays no worker and no other service. Each event the queue hands it (`handle`) is:
//!
//! 1. folded into the job's current view with the pure `apply`, so the payload never
//!    lags the event;
//! 2. skipped when the job has no webhook or its `events` filter excludes the event;
//! 3. placed in its delivery's schedule (`schedule`) by the `delivery_attempted` events
//!    recorded for its `webhook-id`: the attempt number, when it is due, or that the
//!    delivery is over;
//! 4. claimed (`claim`): attempt `n` of the delivery is taken in `stemq_delivery_claims`
//!    by create or compare-and-set, so of two relays handed the same event one makes it;
//! 5. attempted (`attempt`): the SSRF check with the resolved address pinned, a POST
//!    signed with Standard Webhooks, recorded once as `delivery_attempted` on
//!    `stemq.jobs.<id>.delivery`;
//! 6. acked when the delivery is over (2xx; 410, which disables the URL for the owner;
//!    3xx and other 4xx; the last attempt), or handed back (nak) with the schedule's
//!    next delay, jittered, or a longer `Retry-After`.
//!
//! What holds: the queue holds the waiting, so nothing stays in a relay between
//! attempts and a relay that stops loses nothing; any number of relays may share the
//! consumers; a receiver sees an attempt twice only when a relay dies between its claim
//! and its record, with the same `webhook-id`. A batch's end is told the same way
//! (`batches`). Deliveries run concurrently, at most `concurrency` attempts in flight.
//! Why it is built so: docs/architecture.md, "Webhooks" and "Two projectors, two relays".

mod attempt;
mod batches;
mod claim;
mod handle;
mod memo;
pub mod metrics;
mod schedule;

pub use memo::ProgressMemo;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, kv};
use futures::StreamExt;
use stemq_nats as names;
use stemq_nats::error::JetStreamError;
use stemq_nats::read::Views;
use stemq_telemetry::readiness::Condition;
use stemq_webhook::Allowlist;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

/// Relay failures at start.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// A JetStream call failed.
    #[error(transparent)]
    JetStream(#[from] JetStreamError),
}

/// Relay configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Delay before each attempt (the first is normally zero); its length bounds the
    /// number of attempts. Jitter of up to +20 % is added to each retry's delay.
    pub schedule: Vec<Duration>,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Longest `Retry-After` honoured.
    pub max_retry_after: Duration,
    /// Hosts and networks allowed although not public (and over plain http).
    pub allow: Allowlist,
    /// Attempts in flight at once (a delivery waiting for its retry holds none).
    pub concurrency: usize,
    /// Source name in recorded events.
    pub name: String,
    /// Most jobs whose last progress percent is remembered (see [`ProgressMemo`]).
    pub progress_jobs: usize,
    /// Met once the relay consumes its feeds: the process's `/readyz` condition.
    pub ready: Option<Condition>,
}

impl Default for Config {
    /// The Standard Webhooks example schedule: now, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h,
    /// 14 h, 20 h, 24 h; 15 s timeout.
    fn default() -> Self {
        let s = |secs: u64| Duration::from_secs(secs);
        Config {
            schedule: vec![s(0), s(5), s(300), s(1800), s(7200), s(18000), s(36000), s(50400), s(72000), s(86400)],
            timeout: s(15),
            max_retry_after: s(3600),
            allow: stemq_webhook::allowlist_from_env(),
            concurrency: 256,
            name: "relay".into(),
            progress_jobs: 100_000,
            ready: None,
        }
    }
}

struct Shared {
    js: jetstream::Context,
    /// The read side: the status view, else the request from the log.
    views: Views,
    webhooks: kv::Store,
    config: Config,
    /// Last progress percent delivered per job (progress is delivered on change only).
    last_progress: ProgressMemo,
    /// Who makes which attempt, between relays.
    claims: claim::Claims,
    /// Batches: their log, and the job ends seen.
    batches: batches::Batches,
}

/// Which consumer a message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feed {
    /// `relay`: started, outcome and replay-request events.
    Jobs,
    /// `relay-progress`.
    Progress,
    /// `relay-batches`: batch rounds and ends.
    Batches,
    /// `relay-batch-outcomes`: job ends, for their batches.
    BatchOutcomes,
}

/// Runs the relay until `shutdown`. Nothing in flight is acked on the way out: an
/// unfinished delivery stays with the queue and the next relay continues it.
pub async fn run(client: async_nats::Client, config: Config, shutdown: CancellationToken) -> Result<(), RelayError> {
    let memo = ProgressMemo::new(config.progress_jobs);
    serve(client, config, memo, shutdown).await
}

/// [`run`] with the progress memory given by the caller, who can watch it (tests).
pub async fn serve(
    client: async_nats::Client,
    config: Config,
    memo: ProgressMemo,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    // Every family is exported from the start, at zero.
    metrics::metrics();
    let js = jetstream::new(client);
    let views = Views::open(&js).await?;
    let webhooks =
        js.get_key_value(names::WEBHOOKS_BUCKET).await.map_err(JetStreamError::open("open webhooks bucket"))?;
    let events: PullConsumer = js
        .get_consumer_from_stream(names::RELAY_CONSUMER, names::JOBS_STREAM)
        .await
        .map_err(JetStreamError::open("open relay consumer"))?;
    let progress: PullConsumer = js
        .get_consumer_from_stream(names::RELAY_PROGRESS_CONSUMER, names::PROGRESS_STREAM)
        .await
        .map_err(JetStreamError::open("open relay-progress consumer"))?;
    let open_consumer = |name: &'static str, stream: &'static str| {
        let js = js.clone();
        async move {
            let c: PullConsumer = js
                .get_consumer_from_stream(name, stream)
                .await
                .map_err(JetStreamError::open("open a relay consumer of batches"))?;
            Ok::<_, JetStreamError>(c)
        }
    };
    let batch_events = open_consumer(names::RELAY_BATCHES_CONSUMER, names::BATCHES_STREAM).await?;
    let batch_outcomes = open_consumer(names::RELAY_BATCH_OUTCOMES_CONSUMER, names::JOBS_STREAM).await?;
    let batches = batches::Batches::new(stemq_nats::batch_log::BatchLog::open(&js).await?, js.clone());
    let claims = claim::Claims {
        kv: js
            .get_key_value(names::DELIVERY_CLAIMS_BUCKET)
            .await
            .map_err(JetStreamError::open("open delivery claims bucket"))?,
        relay: format!("{}/{}", config.name, &uuid::Uuid::new_v4().simple().to_string()[..8]),
        lease: config.timeout + claim::LEASE_MARGIN,
    };
    let slots = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let shared = Arc::new(Shared { js, views, webhooks, config, last_progress: memo, claims, batches });
    info!(concurrency = shared.config.concurrency, attempts = shared.config.schedule.len(), "relay running");
    let tracker = TaskTracker::new();
    let feeds = [
        (events, Feed::Jobs),
        (progress, Feed::Progress),
        (batch_events, Feed::Batches),
        (batch_outcomes, Feed::BatchOutcomes),
    ];
    for (consumer, feed) in feeds {
        let (shared, slots, stop, t) = (shared.clone(), slots.clone(), shutdown.clone(), tracker.clone());
        tracker.spawn(async move { pump(shared, consumer, feed, slots, stop, t).await });
    }
    shared.config.ready.iter().for_each(Condition::met);
    shutdown.cancelled().await;
    tracker.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), tracker.wait()).await;
    info!("relay stopped");
    Ok(())
}

async fn pump(
    shared: Arc<Shared>,
    consumer: PullConsumer,
    feed: Feed,
    slots: Arc<Semaphore>,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    // The one pull loop (resubscribes when the stream ends, survives errors).
    let mut messages = stemq_nats::pull::messages(consumer, stemq_nats::pull::PullOptions::batch(100), stop.clone());
    while let Some(msg) = messages.next().await {
        // A slot is held for one attempt (bounded by the request timeout), never for
        // the wait before a retry: that wait is the queue's (a nak with a delay).
        let permit = tokio::select! {
            _ = stop.cancelled() => return,
            p = slots.clone().acquire_owned() => p.expect("semaphore open"),
        };
        let (shared, stop) = (shared.clone(), stop.clone());
        tracker.spawn(async move {
            let _permit = permit;
            match feed {
                Feed::Jobs => handle::handle(&shared, msg, false, &stop).await,
                Feed::Progress => handle::handle(&shared, msg, true, &stop).await,
                Feed::Batches => batches::on_batch_event(&shared, msg, &stop).await,
                Feed::BatchOutcomes => batches::on_outcome(&shared, msg).await,
            }
        });
    }
}
