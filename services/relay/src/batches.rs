//! Batches in the relay: telling when a batch has ended, recording its end once, and
//! delivering its webhook.
//!
//! A batch ends when every item is refused or a job that has ended. Whether it has is
//! asked at two moments, each after the fact it depends on is stored:
//!
//! - a submission round was recorded (`relay-batches`, `stemq.batches.*.submitted`): the
//!   jobs that ended before it are all in the job log by then;
//! - a job ended (`relay-batch-outcomes`, `stemq.jobs.*.outcome`): the batches that hold
//!   it are found from their memberships (`stemq.batch_jobs.<job id>.*`, stored before
//!   the round that submitted the job).
//!
//! So whichever comes last — the last job's end or the round — sees everything, and the
//! check reads from the streams' leaders (never a replica behind). The check reads the
//! batch's latest round; with no item waiting for a resubmission and no end recorded, it
//! looks for each job's outcome (newest items first, where an open job is likeliest;
//! ends already seen are remembered: an end is for ever) and, when all have ended,
//! records the batch's end with its final view (`stemq.batches.<id>.ended`, message id
//! `<id>.ended`, expected last subject sequence 0): two relays that both see the end
//! record it once.
//!
//! The end (`relay-batches`, `stemq.batches.*.ended`) is delivered to the batch's
//! `webhook` like a job's event: `io.stemq.batch.ended.v1`, `webhook-id` =
//! `msg_<end event id>` (the same on every retry), the owner's secrets, one claim per
//! attempt, each attempt recorded on `stemq.batches.<id>.delivery`, the same schedule.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use stemq_core::batch::{BatchEvent, BatchEventBody, BatchId, BatchView};
use stemq_core::{Event, JobId, JobStatus, Position};
use stemq_nats::batch_log::{job_outcome, record_end, BatchLog, Read};
use stemq_nats::error::JetStreamError;
use stemq_nats::publish::Once;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn, Instrument};

use crate::attempt::{attempt, Delivery, Of};
use crate::handle::finish;
use crate::schedule::{next_step, Step};
use crate::Shared;

/// Most job ends remembered (then forgotten at once and read again when needed).
const REMEMBERED_ENDS: usize = 100_000;

/// The relay's hold on batches.
pub(crate) struct Batches {
    /// `STEMQ_BATCHES`.
    pub log: BatchLog,
    /// For job outcomes.
    pub js: jetstream::Context,
    /// Jobs known to have ended, with their status.
    ended: Mutex<HashMap<JobId, JobStatus>>,
}

impl Batches {
    pub fn new(log: BatchLog, js: jetstream::Context) -> Batches {
        Batches { log, js, ended: Mutex::default() }
    }

    fn known(&self, job: &JobId) -> Option<JobStatus> {
        self.ended.lock().expect("ends").get(job).copied()
    }

    fn remember(&self, job: &JobId, status: JobStatus) {
        let mut m = self.ended.lock().expect("ends");
        if m.len() >= REMEMBERED_ENDS {
            m.clear();
        }
        m.insert(job.clone(), status);
    }

    /// The status of an ended job, `None` while it runs.
    async fn outcome(&self, job: &JobId) -> Result<Option<JobStatus>, JetStreamError> {
        if let Some(s) = self.known(job) {
            return Ok(Some(s));
        }
        let s = job_outcome(&self.js, job).await?;
        if let Some(s) = s {
            self.remember(job, s);
        }
        Ok(s)
    }
}

/// Records batch `id`'s end if it has ended and it is not recorded yet.
async fn check(shared: &Shared, id: &BatchId) -> Result<(), JetStreamError> {
    let b = &shared.batches;
    let Some(rec) = b.log.record(id, Read::Leader).await? else { return Ok(()) };
    if rec.state.has_unsubmitted() || b.log.ended(id, Read::Leader).await?.is_some() {
        return Ok(());
    }
    let mut statuses = HashMap::new();
    for job in rec.state.jobs().iter().rev() {
        match b.outcome(job).await? {
            Some(s) => {
                statuses.insert(job.clone(), s);
            }
            None => return Ok(()),
        }
    }
    let view = BatchView::build(id, &rec.state, rec.time, |j| statuses.get(j).copied());
    let source = format!("/stemq/{}", shared.config.name);
    let counts = view.counts.clone();
    match record_end(&shared.js, id, view, &source).await {
        Ok(Once::Stored(_)) => {
            info!(
                batch_id = %id,
                items = counts.items,
                succeeded = counts.succeeded,
                refused = counts.refused,
                "batch ended"
            );
            Ok(())
        }
        Ok(Once::AlreadyThere) => Ok(()),
        Err(e) => Err(JetStreamError::write("record a batch end")(e)),
    }
}

