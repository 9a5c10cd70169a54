//! Who is calling, and the one-time sign-in link of `stemq dev`.
//!
//! This module owns two small routes the page needs and API clients may use:
//!
//! - `GET /v1/me` (any key): the caller's owner, role and what the role allows, so a
//!   client can check a key and show only what it may do.
//! - `POST /v1/signin` (public) with `{"token": "..."}`: exchanges the one-time token of
//!   a sign-in link for the API key it stands for. Only `stemq dev` configures one
//!   ([`SigninLink`]); elsewhere the route is 404. The token travels in the link's
//!   fragment (`/#signin=<token>`), which browsers never send to a server or write to a
//!   log, and works once: a second use, or a wrong token, is 401.

use std::sync::Mutex;

use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use stemq_core::auth::{Caller, Permission, Role};

use crate::{ApiError, AppState};

/// A sign-in link that can be used once.
pub struct SigninLink {
    /// SHA-256 of the token (compared in constant time).
    token_hash: [u8; 32],
    /// The key it hands out; taken by the first use.
    key: Mutex<Option<String>>,
}

impl SigninLink {
    /// A fresh random token for `key`: returns the link and the token to put in it.
    pub fn new(key: String) -> (SigninLink, String) {
        let token = hex::encode(rand::random::<[u8; 32]>());
        (SigninLink { token_hash: Sha256::digest(token.as_bytes()).into(), key: Mutex::new(Some(key)) }, token)
    }

    /// The key, if `token` is this link's and it was not used yet.
    fn redeem(&self, token: &str) -> Option<String> {
        let given: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let same = given.iter().zip(self.token_hash.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        if !same {
            return None;
        }
        self.key.lock().expect("signin lock").take()
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
    /// The API key: send it as `Authorization: Bearer <key>`.
    pub key: String,
}

/// `POST /v1/signin`.
pub async fn signin(
    State(state): State<AppState>,
    body: Result<Json<SigninRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<SigninResponse>, ApiError> {
    let Some(link) = state.signin.as_deref() else {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            code: "not_found",
            message: "this server has no sign-in links; sign in with an API key".into(),
            field: None,
        });
    };
    let token = body.map(|Json(b)| b.token).unwrap_or_default();
    match link.redeem(token.trim()) {
        Some(key) => Ok(Json(SigninResponse { key })),
        None => Err(ApiError {
            status: StatusCode::UNAUTHORIZED,
            code: "unauthorized",
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
    fn a_link_works_once_and_only_with_its_token() {
        let (link, token) = SigninLink::new("sk_test".into());
        assert_eq!(token.len(), 64);
        assert_eq!(link.redeem("not-it"), None);
        assert_eq!(link.redeem(&token[..63]), None);
        assert_eq!(link.redeem(&token).as_deref(), Some("sk_test"));
        assert_eq!(link.redeem(&token), None, "a used link must not work again");
    }
}
