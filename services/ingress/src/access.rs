//! Who may call which route: API key authentication and the role each route needs.
//!
//! This module owns the HTTP access rules in one table ([`permission`]) and the
//! middleware that applies it ([`authenticate`]):
//!
//! - `/healthz`, `/readyz`, `/openapi.json`, the page (`/`, `/app/{file}`,
//!   `/favicon.ico`: it holds no data) and `POST /v1/signin` (it takes a one-time token
//!   instead) are public; everything else needs
//!   `Authorization: Bearer sk_…`. No key, a malformed, unknown or revoked key: 401 with
//!   `WWW-Authenticate: Bearer`. A key whose role does not allow the route: 403.
//! - A key in the query string (`?api_key=`, `?token=`, any value starting `sk_`) is
//!   refused with 400 before anything else: URLs end up in logs and browser history.
//!   So is a request with more than one `Authorization` header (400): which one counts
//!   would depend on who reads it (a proxy may check one, the ingress another).
//! - The caller ([`Caller`]) goes into the request's extensions; handlers take it with
//!   `Extension<Caller>` and scope every job to its owner ([`Caller::sees`]): another
//!   owner's job is a 404 on every route, so existence is not leaked.
//!
//! With authentication off (`--insecure-no-auth`, loopback only) every request is the
//! operator of the owner `local`.

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use stemq_accounts::auth::{Caller, KeyError, Limits, Permission, Role};
use tracing::warn;

use crate::{ApiError, AppState, ErrorCode};

/// The owner of every request when authentication is off, and of `stemq dev`'s key.
pub const LOCAL_OWNER: &str = "local";

/// The caller when authentication is off.
pub fn unauthenticated_operator() -> Caller {
    Caller {
        key_id: "none".into(),
        owner: LOCAL_OWNER.into(),
        role: Role::Operator,
        limits: Limits::default(),
        priority: Default::default(),
    }
}

/// The permission a route needs; `None` for the public routes.
pub fn permission(method: &Method, route: &str) -> Option<Permission> {
    match (method.as_str(), route) {
        (_, "/healthz" | "/readyz" | "/openapi.json" | "/asyncapi.json") => None,
        ("GET" | "HEAD", "/" | "/app/{file}" | "/favicon.ico") => None,
        ("POST", "/v1/signin") => None,
        ("GET", "/metrics" | "/v1/workers" | "/v1/overview") => Some(Permission::Operate),
        (_, "/v1/webhooks/secret" | "/v1/webhooks/secret/rotate" | "/v1/webhooks/enable") => {
            Some(Permission::WebhookAdmin)
        }
        ("GET" | "HEAD", _) => Some(Permission::Read),
        // Every write route, and anything unknown (which then 404s or 405s once the
        // caller is known).
        _ => Some(Permission::Write),
    }
}

/// Query parameter names that carry credentials in other APIs.
const KEY_PARAMS: [&str; 6] = ["api_key", "apikey", "key", "token", "access_token", "authorization"];

fn key_in_query(query: &str) -> bool {
    url::form_urlencoded::parse(query.as_bytes()).any(|(k, v)| {
        KEY_PARAMS.contains(&k.to_ascii_lowercase().as_str())
            || v.trim_start().starts_with(stemq_accounts::auth::KEY_PREFIX)
    })
}

/// 401 without a key.
pub(crate) fn key_required() -> ApiError {
    ApiError::new(ErrorCode::Unauthorized, "an API key is required: send `Authorization: Bearer <key>`")
}

/// Why a key was not taken: 401 for the key, 503 when the keys bucket did not answer
/// (its error goes to the log).
pub(crate) fn key_refused(e: KeyError) -> ApiError {
    match e {
        e if e.is_unavailable() => {
            warn!(error = %stemq_nats::error::report(&e), "cannot read the keys bucket");
            ApiError::new(ErrorCode::Unavailable, "keys cannot be checked right now; retrying is safe")
        }
        e => ApiError::new(ErrorCode::Unauthorized, e.to_string()),
    }
}

/// 403 for a key whose role does not allow what it asked.
pub(crate) fn forbidden(role: Role) -> ApiError {
    ApiError::new(
        ErrorCode::Forbidden,
        format!("a `{role}` key cannot do this; it needs a key with a role that allows it"),
    )
}

