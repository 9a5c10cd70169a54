//! The middleware of every route that is not access control ([`crate::access`]) or
//! body timing ([`crate::serve`]): the gate that answers 503 while NATS is down, and
//! the HTTP metrics.

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::{ApiError, AppState, ErrorCode};

/// Routes that read or write NATS answer 503 at once while the connection is down,
/// instead of waiting out request timeouts or serving a stale, empty list as if it were
/// complete. Uploads (the object store only) and the operational routes stay up.
pub(crate) async fn nats_gate(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let needs_nats = path.starts_with("/v1/") && !path.starts_with("/v1/uploads");
    if needs_nats && !connected_within(&state.js.client(), RECONNECT_GRACE).await {
        return ApiError {
            code: ErrorCode::Unavailable,
            message: "the queue (NATS) is unreachable right now; retrying later is safe".into(),
            field: None,
        }
        .into_response();
    }
    next.run(req).await
}

/// True when `client` is connected, or reconnects within `grace`.
async fn connected_within(client: &async_nats::Client, grace: std::time::Duration) -> bool {
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        if client.connection_state() == async_nats::connection::State::Connected {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// How long a request that needs NATS waits for a lost connection to come back before
/// 503: when its node dies, the client reconnects to another node of a cluster within
/// milliseconds (a refused connection costs nothing; the next attempt follows 1 ms
/// later).
const RECONNECT_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

/// Records each request's route, status and duration.
pub(crate) async fn track(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_else(|| "other".into());
    let method = req.method().to_string();
    let t0 = Instant::now();
    let resp = next.run(req).await;
    state.metrics.observe_http(&method, &route, resp.status().as_u16(), t0.elapsed());
    resp
}
