//! Keeping a running job's delivery alive and its watchers informed.
//!
//! This module owns the background task beside each running attempt: it progress-acks
//! the delivery every third of the consumer's ack wait (following a changed ack wait at
//! once), publishes the engine's progress (at most every `progress_every`), and re-sends
//! the last progress every `progress_heartbeat` even when unchanged, so watchers see the
//! job is alive. The job's handler aborts it when the attempt ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use stemq_core::event::{EventBody, Progress};
use stemq_core::{Event, JobId};
use stemq_nats::publish::publish_within;
use stemq_nats::{job_subject, SubjectKind};
use tokio::sync::watch;
use tracing::warn;

use crate::job::source;
use crate::Shared;

/// How long a progress event may keep retrying (during a leader election): progress is
/// news, not a record (the stream keeps only the last per job), and this task's
/// progress acks must not wait behind it.
const PROGRESS_PATIENCE: Duration = Duration::from_secs(1);

/// Progress acks (every third of `ack_wait`) and rate-limited progress events.
pub(crate) fn spawn_keepalive(
    shared: &Arc<Shared>,
    mut queue: watch::Receiver<crate::QueueSettings>,
    msg: Arc<jetstream::Message>,
    job_id: &JobId,
    attempt: u32,
    mut progress: watch::Receiver<Option<(f32, String)>>,
) -> tokio::task::JoinHandle<()> {
    let js = shared.js.clone();
    let min_gap = shared.config.progress_every;
    let subject = job_subject(job_id, SubjectKind::Progress);
    let job_id = job_id.clone();
    let src = source(shared);
    let heartbeat = shared.config.progress_heartbeat;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(queue.borrow_and_update().keepalive_every());
        tick.tick().await;
        let mut beat = tokio::time::interval(heartbeat);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        beat.tick().await;
        let mut engine_done = false;
        let mut last_sent: Option<Instant> = None;
        let mut last: (f32, String) = (0.0, "starting".to_string());
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if let Err(e) = msg.ack_with(AckKind::Progress).await {
                        warn!(error = %e, "progress ack failed");
                    }
                }
                Ok(()) = queue.changed() => {
                    // The consumer's ack wait changed: ack now, then at the new pace.
                    let every = queue.borrow_and_update().keepalive_every();
                    if let Err(e) = msg.ack_with(AckKind::Progress).await {
                        warn!(error = %e, "progress ack failed");
                    }
                    tick = tokio::time::interval(every);
                    tick.tick().await;
                }
                _ = beat.tick(), if !engine_done => {
                    if last_sent.map(|t| t.elapsed() + Duration::from_millis(50) < heartbeat).unwrap_or(false) {
                        continue;
                    }
                    let ev = Event::new(&job_id, &src, EventBody::Progress(Progress {
                        attempt, percent: (last.0 * 100.0).round(), stage: last.1.clone(), message: None,
                    }));
                    if let Err(e) = publish_within(&js, &subject, &ev, None, PROGRESS_PATIENCE).await {
                        warn!(error = %e, "progress heartbeat not stored");
                    }
                    last_sent = Some(Instant::now());
                }
                changed = progress.changed(), if !engine_done => {
                    if changed.is_err() {
                        engine_done = true;
                        continue;
                    }
                    if let Some(t) = last_sent {
                        if let Some(rest) = min_gap.checked_sub(t.elapsed()) {
                            tokio::time::sleep(rest).await;
                        }
                    }
                    let Some((fraction, stage)) = progress.borrow_and_update().clone() else { continue };
                    last = (fraction, stage.clone());
                    let ev = Event::new(&job_id, &src, EventBody::Progress(Progress {
                        attempt, percent: (fraction * 100.0).round(), stage, message: None,
                    }));
                    if let Err(e) = publish_within(&js, &subject, &ev, None, PROGRESS_PATIENCE).await {
                        warn!(error = %e, "progress event not stored");
                    }
                    last_sent = Some(Instant::now());
                }
            }
        }
    })
}
