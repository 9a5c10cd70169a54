//! Closing credit reservations from job outcomes (the ledger: `stemq_accounts::ledger`).
//!
//! This module owns the second half of paying for a job: it follows every job's
//! outcome (durable consumer `ledger` on `stemq.jobs.*.outcome`; a job has one outcome,
//! the first terminal event) and closes the job's open reservation, if it has one:
//! settled at the actual audio when the job succeeded, refunded in full for any other
//! end. Closing is idempotent in the owner's account (only an open reservation is
//! closed), so a redelivered outcome, a restarted projector or two projectors at once
//! move nothing twice.
//!
//! **Nothing is pulled while the ledger is empty.** A deployment that has never used
//! credits (no grant, no reservation) has nothing to close, so the closer waits, reading
//! the ledger stream's state every [`FIRST_ENTRY_POLL`], and pulls nothing: outcomes cost
//! the `ledger` consumer neither a delivery nor an ack (two of a job's messages through
//! the server; `docs/benchmarks.md`, "Messages through nats-server per job"). Once the
//! ledger holds an entry, the closer pulls from where the consumer stands, the outcomes
//! recorded meanwhile included; one stored more than [`CLOCK_SKEW`] before the ledger's
//! first entry cannot have a reservation to close, and is acked without reading its
//! request.
//!
//! It also counts usage per owner for Prometheus, with a bounded
//! label set: the first [`OWNER_LABELS`] owners seen by this process by name, the rest
//! as `other`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, AckKind};
use futures::StreamExt;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use stemq_accounts::ledger::{self, Close, Ledger, Movement};
use stemq_core::{Event, EventBody, JobId};
use stemq_nats as names;
use stemq_nats::pull::{self, PullOptions};
use stemq_telemetry::metrics::metrics;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

/// Owners named in the usage metrics; later ones count as `other`.
pub const OWNER_LABELS: usize = 100;

/// Outcomes being closed at once.
const CONCURRENCY: usize = 64;

/// How often the closer looks for the ledger's first entry while it has none.
pub const FIRST_ENTRY_POLL: Duration = Duration::from_secs(1);

/// How far the clocks of the job stream's and the ledger stream's servers (different
/// leaders in a cluster) may disagree: an outcome stored this much before the ledger's
/// first entry is still looked at.
pub const CLOCK_SKEW: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UsageLabels {
    owner: String,
    model: String,
}

struct UsageMetrics {
    audio: Family<UsageLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    engine: Family<UsageLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    charged: Family<UsageLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    named: Mutex<HashSet<String>>,
}

fn usage() -> &'static UsageMetrics {
    static U: OnceLock<UsageMetrics> = OnceLock::new();
    U.get_or_init(|| {
        let u = UsageMetrics {
            audio: Family::default(),
            engine: Family::default(),
            charged: Family::default(),
            named: Mutex::new(HashSet::new()),
        };
        metrics().register(|r| {
            r.register(
                "stemq_usage_audio_seconds",
                "Audio separated and charged, per owner and model",
                u.audio.clone(),
            );
            r.register(
                "stemq_usage_engine_seconds",
                "Engine time of charged jobs, per owner and model",
                u.engine.clone(),
            );
            r.register("stemq_usage_credits", "Credits charged, per owner and model", u.charged.clone());
        });
        u
    })
}

/// The owner's label: its name for the first [`OWNER_LABELS`] owners, `other` after.
fn owner_label(owner: &str) -> String {
    let mut named = usage().named.lock().expect("labels lock");
    if named.contains(owner) || (named.len() < OWNER_LABELS && named.insert(owner.to_string())) {
        owner.to_string()
    } else {
        "other".into()
    }
}

/// Follows outcomes and closes reservations until `shutdown`. Without the ledger's
/// definitions (an older deployment before `stemq nats apply`) it says so and stops.
pub async fn run(js: jetstream::Context, shutdown: CancellationToken) {
    let consumer: PullConsumer = match js.get_consumer_from_stream(ledger::LEDGER_CONSUMER, names::JOBS_STREAM).await {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "no `ledger` consumer (stemq nats apply creates it): credit reservations are not closed");
            return;
        }
    };
    let log = match js.get_stream_no_info(names::JOBS_STREAM).await {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "cannot open the job stream: credit reservations are not closed");
            return;
        }
    };
    let _ = usage();
    let Some(first_entry) = first_entry(&js, &shutdown).await else { return };
    let since = first_entry - CLOCK_SKEW;
    let closer = Arc::new(Closer { ledger: Ledger::new(js.clone()), log, since });
    let options = PullOptions {
        batch: 256,
        heartbeat: Some(Duration::from_secs(5)),
        expires: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    let mut messages = pull::messages(consumer, options, shutdown.clone());
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    info!("ledger closer running");
    while let Some(msg) = messages.next().await {
        let Ok(permit) = slots.clone().acquire_owned().await else { break };
        let closer = closer.clone();
        tokio::spawn(async move {
            closer.handle(msg).await;
            drop(permit);
        });
    }
    // Let the closes in flight finish.
    let _ = slots.acquire_many(CONCURRENCY as u32).await;
    info!("ledger closer stopped");
}

