//! The NATS-native submit endpoint: request-reply on `stemq.api.submit`.
//!
//! This module owns submit for services that speak NATS rather than HTTP. The request
//! payload is the same JSON as `POST /v1/separations`; the reply is the same JSON as the
//! HTTP answer, plus an `http_status` field (202, 200, 422 or 503) so callers can branch
//! the same way. Ingress instances share the queue group `ingress`.

use futures::StreamExt;
use serde_json::json;
use stemq_core::nats::SUBMIT_SUBJECT;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::submit::{submit, SubmitError};
use crate::AppState;

/// Serves until `shutdown`.
pub async fn serve(
    client: async_nats::Client,
    state: AppState,
    shutdown: CancellationToken,
) -> Result<(), async_nats::SubscribeError> {
    let mut sub = client.queue_subscribe(SUBMIT_SUBJECT, "ingress".to_string()).await?;
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = sub.next() => match m { Some(m) => m, None => break },
        };
        let Some(reply) = msg.reply.clone() else {
            continue;
        };
        let state = state.clone();
        let client = client.clone();
        tokio::spawn(async move {
            let tp = msg.headers.as_ref().and_then(|h| h.get("traceparent")).map(|v| v.to_string());
            let body = match submit(state.jetstream(), &msg.payload, None, tp, state.stores()).await {
                Ok((r, _)) => {
                    let mut v = serde_json::to_value(&r).expect("json");
                    let mut status = 202;
                    if r.cached {
                        status = 200;
                        if let Ok(Some(view)) = state.view(&r.job_id).await {
                            v["status"] = json!(view.status);
                        }
                    }
                    v["http_status"] = json!(status);
                    v
                }
                Err(SubmitError::Invalid(e)) => json!({
                    "http_status": 422,
                    "error": {"code": "invalid_request", "field": e.field, "message": e.to_string()}
                }),
                Err(SubmitError::Unavailable(m)) => json!({
                    "http_status": 503,
                    "error": {"code": "unavailable", "message": m}
                }),
            };
            if let Err(e) = client.publish(reply, serde_json::to_vec(&body).expect("json").into()).await {
                warn!(error = %e, "cannot reply to a NATS submit");
            }
        });
    }
    Ok(())
}
