//! Live job progress over Server-Sent Events: `GET /v1/separations/{id}/events`.
//!
//! This module owns the push side of the status API. It is a thin view of the job's
//! entry in the `stemq_jobs` KV bucket: a KV watch on the job's key yields every new
//! revision of the status view (status changes from the projector, progress heartbeats
//! from the worker via the compacted progress stream) and each becomes one SSE message:
//!
//! ```text
//! id: <KV revision>
//! event: status | progress
//! data: <the job as JSON: the JobView with its `urls`, as GET /v1/separations/{id}>
//! ```
//!
//! `event` is `status` when the status changed since the previous message (and for the
//! first one), `progress` otherwise. The stream ends after the message carrying a
//! terminal status. A client that reconnects with `Last-Event-ID: <revision>` gets only
//! newer revisions (the bucket keeps the latest revision per job, so a resumed stream
//! starts at the current view, never at a stale one). NATS services get the same stream
//! by watching the key themselves (see `docs/events.md`).
//!
//! Every message carries the read-time fields of `GET /v1/separations/{id}` (`waiting`,
//! `queue_position`, `eta`, `eta_seconds`: [`AppState::annotate`]). A queued job's place
//! moves without a revision of its own view (the jobs ahead of it start), so while the
//! job is queued the stream looks again every [`RECHECK`] and, when its position or its
//! `eta` moved, sends the view again: `event: progress`, with no `id:` (no new
//! revision; a client's `Last-Event-ID` stays the last revision's).

use std::convert::Infallible;
use std::time::Duration;

use async_nats::jetstream::kv;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use chrono::{DateTime, Utc};
use futures::{Stream, StreamExt};
use stemq_accounts::auth::Caller;
use stemq_core::{JobStatus, JobView};
use tokio::time::{Instant, Interval, MissedTickBehavior};

use crate::control::view_or_404;
use crate::error::internal;
use crate::links::Links;
use crate::rejection::Path;
use crate::{ApiError, AppState};

/// How often the stream of a queued job looks at its place again.
pub const RECHECK: Duration = Duration::from_secs(1);

struct Follow {
    state: AppState,
    watch: kv::Watch,
    links: Links,
    after: u64,
    last_status: Option<JobStatus>,
    /// The latest revision of the view (as stored), to send again when its place moves.
    latest: Option<JobView>,
    /// The place last sent: (`queue_position`, `eta`).
    sent: Option<(Option<u64>, Option<DateTime<Utc>>)>,
    recheck: Interval,
    done: bool,
}

/// What woke the stream up.
enum Wake {
    /// The watch: a revision, an error, or its end.
    Watch(Option<Result<kv::Entry, kv::WatcherError>>),
    /// Time to look at a queued job's place again.
    Recheck,
}

/// True when a client that was sent `sent` should hear of `now`: the position changed,
/// the eta came or went, or it moved by at least a second and a tenth of the wait.
fn moved(sent: Option<(Option<u64>, Option<DateTime<Utc>>)>, view: &JobView) -> bool {
    let Some((position, eta)) = sent else { return true };
    if position != view.queue_position {
        return true;
    }
    match (eta, view.eta) {
        (None, None) => false,
        (Some(a), Some(b)) => {
            let shift = (b - a).num_milliseconds().unsigned_abs();
            let wait = view.eta_seconds.unwrap_or(0) * 1000;
            shift >= 1000 && shift >= wait / 10
        }
        _ => true,
    }
}

