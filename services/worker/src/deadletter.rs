//! Dead letters from server advisories: catches jobs that kill their worker.
//!
//! This module owns the path that needs no living worker. When the `workers` consumer
//! reaches `max_deliver` for a message without an ack (the process died on every
//! attempt, or never answered), the server emits a max-deliveries advisory; the
//! `STEMQ_ADVISORIES` stream captures it so none is lost, and this handler (durable
//! consumer `deadletter`, one delivery per advisory across all workers) turns it into the
//! job's `dead_lettered` outcome — unless the job already has an outcome, in which case
//! the terminal subject refuses the second one. It reads its consumer through
//! [`stemq_nats::pull::messages`], so it keeps handling advisories after a server
//! restart or a recreated consumer.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, AckKind};
use futures::StreamExt;
use serde::Deserialize;
use stemq_core::event::{DeadLettered, EventBody, FailureCode};
use stemq_core::Event;
use stemq_nats::error::JetStreamError;
use stemq_nats::publish::{publish_once, Once};
use stemq_nats::pull::{self, PullOptions};
use stemq_nats::{self as names, job_id_of_subject, job_subject, SubjectKind};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The fields we read of `io.nats.jetstream.advisory.v1.max_deliver`.
#[derive(Debug, Deserialize)]
pub struct MaxDeliverAdvisory {
    /// Stream of the message.
    pub stream: String,
    /// Sequence of the message in that stream.
    pub stream_seq: u64,
    /// How many times it was delivered.
    pub deliveries: u32,
    /// The consumer that gave up on it (absent in advisories stored by hand).
    #[serde(default)]
    pub consumer: String,
}

/// Handler failures: a JetStream call (opening the consumer or the stream at start,
/// reading the dead message, publishing the outcome).
pub type DeadLetterError = JetStreamError;

/// Runs until `shutdown` (fails only if its consumer or the job stream cannot be opened
/// at start).
pub async fn run(js: jetstream::Context, shutdown: CancellationToken) -> Result<(), DeadLetterError> {
    let consumer: PullConsumer = js
        .get_consumer_from_stream(names::DEADLETTER_CONSUMER, names::ADVISORY_STREAM)
        .await
        .map_err(JetStreamError::open("open deadletter consumer"))?;
    let jobs = js.get_stream_no_info(names::JOBS_STREAM).await.map_err(JetStreamError::open("open job stream"))?;
    // One delivery per advisory: a small batch, and a subscription that outlives server
    // restarts and a recreated consumer.
    let mut messages = pull::messages(consumer, PullOptions::batch(10), shutdown);
    while let Some(msg) = messages.next().await {
        let adv: MaxDeliverAdvisory = match serde_json::from_slice(&msg.payload) {
            Ok(a) => a,
            Err(e) => {
                warn!(error = %e, "unreadable advisory; dropping it");
                let _ = msg.ack_with(AckKind::Term).await;
                continue;
            }
        };
        match handle(&js, &jobs, &adv).await {
            Ok(()) => {
                let _ = msg.double_ack().await;
            }
            Err(e) => {
                warn!(error = %e, seq = adv.stream_seq, "cannot dead-letter yet; retrying");
                let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
            }
        }
    }
    Ok(())
}

async fn handle(
    js: &jetstream::Context,
    jobs: &jetstream::stream::Stream<()>,
    adv: &MaxDeliverAdvisory,
) -> Result<(), DeadLetterError> {
    // Only the pools' consumers run jobs (and the old `workers` consumer did, before
    // routing); the others never give up on a message.
    let of_workers = adv.consumer.is_empty()
        || adv.consumer == names::WORKERS_CONSUMER
        || names::pool_of_consumer(&adv.consumer).is_some();
    if adv.stream != names::JOBS_STREAM || !of_workers {
        return Ok(());
    }
    let original = jobs.direct_get(adv.stream_seq).await.map_err(JetStreamError::read("fetch dead message"))?;
    let Some(job_id) = job_id_of_subject(&original.subject) else {
        return Ok(());
    };
    // The last error a worker managed to report, if any.
    let last_error = jobs
        .direct_get_last_for_subject(job_subject(&job_id, SubjectKind::Failed))
        .await
        .ok()
        .and_then(|m| Event::from_slice(&m.payload).ok())
        .and_then(|e| match e.body {
            EventBody::Failed(f) => Some(format!("{}: {}", f.code, f.message)),
            _ => None,
        });
    let reason = if last_error.is_some() { FailureCode::MaxDeliveries } else { FailureCode::CrashLoop };
    let ev = Event::new(
        &job_id,
        "/stemq/deadletter",
        EventBody::DeadLettered(DeadLettered {
            deliveries: adv.deliveries,
            reason: reason.clone(),
            last_error,
            request_seq: adv.stream_seq,
        }),
    );
    let subject = job_subject(&job_id, SubjectKind::Outcome);
    match publish_once(js, &subject, &ev, &format!("{job_id}.outcome"))
        .await
        .map_err(JetStreamError::write("publish dead letter"))?
    {
        Once::Stored(_) => {
            warn!(job_id = %job_id, deliveries = adv.deliveries, %reason, "job dead-lettered")
        }
        Once::AlreadyThere => {
            info!(job_id = %job_id, "advisory for a job that already has an outcome")
        }
    }
    Ok(())
}
