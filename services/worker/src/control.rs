//! Cancel requests and start deadlines, as seen from a worker.
//!
//! This module owns how a worker learns that a job must not run (on) any more:
//! - before starting, [`recorded`] looks in the log for the job's outcome (a duplicate
//!   delivery, a lost ack) and for a `cancel_requested` event, and the start deadline
//!   is compared with the clock (`expired`);
//! - while running, the process-wide [`listen`]er on `stemq.jobs.*.cancel_requested`
//!   raises the cancel flag of the job (registered in [`Running`]), which the engine
//!   checks between chunks;
//! - [`discard_outputs`] deletes `jobs/<id>/` so a cancelled job leaves nothing behind.
//!
//! A job is registered *before* the log is checked, and the subscription exists before
//! any pull, so a request is never missed: it is either already in the log or arrives
//! on the subscription.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_nats::jetstream::stream::{DirectGetError, DirectGetErrorKind};
use futures::StreamExt;
use stemq_core::JobId;
use stemq_nats::{job_events_filter, job_subject, SubjectKind};
use tracing::{info, warn};

use crate::Shared;

/// The flags of one running job: `user` says a cancel was asked for, `engine` is the
/// flag the engine polls between chunks.
pub(crate) type Flags = (Arc<AtomicBool>, Arc<AtomicBool>);

/// The jobs this process is running, for the process-wide cancel listener.
#[derive(Default)]
pub(crate) struct Running(Mutex<HashMap<JobId, Flags>>);

/// Removes a job from [`Running`] when its attempt ends.
pub(crate) struct Registration<'a> {
    running: &'a Running,
    job_id: JobId,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.running.0.lock().expect("running lock").remove(&self.job_id);
    }
}

impl Running {
    /// Registers a job's flags; a cancel request that arrives from now on raises them.
    pub(crate) fn register(&self, job_id: &JobId, engine: Arc<AtomicBool>, user: Arc<AtomicBool>) -> Registration<'_> {
        self.0.lock().expect("running lock").insert(job_id.clone(), (engine, user));
        Registration { running: self, job_id: job_id.clone() }
    }

    fn raise(&self, job_id: &JobId) {
        if let Some((engine, user)) = self.0.lock().expect("running lock").get(job_id) {
            info!(job_id = %job_id, event = "job.cancel_requested", "cancel requested; stopping at the next chunk");
            user.store(true, Ordering::SeqCst);
            engine.store(true, Ordering::SeqCst);
        }
    }
}

/// One subscription per process on every job's cancel subject (JetStream-stored
/// messages are also delivered to plain subscribers), dispatched to the running jobs.
/// Subscribed before the first pull, so a request for a job this process starts later
/// is either in the log (checked before start) or arrives here.
pub(crate) async fn listen(
    client: async_nats::Client,
    running: Arc<Running>,
) -> Result<tokio::task::JoinHandle<()>, async_nats::SubscribeError> {
    let mut sub = client.subscribe(format!("{}.*.cancel_requested", stemq_nats::JOBS_PREFIX)).await?;
    Ok(tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if let Some(id) = stemq_nats::job_id_of_subject(&m.subject) {
                running.raise(&id);
            }
        }
    }))
}

/// What the log holds for a job about to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Recorded {
    /// The job has its outcome (it must not run again).
    pub outcome: bool,
    /// A cancel was requested.
    pub cancel_requested: bool,
}

/// Whether the job has its outcome and a cancel request. Two direct gets at once in the
/// common case: the outcome stream's (an outcome whose copy has not reached the log yet),
/// and the newest of the job's one-token events in the log ([`job_events_filter`]),
/// which is either absent (a new job: neither) or its outcome; anything else (a
/// redelivery after `started`, a cancel request) is settled by the exact look-ups.
pub(crate) async fn recorded(shared: &Shared, job_id: &JobId) -> Result<Recorded, DirectGetError> {
    let outcome = job_subject(job_id, SubjectKind::Outcome);
    let found = |r: Result<_, DirectGetError>| match r {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    };
    let (newest, in_outcomes) = tokio::join!(
        shared.jobs_stream.direct_get_last_for_subject(job_events_filter(job_id)),
        shared.outcomes_stream.direct_get_last_for_subject(outcome.as_str()),
    );
    let ended = found(in_outcomes)?;
    match newest {
        Err(e) if e.kind() == DirectGetErrorKind::NotFound => {
            return Ok(Recorded { outcome: ended, cancel_requested: false })
        }
        Err(e) => return Err(e),
        Ok(m) if m.subject.as_str() == outcome => return Ok(Recorded { outcome: true, cancel_requested: false }),
        Ok(_) => {}
    }
    let (in_log, cancel) = tokio::join!(
        shared.jobs_stream.direct_get_last_for_subject(outcome),
        shared.jobs_stream.direct_get_last_for_subject(job_subject(job_id, SubjectKind::CancelRequested)),
    );
    Ok(Recorded { outcome: ended || found(in_log)?, cancel_requested: found(cancel)? })
}

/// Deletes every stored output of the job (`jobs/<id>/`).
pub(crate) async fn discard_outputs(shared: &Shared, job_id: &JobId) {
    let prefix = format!("jobs/{job_id}/");
    if let Err(e) = shared.config.store.delete_prefix(&prefix).await {
        warn!(error = %e, %prefix, "could not delete the outputs of a cancelled job");
    }
}
