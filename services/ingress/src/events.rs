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
//! data: <the JobView as JSON>
//! ```
//!
//! `event` is `status` when the status changed since the previous message (and for the
//! first one), `progress` otherwise. The stream ends after the message carrying a
//! terminal status. A client that reconnects with `Last-Event-ID: <revision>` gets only
//! newer revisions (the bucket keeps the latest revision per job, so a resumed stream
//! starts at the current view, never at a stale one). NATS services get the same stream
//! by watching the key themselves (see `docs/events.md`).

use std::convert::Infallible;
use std::time::Duration;

use async_nats::jetstream::kv;
use axum::extract::{Extension, Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use stemq_core::auth::Caller;
use stemq_core::{JobStatus, JobView};

use crate::control::view_or_404;
use crate::{internal, ApiError, AppState};

struct Follow {
    watch: kv::Watch,
    after: u64,
    last_status: Option<JobStatus>,
    done: bool,
}

/// `GET /v1/separations/{id}/events`.
pub(crate) async fn sse(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let view = view_or_404(&state, &caller, &id).await?;
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let watch = state.bucket().watch_with_history(view.job_id.as_str()).await.map_err(internal)?;
    let follow = Follow { watch, after, last_status: None, done: false };
    let stream = futures::stream::unfold(follow, |mut f| async move {
        if f.done {
            return None;
        }
        loop {
            let entry = match f.watch.next().await {
                Some(Ok(e)) => e,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "status watch failed; ending the event stream");
                    return None;
                }
                None => return None,
            };
            if entry.operation != kv::Operation::Put {
                continue;
            }
            let Ok(view) = serde_json::from_slice::<JobView>(&entry.value) else {
                continue;
            };
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
            let data = serde_json::to_string(&view).expect("views serialise");
            let ev = SseEvent::default().id(entry.revision.to_string()).event(kind).data(data);
            return Some((Ok(ev), f));
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}
