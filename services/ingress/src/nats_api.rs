//! The NATS-native submit endpoint: request-reply on `stemq.api.submit`.
//!
//! This module owns submit for services that speak NATS rather than HTTP. The request
//! payload is the same JSON as `POST /v1/separations`; the reply is the same JSON as the
//! HTTP answer, plus an `http_status` field (202, 200, 401, 403, 422, 429 or 503) so
//! callers can branch the same way. The API key travels in an `Authorization: Bearer
//! <key>` header of the NATS message and obeys the same rules as over HTTP (owner from
//! the key, `submit` role or better, the key's limits). Ingress instances share the
//! queue group `ingress`.

use futures::StreamExt;
use serde_json::json;
use stemq_core::nats::SUBMIT_SUBJECT;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use stemq_core::auth::{KeyError, Permission};

use crate::access::{bearer, unauthenticated_operator};
use crate::pipeline::submit_as;
use crate::submit::SubmitError;
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
            let header = |name: &str| msg.headers.as_ref().and_then(|h| h.get(name)).map(|v| v.to_string());
            let tp = header("traceparent");
            let caller = match &state.keys {
                None => Ok(unauthenticated_operator()),
                Some(ring) => match header("Authorization").as_deref().and_then(bearer) {
                    None => Err((
                        401,
                        "unauthorized",
                        "an API key is required: header `Authorization: Bearer <key>`".to_string(),
                    )),
                    Some(token) => ring.authenticate(token).await.map_err(|e| match e {
                        KeyError::Store(_) => {
                            (503, "unavailable", "keys cannot be checked right now; retrying is safe".into())
                        }
                        e => (401, "unauthorized", e.to_string()),
                    }),
                },
            }
            .and_then(|c| {
                if c.role.allows(Permission::Write) {
                    Ok(c)
                } else {
                    Err((403, "forbidden", format!("a `{}` key cannot submit", c.role)))
                }
            });
            let result = match caller {
                Ok(c) => submit_as(&state, &c, &msg.payload, tp).await,
                Err((status, code, message)) => {
                    let body = json!({"http_status": status, "error": {"code": code, "message": message}});
                    if let Err(e) = client.publish(reply, serde_json::to_vec(&body).expect("json").into()).await {
                        warn!(error = %e, "cannot reply to a NATS submit");
                    }
                    return;
                }
            };
            let body = match result {
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
                Err(e @ SubmitError::Unserved { .. }) => json!({
                    "http_status": 422,
                    "error": {"code": "model_not_served", "field": "model", "message": e.to_string()}
                }),
                Err(SubmitError::Limited(l)) => json!({
                    "http_status": 429,
                    "retry_after": l.retry_after,
                    "error": {"code": if l.limit == "rate" { "rate_limited" } else { "too_many_in_flight" }, "message": l.message}
                }),
                Err(SubmitError::Refused(e)) => json!({
                    "http_status": e.status.as_u16(),
                    "error": {"code": e.code, "message": e.message}
                }),
                Err(e @ SubmitError::Unavailable { .. }) => json!({
                    "http_status": 503,
                    "error": {"code": "unavailable", "message": stemq_core::error::report(&e)}
                }),
            };
            if let Err(e) = client.publish(reply, serde_json::to_vec(&body).expect("json").into()).await {
                warn!(error = %e, "cannot reply to a NATS submit");
            }
        });
    }
    Ok(())
}
