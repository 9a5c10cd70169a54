//! The router of requests recorded without a route.
//!
//! This module owns the way from the request subjects of earlier releases into the
//! pools. A request on `stemq.jobs.<id>.requested` (before owner tokens) or
//! `stemq.jobs.<id>.requested.<owner token>` (before routing, or from a publisher that
//! still uses it) carries no model and lane in its subject, so no pool consumer takes
//! it; the durable `workers` consumer holds exactly those. [`run`] (in every ingress;
//! they share the consumer) reads each, and when it is the job's own request (it hashes
//! to its id, and its owner is its subject's) publishes it again on its routed subject
//! with `publish::route_request` (once per job and owner, so a redelivery or a second
//! router changes nothing), then acks. Anything else on those subjects is not the job's
//! request and is dropped (terminated and logged), as the worker drops it. Readers take
//! the first request of a job in any form, and the second copy folds to nothing.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, AckKind};
use futures::StreamExt;
use stemq_core::{Event, EventBody};
use stemq_nats::error::JetStreamError;
use stemq_nats::publish::{route_request, Once};
use stemq_nats::pull::{self, PullOptions};
use stemq_nats::{self as names, check_request_owner, job_id_of_subject};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Routes unrouted requests until `shutdown`. Fails only when the consumer cannot be
/// opened at start.
pub async fn run(js: jetstream::Context, shutdown: CancellationToken) -> Result<(), JetStreamError> {
    let consumer: PullConsumer = js
        .get_consumer_from_stream(names::WORKERS_CONSUMER, names::JOBS_STREAM)
        .await
        .map_err(JetStreamError::open("open the unrouted requests (consumer workers)"))?;
    let mut messages = pull::messages(consumer, PullOptions::batch(64), shutdown);
    while let Some(msg) = messages.next().await {
        let subject = msg.subject.to_string();
        let event = match Event::from_slice(&msg.payload) {
            Ok(e) => e,
            Err(e) => {
                warn!(%subject, error = %e, "an unrouted request that is not an event; dropping it");
                let _ = msg.ack_with(AckKind::Term).await;
                continue;
            }
        };
        let own = match (&event.body, job_id_of_subject(&subject)) {
            (EventBody::Requested(r), Some(id)) => {
                r.request.job_id() == id
                    && event.subject == id
                    && event.id == id.as_str()
                    && check_request_owner(&subject, &r.request.owner).is_ok()
            }
            _ => false,
        };
        if !own {
            warn!(%subject, "an unrouted request that is not its job's; dropping it");
            let _ = msg.ack_with(AckKind::Term).await;
            continue;
        }
        let id = event.subject.clone();
        match route_request(&js, &id, &event).await {
            Ok(once) => {
                info!(job_id = %id, routed = matches!(once, Once::Stored(_)), "request routed into its pool");
                let _ = msg.double_ack().await;
            }
            Err(e) => {
                warn!(job_id = %id, error = %e, "cannot route the request yet; retrying");
                let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
            }
        }
    }
    Ok(())
}