/// Waits until the ledger holds an entry, and returns when the first one was stored;
/// `None` on shutdown. Without a ledger stream (an older deployment before `stemq nats
/// apply`) nothing can be reserved, and it waits likewise.
async fn first_entry(js: &jetstream::Context, shutdown: &CancellationToken) -> Option<async_nats::datetime::DateTime> {
    let mut said = false;
    loop {
        // A fresh read of the stream's state (a kept handle's info is its creation's).
        if let Ok(s) = js.get_stream(ledger::LEDGER_STREAM).await {
            let state = &s.cached_info().state;
            if state.messages > 0 {
                if said {
                    info!("the ledger has its first entry: closing reservations from outcomes");
                }
                return Some(state.first_timestamp);
            }
        }
        if !said {
            info!("the ledger is empty (credits never used): pulling no outcomes until it has an entry");
            said = true;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(FIRST_ENTRY_POLL) => {}
        }
    }
}

struct Closer {
    ledger: Ledger,
    log: jetstream::stream::Stream<()>,
    /// Outcomes stored before this have no reservation to close: the ledger's first
    /// entry came later (less [`CLOCK_SKEW`]).
    since: async_nats::datetime::DateTime,
}

impl Closer {
    async fn handle(&self, msg: jetstream::Message) {
        let Some(job_id) = names::job_id_of_subject(&msg.subject) else {
            let _ = msg.ack().await;
            return;
        };
        let span = tracing::info_span!("ledger.close", job_id = %job_id);
        async {
            let stored = msg.info().map(|i| i.published).ok();
            if stored.is_some_and(|t| t < self.since) {
                let _ = msg.ack().await;
                return;
            }
            match self.close(&job_id, &msg.payload).await {
                Ok(()) => {
                    let _ = msg.ack().await;
                }
                Err(e) => {
                    warn!(error = %e, "cannot close the job's reservation yet; retrying");
                    let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
                }
            }
        }
        .instrument(span)
        .await
    }

    async fn close(&self, job_id: &JobId, payload: &[u8]) -> Result<(), String> {
        let Ok(event) = Event::from_slice(payload) else {
            return Ok(()); // Not an event: the projector reports it; nothing to pay.
        };
        let how = match &event.body {
            EventBody::Succeeded(s) => Close::Settle { audio_ms: s.audio_ms, engine_ms: s.duration_ms },
            body if body.is_terminal() => Close::Refund { reason: body.kind().to_string() },
            _ => return Ok(()),
        };
        let owner = match stemq_nats::read::request_of(&self.log, job_id).await {
            Ok(Some((_, req))) => match req.body {
                EventBody::Requested(r) => r.request.owner,
                _ => return Ok(()),
            },
            Ok(None) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        if let Some(entry) = self.ledger.close(&owner, job_id, &how).await.map_err(|e| e.to_string())? {
            if let Movement::Settled { model, charged, audio_ms, engine_ms, .. } = &entry.movement {
                let l = UsageLabels { owner: owner_label(&owner), model: model.as_str().to_string() };
                usage().audio.get_or_create(&l).inc_by(*audio_ms as f64 / 1000.0);
                usage().engine.get_or_create(&l).inc_by(*engine_ms as f64 / 1000.0);
                usage().charged.get_or_create(&l).inc_by(ledger::credits(*charged));
            }
            info!(event = "credits.closed", movement = ?entry.movement, "reservation closed");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_metrics_name_a_bounded_number_of_owners() {
        let first: Vec<String> = (0..OWNER_LABELS).map(|i| owner_label(&format!("owner-{i}"))).collect();
        assert!(first.iter().enumerate().all(|(i, l)| *l == format!("owner-{i}")));
        assert_eq!(owner_label("one-too-many"), "other");
        assert_eq!(owner_label("owner-7"), "owner-7", "a named owner keeps its name");
    }
}
