//! Who is calling, and the one-time sign-in link of `stemq dev`.
//!
//! This module owns two small routes the page needs and API clients may use:
//!
//! - `GET /v1/me` (any key): the caller's owner, role and what the role allows, so a
//!   client can check a key and show only what it may do.
//! - `POST /v1/signin` (public) with `{"token": "..."}`: exchanges the one-time token of
//!   a sign-in link for a session key: a new API key of the link's owner and role that
//!   expires after [`stemq_accounts::auth::SESSION_LIFETIME`] (12 h), listed by `stemq keys
//!   list` and revoked by `stemq keys revoke` as any key. No long-lived key ever leaves
//!   the server this way. Only `stemq dev` configures a link ([`SigninLink`]); elsewhere
//!   the route is 404. The token travels in the link's fragment (`/#signin=<token>`),
//!   which browsers never send to a server or write to a log, and works once: a second
//!   use, or a wrong token, is 401.
//!
//! Every answer that carries a secret (the session key here, the webhook signing secret)
//! is sent with `Cache-Control: no-store` ([`NoStore`]): no cache on the way keeps it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::kv;
use axum::extract::{Extension, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use stemq_accounts::auth::{self, Caller, Limits, Permission, Role};
use tracing::{info, warn};

use crate::{ApiError, AppState, ErrorCode};

/// A JSON answer that carries a secret: sent with `Cache-Control: no-store`.
pub struct NoStore<T>(pub T);

impl<T: Serialize> IntoResponse for NoStore<T> {
    fn into_response(self) -> Response {
        let mut resp = Json(self.0).into_response();
        resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        resp
    }
}

/// What a sign-in link's session key may do, and for how long.
#[derive(Debug, Clone)]
pub struct SessionGrant {
    /// Whose jobs.
    pub owner: String,
    /// Its role.
    pub role: Role,
    /// Its limits.
    pub limits: Limits,
    /// Its lifetime.
    pub lifetime: Duration,
}

/// A random token that can be taken once.
struct OneTimeToken {
    /// SHA-256 of the token (compared in constant time).
    hash: [u8; 32],
    /// Set by the first use.
    used: AtomicBool,
}

impl OneTimeToken {
    /// A fresh token: returns it and the text to hand out.
    fn new() -> (OneTimeToken, String) {
        let token = hex::encode(rand::random::<[u8; 32]>());
        (OneTimeToken { hash: Sha256::digest(token.as_bytes()).into(), used: AtomicBool::new(false) }, token)
    }

    /// True when `token` is this one and it was not taken yet; takes it.
    fn take(&self, token: &str) -> bool {
        let given: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let same = given.iter().zip(self.hash.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        same && !self.used.swap(true, Ordering::AcqRel)
    }

    /// Makes a taken token usable again (its use failed on the server's side).
    fn give_back(&self) {
        self.used.store(false, Ordering::Release);
    }
}

/// A sign-in link that can be used once: its first use mints a session key.
pub struct SigninLink {
    token: OneTimeToken,
    /// The keys bucket, through a connection that may create keys (`stemq dev`'s
    /// operator; the ingress's own NATS user only reads keys).
    keys: kv::Store,
    /// What the minted key may do.
    grant: SessionGrant,
}

/// Why a sign-in did not give a key.
enum Refused {
    /// A wrong token, or a used one.
    Token,
    /// The key could not be stored (the link stays usable).
    Store(auth::KeyError),
}

impl SigninLink {
    /// A fresh random token for a link minting `grant` in `keys`: returns the link and
    /// the token to put in it.
    pub fn new(keys: kv::Store, grant: SessionGrant) -> (SigninLink, String) {
        let (token, text) = OneTimeToken::new();
        (SigninLink { token, keys, grant }, text)
    }

    /// A new session key, if `token` is this link's and it was not used yet.
    async fn redeem(&self, token: &str) -> Result<(auth::ApiKey, auth::KeyRecord), Refused> {
        if !self.token.take(token) {
            return Err(Refused::Token);
        }
        let g = &self.grant;
        match auth::create_session(&self.keys, &g.owner, g.role, g.limits, "page session (sign-in link)", g.lifetime)
            .await
        {
            Ok(minted) => Ok(minted),
            Err(e) => {
                self.token.give_back();
                Err(Refused::Store(e))
            }
        }
    }
}

/// Body of `POST /v1/signin`.
#[derive(Debug, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SigninRequest {
    /// The token of the link (after `#signin=`).
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub token: String,
}

/// Answer of `POST /v1/signin`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct SigninResponse {
    /// The session key: send it as `Authorization: Bearer <key>`.
    pub key: String,
    /// Its id (`stemq keys revoke <id>` ends the session).
    pub key_id: String,
    /// When it stops working.
    pub expires_at: DateTime<Utc>,
}

/// `POST /v1/signin`.
pub async fn signin(
    State(state): State<AppState>,
    body: Result<Json<SigninRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<NoStore<SigninResponse>, ApiError> {
    let Some(link) = state.signin.as_deref() else {
        return Err(ApiError {
            code: ErrorCode::NotFound,
            message: "this server has no sign-in links; sign in with an API key".into(),
            field: None,
        });
    };
    let token = body.map(|Json(b)| b.token).unwrap_or_default();
    match link.redeem(token.trim()).await {
        Ok((key, record)) => {
            info!(key_id = %record.id, owner = %record.owner, role = %record.role, "signed in with a one-time link");
            let expires_at = record.expires_at.unwrap_or_else(Utc::now);
            Ok(NoStore(SigninResponse { key: key.expose(), key_id: record.id, expires_at }))
        }
        Err(Refused::Store(e)) => {
            warn!(error = %e, "cannot store a session key");
            Err(ApiError {
                code: ErrorCode::Unavailable,
                message: "the session key could not be stored; the link still works, try again".into(),
                field: None,
            })
        }
        Err(Refused::Token) => Err(ApiError {
            code: ErrorCode::Unauthorized,
            message: "this sign-in link is wrong or was used already; sign in with an API key \
                      (stemq dev writes one to <data-dir>/admin.key)"
                .into(),
            field: None,
        }),
    }
}

/// Answer of `GET /v1/me`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct Me {
    /// The owner whose jobs this key sees (an operator sees every owner's).
    pub owner: String,
    /// The key's role.
    pub role: Role,
    /// The key's id (not the key).
    pub key_id: String,
    /// What the role allows.
    pub can: Can,
}

/// What a role allows, by permission.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct Can {
    /// Read jobs, stems, events.
    pub read: bool,
    /// Submit, upload, cancel, retry.
    pub write: bool,
    /// The webhook secret and endpoints.
    pub webhooks: bool,
    /// Every owner's jobs and the operators' views.
    pub operate: bool,
}

/// `GET /v1/me`.
pub async fn me(Extension(caller): Extension<Caller>) -> Json<Me> {
    let r = caller.role;
    Json(Me {
        owner: caller.owner.clone(),
        role: r,
        key_id: caller.key_id.clone(),
        can: Can {
            read: r.allows(Permission::Read),
            write: r.allows(Permission::Write),
            webhooks: r.allows(Permission::WebhookAdmin),
            operate: r.allows(Permission::Operate),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_taken_once_and_only_whole() {
        let (t, token) = OneTimeToken::new();
        assert_eq!(token.len(), 64);
        assert!(!t.take("not-it"));
        assert!(!t.take(&token[..63]));
        assert!(t.take(&token));
        assert!(!t.take(&token), "a used link must not work again");
        t.give_back();
        assert!(t.take(&token), "a use that failed on the server's side leaves the link usable");
    }
}
