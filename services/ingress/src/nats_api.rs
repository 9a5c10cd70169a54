//! The NATS-native submit endpoint: request-reply on `stemq.api.submit`.
//!
//! This module owns submit for services that speak NATS rather than HTTP. The request
//! payload is the same JSON as `POST /v1/separations`; the reply is the same JSON as the
//! HTTP answer, plus an `http_status` field (202, 200, or an error's status: [`ERRORS`])
//! so callers can branch the same way. The API key travels in an `Authorization: Bearer
//! <key>` header of the NATS message and obeys the same rules as over HTTP (owner from
//! the key, `submit` role or better, the key's limits); its errors are the HTTP ones
//! ([`ApiError`]), with `retry_after` (seconds) where HTTP says `Retry-After`. Ingress instances share the
//! queue group `ingress`.

use futures::StreamExt;
use serde_json::json;
use stemq_nats::SUBMIT_SUBJECT;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use stemq_accounts::auth::Permission;

use crate::access::{bearer, forbidden, key_refused, key_required, unauthenticated_operator};
use crate::pipeline::submit_as;
use crate::{ApiError, AppState, ErrorCode};

/// Every error the endpoint answers with: the key's (401, 403), the credits' (402), the
/// request's (422), the limits' (429) and a dependency's (503), as over HTTP.
pub const ERRORS: [ErrorCode; 8] = [
    ErrorCode::Unauthorized,
    ErrorCode::InsufficientCredits,
    ErrorCode::Forbidden,
    ErrorCode::InvalidRequest,
    ErrorCode::ModelNotServed,
    ErrorCode::RateLimited,
    ErrorCode::TooManyInFlight,
    ErrorCode::Unavailable,
];

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
                    None => Err(key_required()),
                    Some(token) => ring.authenticate(token).await.map_err(key_refused),
                },
            }
            .and_then(|c| if c.role.allows(Permission::Write) { Ok(c) } else { Err(forbidden(c.role)) });
            let body = match caller {
                Err(e) => e.nats_reply(None),
                Ok(c) => match submit_as(&state, &c, &msg.payload, tp).await {
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
                    Err(e) => {
                        let retry_after = e.retry_after();
                        ApiError::from(e).nats_reply(retry_after)
                    }
                },
            };
            if let Err(e) = client.publish(reply, serde_json::to_vec(&body).expect("json").into()).await {
                warn!(error = %e, "cannot reply to a NATS submit");
            }
        });
    }
    Ok(())
}
