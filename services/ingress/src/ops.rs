//! The operational routes: liveness, readiness and metrics.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use stemq_nats as names;

use crate::AppState;

/// `GET /healthz`.
pub(crate) async fn healthz() -> &'static str {
    "ok"
}

/// `GET /readyz`: 200 once this ingress can publish (NATS connected, the job stream
/// there), has read the worker registry, and what the process waits for besides
/// ([`crate::Config::readiness`]) holds; else 503 naming what it waits for.
pub(crate) async fn ready(State(state): State<AppState>) -> Response {
    let connected = state.js.client().connection_state() == async_nats::connection::State::Connected;
    let mut waiting = Vec::new();
    if !(connected && names::ready(&state.js).await) {
        waiting.push("NATS (connected, with the job stream)");
    }
    if !state.registry.is_ready() {
        waiting.push("the worker registry read");
    }
    waiting.extend(state.readiness.pending());
    let (code, text) = stemq_telemetry::readiness::probe_answer(&waiting);
    (StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE), text).into_response()
}

/// `/metrics`: OpenMetrics when the scraper asks for it, classic text 0.0.4 otherwise.
pub(crate) async fn metrics_text(State(state): State<AppState>, headers: axum::http::HeaderMap) -> Response {
    let accept = headers.get_all(axum::http::header::ACCEPT).iter().filter_map(|v| v.to_str().ok());
    let format = stemq_telemetry::metrics::Format::negotiate(accept);
    let body = state.metrics.render(format, state.queue_metrics).await;
    ([(axum::http::header::CONTENT_TYPE, format.content_type())], body).into_response()
}