/// A job's end, from `relay-batch-outcomes`: checks each batch that holds the job.
pub(crate) async fn on_outcome(shared: &Arc<Shared>, msg: jetstream::Message) {
    let Ok(event) = Event::from_slice(&msg.payload) else {
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    let job = event.subject.clone();
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
    let result = async {
        let batches = shared.batches.log.batches_of(&job, Read::Leader).await?;
        if batches.is_empty() {
            return Ok(());
        }
        if let Some(v) = stemq_core::apply(None, Position::Log(seq), &event).filter(|v| v.status.is_terminal()) {
            shared.batches.remember(&job, v.status);
        }
        for id in &batches {
            check(shared, id).instrument(info_span!("batch.check", batch_id = %id)).await?;
        }
        Ok::<(), JetStreamError>(())
    }
    .await;
    match result {
        Ok(()) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            warn!(job_id = %job, error = %stemq_nats::error::report(&e), "cannot check the job's batches; retrying");
            let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
        }
    }
}

/// A batch's round or end, from `relay-batches`.
pub(crate) async fn on_batch_event(shared: &Arc<Shared>, msg: jetstream::Message, stop: &CancellationToken) {
    let Ok(event) = BatchEvent::from_slice(&msg.payload) else {
        warn!(subject = %msg.subject, "unreadable batch event; skipping");
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    let id = event.subject.clone();
    let span = info_span!("batch.event", batch_id = %id, event = event.event_type());
    async {
        match &event.body {
            BatchEventBody::Submitted(_) => match check(shared, &id).await {
                Ok(()) => {
                    let _ = msg.ack().await;
                }
                Err(e) => {
                    warn!(error = %stemq_nats::error::report(&e), "cannot check the batch; retrying");
                    let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
                }
            },
            BatchEventBody::Ended(view) => deliver(shared, &msg, &event, view, stop).await,
            BatchEventBody::DeliveryAttempted(_) => {
                let _ = msg.ack().await;
            }
        }
    }
    .instrument(span)
    .await
}

/// Delivers a batch's end to its webhook: one attempt now, or the event handed back
/// until the next one is due (see the module doc of the crate).
async fn deliver(
    shared: &Arc<Shared>,
    msg: &jetstream::Message,
    event: &BatchEvent,
    view: &BatchView,
    stop: &CancellationToken,
) {
    let Some(hook) = &view.webhook else {
        let _ = msg.ack().await;
        return;
    };
    let id = &event.subject;
    let webhook_id = format!("msg_{}", event.id);
    let (seq, delivered) = msg.info().map(|i| (i.stream_sequence, i.delivered)).unwrap_or((0, 1));
    let first = shared.config.schedule.first().copied().unwrap_or_default();
    let first_due = event.time + chrono::Duration::from_std(first).unwrap_or_default();
    let step = if delivered <= 1 {
        Ok(next_step(&[], first_due, chrono::Utc::now()))
    } else {
        shared.batches.log.delivery_attempts(id, seq).await.map(|all| {
            let mine: Vec<_> =
                all.iter().filter(|r| r.attempt.webhook_id == webhook_id).map(|r| (r.time, &r.attempt)).collect();
            next_step(&mine, first_due, chrono::Utc::now())
        })
    };
    let n = match step {
        Ok(Step::Attempt(n)) => n,
        Ok(Step::Over) => {
            let _ = msg.ack().await;
            return;
        }
        Ok(Step::Wait(left)) => {
            let _ = msg.ack_with(AckKind::Nak(Some(left))).await;
            return;
        }
        Err(e) => {
            warn!(error = %stemq_nats::error::report(&e), "cannot read the batch's delivery record; retrying later");
            let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
            return;
        }
    };
    if stop.is_cancelled() {
        let _ = msg.ack_with(AckKind::Nak(None)).await;
        return;
    }
    let delivery = Delivery {
        of: Of::Batch(id),
        key: crate::claim::key(id.as_str(), &event.id),
        webhook_id: &webhook_id,
        event_type: event.event_type(),
        url: &hook.url,
        owner: view.owner.clone(),
        data: serde_json::to_value(view).expect("views serialise"),
        replay: false,
    };
    finish(msg, attempt(shared, &delivery, n).await).await;
}
