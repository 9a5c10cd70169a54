//! The one pull loop every long-running JetStream consumer uses.
//!
//! This module owns how a durable pull consumer's messages reach a service: the
//! projector's two pumps and the dead-letter handler read through [`messages`] (and the
//! relay and the worker are meant to). A pull subscription can end or stall without the
//! consumer being gone: the server restarts, the consumer is deleted and recreated
//! (`stemq projector --rebuild` does exactly that), a reconnect leaves the pull requests
//! unanswered. A loop that returns on the end of its stream then stops consuming for
//! good, silently. [`messages`] instead:
//!
//! - yields messages, and nothing else (errors are logged here, never handed to callers);
//! - survives transient errors (missed heartbeats, a reconnect) by logging them; after
//!   [`PullOptions::max_errors`] in a row without a message it drops the subscription
//!   and opens a new one;
//! - when the stream ends (`None`), waits [`PullOptions::resubscribe_delay`], checks the
//!   consumer exists (by name) and subscribes again, for as long as it takes;
//! - ends only when the `shutdown` token is cancelled (or the caller drops it).
//!
//! Each new subscription after the first bumps [`Messages::resubscriptions`], so a caller
//! that caches what it derived from earlier messages (the projector's views) can tell
//! that what came before may have been replaced (a recreated consumer replays the log).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, consumer::PullConsumer};
use futures::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How [`messages`] pulls.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Messages asked for per pull request (1 for a GPU worker: it must not hold a second
    /// job in a local buffer while its ack deadline runs).
    pub batch: usize,
    /// Idle heartbeat asked of the server; a missed one is reported as an error, which is
    /// how a stalled subscription is noticed. `None`: no heartbeat.
    pub heartbeat: Option<Duration>,
    /// Lifetime of one pull request (the client re-issues it). `None`: the client default.
    pub expires: Option<Duration>,
    /// Wait before subscribing again after the stream ended or failed to open.
    pub resubscribe_delay: Duration,
    /// Errors in a row (no message in between) after which the subscription is replaced.
    pub max_errors: u32,
}

impl Default for PullOptions {
    fn default() -> Self {
        PullOptions {
            batch: 200,
            heartbeat: Some(Duration::from_secs(5)),
            expires: Some(Duration::from_secs(30)),
            resubscribe_delay: Duration::from_millis(500),
            max_errors: 3,
        }
    }
}

impl PullOptions {
    /// The defaults with `batch` messages per pull request.
    pub fn batch(batch: usize) -> Self {
        PullOptions { batch: batch.max(1), ..Default::default() }
    }
}

/// The messages of a consumer, across resubscriptions. A [`Stream`] of
/// [`jetstream::Message`] that ends only on shutdown.
pub struct Messages {
    inner: Pin<Box<dyn Stream<Item = jetstream::Message> + Send>>,
    resubscriptions: Arc<AtomicU64>,
}

impl Messages {
    /// A counter of the subscriptions opened after the first one; the caller may keep it
    /// and compare readings to learn that the subscription was replaced.
    pub fn resubscriptions(&self) -> Arc<AtomicU64> {
        self.resubscriptions.clone()
    }
}

impl Stream for Messages {
    type Item = jetstream::Message;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

struct State {
    consumer: PullConsumer,
    name: String,
    options: PullOptions,
    shutdown: CancellationToken,
    current: Option<pull::Stream>,
    opened: u64,
    errors: u32,
    resubscriptions: Arc<AtomicU64>,
}

/// The messages of `consumer` until `shutdown` is cancelled, subscribing again whenever
/// the subscription ends or keeps failing (see the module docs).
pub fn messages(consumer: PullConsumer, options: PullOptions, shutdown: CancellationToken) -> Messages {
    let name = {
        let info = consumer.cached_info();
        format!("{}/{}", info.stream_name, info.name)
    };
    let resubscriptions = Arc::new(AtomicU64::new(0));
    let state = State {
        consumer,
        name,
        options,
        shutdown,
        current: None,
        opened: 0,
        errors: 0,
        resubscriptions: resubscriptions.clone(),
    };
    let inner = futures::stream::unfold(state, |mut s| async move {
        let m = next(&mut s).await?;
        Some((m, s))
    });
    Messages { inner: Box::pin(inner), resubscriptions }
}

/// The next message, or `None` on shutdown.
async fn next(s: &mut State) -> Option<jetstream::Message> {
    loop {
        if s.shutdown.is_cancelled() {
            return None;
        }
        let Some(current) = s.current.as_mut() else {
            match open(s).await {
                Ok(stream) => {
                    if s.opened > 0 {
                        s.resubscriptions.fetch_add(1, Ordering::SeqCst);
                        info!(consumer = %s.name, "pull subscription opened again");
                    }
                    s.opened += 1;
                    s.errors = 0;
                    s.current = Some(stream);
                }
                Err(e) => {
                    warn!(consumer = %s.name, error = %e, "cannot open the pull subscription; retrying");
                    pause(s).await;
                }
            }
            continue;
        };
        let item = tokio::select! {
            _ = s.shutdown.cancelled() => return None,
            m = current.next() => m,
        };
        match item {
            Some(Ok(m)) => {
                s.errors = 0;
                return Some(m);
            }
            Some(Err(e)) => {
                s.errors += 1;
                warn!(consumer = %s.name, error = %e, errors = s.errors, "pull error");
                if s.errors >= s.options.max_errors.max(1) {
                    warn!(consumer = %s.name, "pull subscription keeps failing; subscribing again");
                    s.current = None;
                    pause(s).await;
                }
            }
            None => {
                warn!(consumer = %s.name, "pull subscription ended; subscribing again");
                s.current = None;
                pause(s).await;
            }
        }
    }
}

async fn pause(s: &State) {
    tokio::select! {
        _ = s.shutdown.cancelled() => {}
        _ = tokio::time::sleep(s.options.resubscribe_delay) => {}
    }
}

/// Checks the consumer exists (it may have been deleted and not yet recreated) and opens
/// a pull subscription on it.
async fn open(s: &State) -> Result<pull::Stream, String> {
    s.consumer.get_info().await.map_err(|e| e.to_string())?;
    let mut b = s.consumer.stream().max_messages_per_batch(s.options.batch);
    if let Some(h) = s.options.heartbeat {
        b = b.heartbeat(h);
    }
    if let Some(e) = s.options.expires {
        b = b.expires(e);
    }
    b.messages().await.map_err(|e| e.to_string())
}
