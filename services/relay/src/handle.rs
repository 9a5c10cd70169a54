//! What the relay does with one event it is handed: fold it into the job's view, decide
//! whether the job's webhook wants it, find where its delivery stands in the log, make
//! at most one attempt, then ack (the delivery is over) or nak with a delay (a retry is
//! due later). The waiting is the queue's, never this task's.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use stemq_core::event::EventBody;
use stemq_core::{apply, Event, JobId, JobView, Position};
use stemq_nats::read::ViewError;
use stemq_webhook as webhook;
use tokio_util::sync::CancellationToken;
use tracing::{info_span, warn, Instrument};

use crate::attempt::{attempt, After, Delivery, Of};
use crate::schedule::{next_step, Step};
use crate::Shared;

/// The job's view with `event` folded in: the read side's current view (the KV view,
/// else the request from the log if the projector has not seen the job yet), brought up
/// to the event with the pure `apply`, so the payload never lags the event. A view that
/// cannot be read (the bucket or the log is unreachable, or the stored view does not
/// parse) is an error: the event waits, rather than being delivered with a view rebuilt
/// from the request alone.
async fn current_view(
    shared: &Shared,
    id: &JobId,
    pos: Option<Position>,
    event: &Event,
) -> Result<Option<JobView>, ViewError> {
    let view = shared.views.current(id).await?;
    Ok(match pos.and_then(|pos| apply(view.as_ref(), pos, event)) {
        Some(v) => Some(v),
        None => view,
    })
}

/// True when the job's terminal event is stored (direct gets, no projector lag).
async fn has_ended(shared: &Shared, id: &JobId) -> bool {
    stemq_nats::read::outcome::has_ended(&shared.js, id).await.unwrap_or(false)
}

/// How the queue handed an event over.
struct Handed {
    /// Its sequence in its stream.
    seq: u64,
    /// How many times the consumer has delivered it (1 the first time).
    delivered: i64,
    /// From `relay-progress` (the progress stream) rather than `relay` (the job stream).
    is_progress: bool,
}

