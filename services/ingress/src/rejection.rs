//! The framework's own refusals, in the API's error shape.
//!
//! axum answers some requests before a handler decides anything: no route (404), a
//! route without that method (405), a body past the limit (413), a path or query string
//! that does not parse (400), a JSON body of the wrong type or shape (415, 400, 422).
//! Left alone it answers in plain text; here each becomes an [`ApiError`]
//! (`{"error": {"code", "message"}}`, as every other error of the API) with axum's status
//! and a code that names it:
//!
//! | status | code |
//! |---|---|
//! | 400 | `bad_request` |
//! | 404 | `not_found` ([`no_route`]) |
//! | 405 | `method_not_allowed` ([`wrong_method`]; `Allow` lists the methods there are) |
//! | 413 | `too_large` |
//! | 415 | `unsupported_media_type` |
//! | 422 | `invalid_request` |
//!
//! Handlers take [`Query`], [`Path`] and [`Bytes`] from here instead of axum's, whose
//! rejections they turn into that shape; a handler that takes axum's `Json` gets the
//! same with `Result<Json<T>, JsonRejection>` and `?`. Framework failures on the server's
//! side (5xx) answer without their internals, which go to the log.

use axum::extract::rejection::{BytesRejection, JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode, Uri};
use serde::de::DeserializeOwned;
use tracing::warn;

use crate::{ApiError, ErrorCode};

/// The largest request body a handler buffers (`POST /v1/separations` and the other
/// JSON bodies; uploads are streamed and have their own limit): 2 MiB.
pub const BODY_LIMIT: usize = 2 << 20;

/// An error of the framework with `status` and its own `message`.
fn refusal(status: StatusCode, message: String) -> ApiError {
    if status.is_server_error() {
        warn!(%status, error = %message, "request refused by the framework");
        return ApiError::new(ErrorCode::Internal, "the request could not be handled; the server logged why");
    }
    let code = match status {
        StatusCode::NOT_FOUND => ErrorCode::NotFound,
        StatusCode::METHOD_NOT_ALLOWED => ErrorCode::MethodNotAllowed,
        StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::TooLarge,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ErrorCode::UnsupportedMediaType,
        StatusCode::UNPROCESSABLE_ENTITY => ErrorCode::InvalidRequest,
        _ => ErrorCode::BadRequest,
    };
    ApiError::new(code, message)
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> ApiError {
        refusal(r.status(), r.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> ApiError {
        refusal(r.status(), r.body_text())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> ApiError {
        refusal(r.status(), r.body_text())
    }
}

impl From<BytesRejection> for ApiError {
    fn from(r: BytesRejection) -> ApiError {
        match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => {
                refusal(StatusCode::PAYLOAD_TOO_LARGE, format!("request bodies are limited to {BODY_LIMIT} bytes"))
            }
            status => refusal(status, r.body_text()),
        }
    }
}

/// The fallback of unknown routes: 404 `not_found`.
pub(crate) async fn no_route(uri: Uri) -> ApiError {
    refusal(StatusCode::NOT_FOUND, format!("no route {}; the routes are listed at /openapi.json", uri.path()))
}

/// The fallback of known routes asked with another method: 405 `method_not_allowed`
/// (axum adds `Allow`).
pub(crate) async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    refusal(StatusCode::METHOD_NOT_ALLOWED, format!("{method} is not allowed on {}", uri.path()))
}

/// axum's `Query`, refusing in the API's shape.
#[derive(Debug)]
pub struct Query<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Query<T>, ApiError> {
        Ok(Query(axum::extract::Query::<T>::from_request_parts(parts, state).await?.0))
    }
}

/// axum's `Path`, refusing in the API's shape.
#[derive(Debug)]
pub struct Path<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Path<T>, ApiError> {
        Ok(Path(axum::extract::Path::<T>::from_request_parts(parts, state).await?.0))
    }
}

/// The whole request body (up to [`BODY_LIMIT`]), refusing in the API's shape.
#[derive(Debug)]
pub struct Bytes(pub axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for Bytes {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Bytes, ApiError> {
        Ok(Bytes(axum::body::Bytes::from_request(req, state).await?))
    }
}

impl std::ops::Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}
