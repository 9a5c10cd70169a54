//! stemq-relay: tells clients what happened to their jobs, with signed webhooks.
//!
//! This crate owns webhook delivery. It is a service of its own with its own durable
//! consumers (`relay` over started/outcome/replay-request events, `relay-progress` over
//! the compacted progress stream; both in `nats/consumers/`), so a slow or dead receiver
//! delays no worker and no other service. Each time the queue hands it an event, it
//! (`handle`):
//!
//! 1. folds the event into the job's status view (the read side's current view — the KV
//!    view, else the request from the log — brought up to date with the pure `apply`, so
//!    the payload never lags the event);
//! 2. skips jobs without a webhook or whose `events` filter excludes the event
//!    (`started`, `progress`, `completed` = any terminal status);
//! 3. finds where the event's delivery stands (`schedule`): a first delivery is
//!    attempt 1; a redelivery reads the `delivery_attempted` events recorded for its
//!    `webhook-id` (the log, never memory), which give the attempt number, when it is
//!    due, or that the delivery is already over;
//! 4. claims the attempt (`claim`): the delivery's entry in the `stemq_delivery_claims`
//!    bucket takes attempt `n` by create or compare-and-set, so of two relays handed the
//!    same event (an ack wait that ran out mid-attempt, a lost ack) exactly one makes
//!    it; the other leaves the event alone, to be acked or handed back by the winner;
//! 5. makes the attempt (`attempt`): the SSRF check with the resolved address pinned,
//!    then a POST of `{"type", "timestamp", "data": <status view>}` signed with Standard
//!    Webhooks (`webhook-id` = the event id, stable across retries and replays; one `v1,`
//!    signature per active secret of the job's owner), and records it as
//!    `delivery_attempted` on `stemq.jobs.<id>.delivery`, once (`Nats-Msg-Id`
//!    `<delivery key>.<attempt>`, so a retried publish is not a second record);
//! 6. acks when the delivery is over (2xx; 410, which disables the URL for the owner
//!    until `stemq webhooks enable`; 3xx and other 4xx; the schedule's last attempt), or
//!    naks with the next delay when the receiver asks for a retry (timeout, connection
//!    error, 5xx, 429): the schedule's next step with up to +20 % jitter, or a longer
//!    `Retry-After` (capped).
//!
//! The retry model: the queue holds the waiting. Between attempts nothing is held in
//! the relay (no task, timer or concurrency slot), so receivers that keep failing cost
//! one short attempt each per step and cannot starve others, and a relay that stops or
//! crashes loses nothing: an event is acked only when its delivery is over, and whichever
//! relay gets it next continues at the attempt number the log gives. The consumers have
//! `max_deliver: -1` (the relay ends a schedule, not the server) and a `max_ack_pending`
//! far above the deliveries that may wait for a retry at once.
//!
//! **Any number of relays** may share the consumers: the log numbers and times the
//! attempts, the claims say who makes each one, and no relay keeps a delivery in
//! memory. What stays at least once is a relay dying (or losing NATS) between its claim
//! and its record: once the claim's lease (the request timeout plus a minute) has passed
//! with no record, another relay takes the claim over and makes that attempt again with
//! the same `webhook-id`, which receivers de-duplicate.
//!
//! **Batches** (`batches`): the relay also tells when a batch has ended — on each of
//! its submission rounds (`relay-batches`) and on each end of a job it holds
//! (`relay-batch-outcomes`) — records the end once, and delivers it to the batch's
//! webhook the same way (`io.stemq.batch.ended.v1`, recorded on
//! `stemq.batches.<id>.delivery`).
//!
//! Deliveries run concurrently, at most `concurrency` attempts in flight.

mod attempt;
mod batches;
mod claim;
mod handle;
mod memo;
mod schedule;

pub use memo::ProgressMemo;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, kv};
use futures::StreamExt;
use stemq_core::error::JetStreamError;
use stemq_core::nats as names;
use stemq_core::read::Views;
use stemq_core::readiness::Condition;
use stemq_core::webhook::Allowlist;
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
            allow: stemq_core::webhook::allowlist_from_env(),
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
    let batches = batches::Batches::new(stemq_core::batch_log::BatchLog::open(&js).await?, js.clone());
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
    let mut messages = stemq_core::pull::messages(consumer, stemq_core::pull::PullOptions::batch(100), stop.clone());
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
