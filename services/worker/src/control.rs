//! Cancel requests and start deadlines, as seen from a worker.
//!
//! This module owns how a worker learns that a job must not run (on) any more:
//! - before starting, [`cancel_requested_in_log`] looks for a `cancel_requested` event
//!   and the start deadline is compared with the clock (`expired`);
//! - while running, [`watch_cancel`] listens on `stemq.jobs.<id>.cancel_requested` with a
//!   plain subscription (JetStream-stored messages are also delivered to subscribers)
//!   and raises the engine's cancel flag, which the engine checks between chunks;
//! - [`discard_outputs`] deletes `jobs/<id>/` so a cancelled job leaves nothing behind.
//!
//! The subscription is made *before* the log is checked, so a request is never missed:
//! it is either already in the log or arrives on the subscription.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_nats::jetstream;
use futures::StreamExt;
use stemq_core::nats::{job_subject, SubjectKind};
use stemq_core::JobId;
use tracing::{info, warn};

use crate::Shared;

/// Subscribes to the job's cancel subject; when a request arrives, sets `user` (why) and
/// then `engine` (the flag the engine polls). Abort the handle when the attempt ends.
pub(crate) async fn watch_cancel(
    shared: &Shared,
    job_id: &JobId,
    engine: Arc<AtomicBool>,
    user: Arc<AtomicBool>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let mut sub = shared
        .js
        .client()
        .subscribe(job_subject(job_id, SubjectKind::CancelRequested))
        .await
        .map_err(|e| e.to_string())?;
    Ok(tokio::spawn(async move {
        if sub.next().await.is_some() {
            info!(event = "job.cancel_requested", "cancel requested; stopping at the next chunk");
            user.store(true, Ordering::SeqCst);
            engine.store(true, Ordering::SeqCst);
        }
    }))
}

/// True when the log holds a cancel request for the job.
pub(crate) async fn cancel_requested_in_log(shared: &Shared, job_id: &JobId) -> Result<bool, String> {
    match shared.jobs_stream.direct_get_last_for_subject(job_subject(job_id, SubjectKind::CancelRequested)).await {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

/// Deletes every stored output of the job (`jobs/<id>/`).
pub(crate) async fn discard_outputs(shared: &Shared, job_id: &JobId) {
    let prefix = format!("jobs/{job_id}/");
    if let Err(e) = shared.config.store.delete_prefix(&prefix).await {
        warn!(error = %e, %prefix, "could not delete the outputs of a cancelled job");
    }
}