/// `GET /v1/separations/{id}/events`.
pub(crate) async fn sse(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    links: Links,
    Path(crate::separations::JobPath { id }): Path<crate::separations::JobPath>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let view = view_or_404(&state, &caller, &id).await?;
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let watch = stemq_nats::read::watch_view(state.bucket(), &view.job_id).await.map_err(internal)?;
    let mut recheck = tokio::time::interval_at(Instant::now() + RECHECK, RECHECK);
    recheck.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let follow =
        Follow { state, watch, links, after, last_status: None, latest: None, sent: None, recheck, done: false };
    let stream = futures::stream::unfold(follow, |mut f| async move {
        if f.done {
            return None;
        }
        loop {
            let queued = f.latest.as_ref().is_some_and(|v| v.status == JobStatus::Queued);
            let wake = if queued {
                tokio::select! {
                    biased;
                    e = f.watch.next() => Wake::Watch(e),
                    _ = f.recheck.tick() => Wake::Recheck,
                }
            } else {
                Wake::Watch(f.watch.next().await)
            };
            let entry = match wake {
                Wake::Recheck => {
                    let Some(latest) = f.latest.clone() else { continue };
                    let view = f.state.annotate(latest);
                    if !moved(f.sent, &view) {
                        continue;
                    }
                    f.sent = Some((view.queue_position, view.eta));
                    let data = serde_json::to_string(&f.links.job(view)).expect("views serialise");
                    return Some((Ok(SseEvent::default().event("progress").data(data)), f));
                }
                Wake::Watch(Some(Ok(e))) => e,
                Wake::Watch(Some(Err(e))) => {
                    tracing::warn!(error = %e, "status watch failed; ending the event stream");
                    return None;
                }
                Wake::Watch(None) => return None,
            };
            if entry.operation != kv::Operation::Put {
                continue;
            }
            let Ok(view) = serde_json::from_slice::<JobView>(&entry.value) else {
                continue;
            };
            f.latest = Some(view.clone());
            if entry.revision <= f.after {
                // Already seen by the client; if it was the end, there is nothing more.
                if view.status.is_terminal() {
                    return None;
                }
                f.last_status = Some(view.status);
                continue;
            }
            f.after = entry.revision;
            let kind = if f.last_status == Some(view.status) { "progress" } else { "status" };
            f.last_status = Some(view.status);
            f.done = view.status.is_terminal();
            let view = f.state.annotate(view);
            f.sent = Some((view.queue_position, view.eta));
            let data = serde_json::to_string(&f.links.job(view)).expect("views serialise");
            let ev = SseEvent::default().id(entry.revision.to_string()).event(kind).data(data);
            return Some((Ok(ev), f));
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(position: Option<u64>, eta_ms: Option<i64>, eta_seconds: Option<u64>) -> JobView {
        let mut v: JobView = serde_json::from_value(serde_json::json!({
            "job_id": "0".repeat(64), "status": "queued", "updated_at": "2026-12-01T10:00:00Z",
            "attempt": 0, "retries": 0, "last_seq": 1
        }))
        .unwrap();
        v.queue_position = position;
        v.eta = eta_ms.and_then(DateTime::<Utc>::from_timestamp_millis);
        v.eta_seconds = eta_seconds;
        v
    }

    fn sent(position: Option<u64>, eta_ms: Option<i64>) -> Option<(Option<u64>, Option<DateTime<Utc>>)> {
        Some((position, eta_ms.and_then(DateTime::<Utc>::from_timestamp_millis)))
    }

    #[test]
    fn a_queued_job_is_sent_again_when_its_place_moves_and_only_then() {
        // Nothing sent yet: send.
        assert!(moved(None, &queued(Some(3), None, None)));
        // Same place: nothing to say.
        assert!(!moved(sent(Some(3), None), &queued(Some(3), None, None)));
        assert!(!moved(sent(Some(3), Some(60_000)), &queued(Some(3), Some(60_000), Some(50))));
        // The position moved, or the eta came or went.
        assert!(moved(sent(Some(3), Some(60_000)), &queued(Some(2), Some(60_000), Some(50))));
        assert!(moved(sent(Some(3), None), &queued(Some(3), Some(60_000), Some(50))));
        assert!(moved(sent(Some(3), Some(60_000)), &queued(Some(3), None, None)));
        // The eta moved: by less than a second, or by less than a tenth of the wait, is
        // noise; more is news.
        assert!(!moved(sent(Some(3), Some(60_000)), &queued(Some(3), Some(60_900), Some(10))));
        assert!(moved(sent(Some(3), Some(60_000)), &queued(Some(3), Some(61_500), Some(10))));
        assert!(!moved(sent(Some(3), Some(600_000)), &queued(Some(3), Some(605_000), Some(100))));
        assert!(moved(sent(Some(3), Some(600_000)), &queued(Some(3), Some(620_000), Some(100))));
    }
}