/// A 401 with its `WWW-Authenticate` challenge.
fn unauthorized(e: ApiError, bad_token: bool) -> Response {
    let mut resp = e.into_response();
    let challenge =
        if bad_token { r#"Bearer realm="stemq", error="invalid_token""# } else { r#"Bearer realm="stemq""# };
    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    resp
}

/// The bearer token of `Authorization`, if it is one.
pub fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Authenticates the request and checks its route's permission (see the module doc).
pub async fn authenticate(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    if req.uri().query().is_some_and(key_in_query) {
        return ApiError {
            code: ErrorCode::KeyInQuery,
            message: "API keys are never accepted in a URL; send `Authorization: Bearer <key>`, and revoke a key that \
                      was put in a URL (`stemq keys revoke ID`)"
                .into(),
            field: None,
        }
        .into_response();
    }
    if req.headers().get_all(header::AUTHORIZATION).iter().nth(1).is_some() {
        return ApiError {
            code: ErrorCode::BadRequest,
            message: "send one Authorization header, not several".into(),
            field: None,
        }
        .into_response();
    }
    let route = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string());
    let Some(needed) = permission(req.method(), route.as_deref().unwrap_or(req.uri().path())) else {
        return next.run(req).await;
    };
    let caller = match &state.keys {
        None => unauthenticated_operator(),
        Some(ring) => {
            let Some(value) = req.headers().get(header::AUTHORIZATION) else {
                return unauthorized(key_required(), false);
            };
            let Some(token) = value.to_str().ok().and_then(bearer) else {
                let e = ApiError::new(ErrorCode::Unauthorized, "the Authorization header must be `Bearer <key>`");
                return unauthorized(e, true);
            };
            match ring.authenticate(token).await {
                Ok(c) => c,
                Err(e) if e.is_unavailable() => return key_refused(e).into_response(),
                Err(e) => return unauthorized(key_refused(e), true),
            }
        }
    };
    if !caller.role.allows(needed) {
        return forbidden(caller.role).into_response();
    }
    req.extensions_mut().insert(caller);
    next.run(req).await
}

/// 403 unless `caller` may do `p` (for checks finer than the route's).
pub fn require(caller: &Caller, p: Permission) -> Result<(), ApiError> {
    if caller.role.allows(p) {
        Ok(())
    } else {
        Err(ApiError {
            code: ErrorCode::Forbidden,
            message: format!("a `{}` key cannot do this", caller.role),
            field: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_has_a_rule() {
        let public = ["/healthz", "/readyz", "/openapi.json", "/asyncapi.json"];
        for r in public {
            assert_eq!(permission(&Method::GET, r), None, "{r}");
        }
        assert_eq!(permission(&Method::GET, "/v1/separations/{id}"), Some(Permission::Read));
        assert_eq!(permission(&Method::POST, "/v1/separations"), Some(Permission::Write));
        assert_eq!(permission(&Method::POST, "/v1/separations/{id}/cancel"), Some(Permission::Write));
        assert_eq!(permission(&Method::POST, "/v1/batches"), Some(Permission::Write));
        assert_eq!(permission(&Method::GET, "/v1/batches/{id}"), Some(Permission::Read));
        assert_eq!(permission(&Method::GET, "/v1/webhooks/secret"), Some(Permission::WebhookAdmin));
        assert_eq!(permission(&Method::POST, "/v1/webhooks/secret/rotate"), Some(Permission::WebhookAdmin));
        assert_eq!(permission(&Method::GET, "/metrics"), Some(Permission::Operate));
        assert_eq!(permission(&Method::DELETE, "/nowhere"), Some(Permission::Write));
    }

    #[test]
    fn keys_in_query_strings_are_spotted() {
        for q in ["api_key=x", "token=abc", "a=1&Key=2", "x=sk_0123", "access_token=", "x=%20sk_1"] {
            assert!(key_in_query(q), "{q}");
        }
        for q in ["status=queued&limit=5", "cursor=12.ab", "filename=a.wav"] {
            assert!(!key_in_query(q), "{q}");
        }
    }

    #[test]
    fn bearer_tokens_parse() {
        assert_eq!(bearer("Bearer sk_1"), Some("sk_1"));
        assert_eq!(bearer("bearer  sk_1 "), Some("sk_1"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("sk_1"), None);
    }
}