/// Handles one delivery of an event from `relay` (`is_progress` false) or
/// `relay-progress`.
pub(crate) async fn handle(shared: &Arc<Shared>, msg: jetstream::Message, is_progress: bool, stop: &CancellationToken) {
    let Ok(event) = Event::from_slice(&msg.payload) else {
        warn!(subject = %msg.subject, "unreadable event; skipping");
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    let handed = msg
        .info()
        .map(|i| Handed { seq: i.stream_sequence, delivered: i.delivered, is_progress })
        .unwrap_or(Handed { seq: 0, delivered: 1, is_progress });
    let id = event.subject.clone();
    let span =
        info_span!("webhook.delivery", job_id = %id, event = event.body.kind(), trace_id = tracing::field::Empty);
    // The delivery joins the job's trace (the outcome event carries its traceparent).
    stemq_telemetry::logging::set_parent(&span, event.traceparent.as_deref());
    async {
        if event.body.is_terminal() {
            // Whatever the job's webhook asks for, an ended job's progress is not news.
            shared.last_progress.forget(&id);
        }
        let (webhook_id, event_type, replay, pos) = match &event.body {
            EventBody::DeliveryReplayRequested(r) => (r.webhook_id.clone(), r.event_type.clone(), true, None),
            body => {
                if body.webhook_class().is_none() {
                    let _ = msg.ack().await;
                    return;
                }
                let pos = if is_progress { Position::Progress(handed.seq) } else { Position::Log(handed.seq) };
                (format!("msg_{}", event.id), event.event_type(), false, Some(pos))
            }
        };
        let view = match current_view(shared, &id, pos, &event).await {
            Ok(Some(v)) => v,
            Ok(None) => {
                let _ = msg.ack().await;
                return;
            }
            Err(e) => {
                warn!(error = %stemq_nats::error::report(&e), "cannot read the job's view; the event waits");
                let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(5)))).await;
                return;
            }
        };
        if view.request.is_none() {
            // A view built from later events before the request was folded (or read
            // from a replica behind) cannot say whether the job has a webhook.
            let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
            return;
        }
        let Some(hook) = view.webhook.clone() else {
            let _ = msg.ack().await;
            return;
        };
        if !replay {
            let class = event.body.webhook_class().unwrap_or("completed");
            if !hook.events.iter().any(|e| e == class) {
                let _ = msg.ack().await;
                return;
            }
            // Heartbeats repeat the same progress: deliver changes only. A redelivery is
            // a retry of a change already judged news.
            if let (EventBody::Progress(p), 1) = (&event.body, handed.delivered) {
                if !shared.last_progress.changed(&id, p.percent.round() as i32) {
                    let _ = msg.ack().await;
                    return;
                }
                // Progress read late, after the job's end was handled: drop it again.
                if has_ended(shared, &id).await {
                    shared.last_progress.forget(&id);
                }
            }
        }
        if view.status.is_terminal() {
            shared.last_progress.forget(&id);
        }
        let step = match where_it_stands(shared, &handed, &event, &webhook_id, replay).await {
            Ok(step) => step,
            Err(e) => {
                warn!(error = %e, "cannot read the delivery record; retrying later");
                let _ = msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
                return;
            }
        };
        let n = match step {
            Step::Over => {
                let _ = msg.ack().await;
                return;
            }
            Step::Wait(left) => {
                let _ = msg.ack_with(AckKind::Nak(Some(left))).await;
                return;
            }
            Step::Attempt(n) => n,
        };
        if stop.is_cancelled() {
            // Stopping: hand the event to the next relay at once, unattempted.
            let _ = msg.ack_with(AckKind::Nak(None)).await;
            return;
        }
        let delivery = Delivery {
            of: Of::Job(&id),
            key: crate::claim::key(id.as_str(), &event.id),
            webhook_id: &webhook_id,
            event_type: &event_type,
            url: &hook.url,
            owner: view.owner().to_string(),
            data: serde_json::to_value(&view).expect("views serialise"),
            replay,
        };
        finish(&msg, attempt(shared, &delivery, n).await).await;
    }
    .instrument(span)
    .await
}

/// Acks or hands back an event after an attempt (see [`After`]).
pub(crate) async fn finish(msg: &jetstream::Message, after: After) {
    match after {
        After::Over => {
            let _ = msg.ack().await;
        }
        After::Retry(wait) | After::NotAttempted(wait) => {
            let _ = msg.ack_with(AckKind::Nak(Some(wait))).await;
        }
        // The claimant acks the event or hands it back; if it died, the ack wait brings
        // the event back and the claim's lease decides.
        After::Taken => {}
    }
}

/// Where the delivery of `webhook_id` stands. A first delivery of the event has no
/// attempt yet; a redelivery reads the attempts recorded for this delivery: same
/// `webhook-id` and replay flag, stored after the event (or the replay request) itself.
/// Progress lives in another stream, so its whole record is read (its `webhook-id` is
/// unique to the one progress event).
async fn where_it_stands(
    shared: &Shared,
    handed: &Handed,
    event: &Event,
    webhook_id: &str,
    replay: bool,
) -> Result<Step, webhook::RecordError> {
    let first = shared.config.schedule.first().copied().unwrap_or_default();
    let first_due = event.time + chrono::Duration::from_std(first).unwrap_or_default();
    let now = chrono::Utc::now();
    if handed.delivered <= 1 {
        return Ok(next_step(&[], first_due, now));
    }
    let after = if handed.is_progress { 0 } else { handed.seq };
    let all = webhook::delivery_attempts(&shared.js, &event.subject, after).await?;
    let mine: Vec<_> = all
        .iter()
        .filter(|r| r.attempt.webhook_id == webhook_id && r.attempt.replay == replay)
        .map(|r| (r.event.time, &r.attempt))
        .collect();
    Ok(next_step(&mine, first_due, now))
}
