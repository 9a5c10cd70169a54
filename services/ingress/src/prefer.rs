//! `Prefer: wait=N` (RFC 7240): answer once the job has ended, or after N seconds.
//!
//! This module owns waiting on a job inside one request, for clients that would rather
//! hold a request open than poll or follow events. `POST /v1/separations` and
//! `GET /v1/separations/{id}` honour it: the answer is the job's view as soon as the job
//! ends (any terminal status), else its current view once N seconds have passed. N is
//! capped at [`MAX_WAIT`]; an honoured wait is confirmed with
//! `Preference-Applied: wait=N` (the capped N), and both routes answer `Vary: Prefer`.
//! Other preferences (`respond-async`, `return=…`) are ignored, as RFC 7240 allows.
//!
//! The wait follows the job's key in the status bucket (a KV watch, as the event stream
//! of [`crate::events`] does), so the answer leaves with the revision that ends the job
//! rather than at the next poll. Access is decided before any wait: the caller gets
//! another owner's job as a 404 at once ([`crate::AppState::view_for`]), and the view it
//! finally gets is read through the same rule. A wait ends early when the ingress shuts
//! down.

use std::time::Duration;

use async_nats::jetstream::kv;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use futures::StreamExt;
use stemq_accounts::auth::Caller;
use stemq_core::JobView;
use tracing::warn;

use crate::{ApiError, AppState};

/// The longest wait honoured; a client asking for more waits this long.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// The `wait` preference of the request's `Prefer` headers in seconds, capped at
/// [`MAX_WAIT`]; `None` when there is none (or its value is not a number of seconds).
/// Several preferences may share a header or come in several headers; the first `wait`
/// counts, and any parameters after `;` are ignored.
pub fn wait(headers: &HeaderMap) -> Option<u64> {
    let cap = MAX_WAIT.as_secs();
    headers.get_all("prefer").iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).find_map(|pref| {
        let pref = pref.split(';').next().unwrap_or_default();
        let (name, value) = pref.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("wait") {
            return None;
        }
        let value = value.trim();
        let value = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(value);
        if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        // Digits past u64 are a very long wait: capped like any other.
        Some(value.parse::<u64>().map_or(cap, |n| n.min(cap)))
    })
}

/// A job's view after a wait, and whether the wait was honoured (`false`: the status
/// bucket could not be watched, so the view was answered at once).
#[derive(Debug)]
pub struct Waited {
    /// The view to answer with.
    pub view: JobView,
    /// The wait ran (or was not needed: the job had ended).
    pub honoured: bool,
}

/// Waits up to `secs` for the job of `view` (already read for `caller`) to end, and
/// returns its view then, or its current view when the time is up.
pub(crate) async fn until_ended(
    state: &AppState,
    caller: &Caller,
    view: JobView,
    secs: u64,
) -> Result<Waited, ApiError> {
    if view.status.is_terminal() || secs == 0 {
        return Ok(Waited { view, honoured: true });
    }
    let id = view.job_id.clone();
    // The watch starts with the key's latest revision, so an end written between the
    // read of `view` and here is not missed.
    let mut watch = match stemq_nats::read::watch_view(state.bucket(), &id).await {
        Ok(w) => w,
        Err(e) => {
            warn!(job_id = %id, error = %e, "cannot watch the status view; answering without waiting");
            return Ok(Waited { view, honoured: false });
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let (ended, honoured) = loop {
        let entry = tokio::select! {
            _ = tokio::time::sleep_until(deadline) => break (None, true),
            _ = state.stopping.cancelled() => break (None, true),
            e = watch.next() => e,
        };
        match entry {
            Some(Ok(e)) if e.operation == kv::Operation::Put => {
                if let Ok(v) = serde_json::from_slice::<JobView>(&e.value) {
                    if v.status.is_terminal() {
                        break (Some(v), true);
                    }
                }
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                warn!(job_id = %id, error = %e, "the status watch failed; answering the current view");
                break (None, false);
            }
            None => break (None, false),
        }
    };
    // The revision that ended the job is the answer (a read now could be served by a
    // replica that has not seen it yet), under the same access rule as any read.
    if let Some(v) = ended.filter(|v| caller.sees(v.owner())) {
        return Ok(Waited { view: state.annotate(v), honoured });
    }
    // Not ended within the wait (or the ended view lacks its request): read it now, as
    // any read is.
    match state.view_for(caller, &id).await? {
        Some(view) => Ok(Waited { view, honoured }),
        None => Ok(Waited { view, honoured: false }),
    }
}

/// Marks an answer of a route that honours `Prefer: wait`: `Vary: Prefer` always, and
/// `Preference-Applied: wait=N` when a wait of N seconds was honoured.
pub(crate) fn mark(resp: &mut Response, applied: Option<u64>) {
    let h = resp.headers_mut();
    h.append(header::VARY, HeaderValue::from_static("prefer"));
    if let Some(n) = applied {
        h.insert("preference-applied", HeaderValue::from_str(&format!("wait={n}")).expect("ascii"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefer(values: &[&str]) -> Option<u64> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("prefer", HeaderValue::from_str(v).unwrap());
        }
        wait(&h)
    }

    #[test]
    fn wait_is_read_as_rfc_7240_writes_it() {
        assert_eq!(prefer(&[]), None);
        assert_eq!(prefer(&["wait=10"]), Some(10));
        assert_eq!(prefer(&["respond-async, wait=5"]), Some(5));
        assert_eq!(prefer(&["respond-async", "Wait = 7"]), Some(7));
        assert_eq!(prefer(&["wait=\"3\""]), Some(3));
        assert_eq!(prefer(&["wait=4;foo=bar"]), Some(4));
        assert_eq!(prefer(&["return=minimal", "wait=0"]), Some(0));
        // The first wait counts.
        assert_eq!(prefer(&["wait=2, wait=9"]), Some(2));
    }

    #[test]
    fn long_waits_are_capped_and_bad_ones_ignored() {
        assert_eq!(prefer(&["wait=61"]), Some(60));
        assert_eq!(prefer(&["wait=99999999999999999999999"]), Some(60));
        for bad in ["wait=", "wait=-1", "wait=1.5", "wait=soon", "waits=3", "wait"] {
            assert_eq!(prefer(&[bad]), None, "{bad}");
        }
    }
}
